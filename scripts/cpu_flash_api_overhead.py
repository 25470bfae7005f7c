"""Host time of attnsel.flash_attn_with_kvcache's and flash_attn_varlen_func's own bodies on this machine's CPU: the
call with its cached plan's run function replaced by a no-op, against the no-op alone (32/8 heads, head_dim 128,
bf16, batch 8; prefill 8 x 128 tokens).

Usage: python3 scripts/cpu_flash_api_overhead.py   (no GPU needed; median of 5 loops of 20000 calls)
Left out, by running on CPU tensors: the CUDA capture query (0.4-0.6 us on the H200 machine's host) and a run
function's ``current()`` (FlashInfer's; 0.1-0.2 us there).
"""
from __future__ import annotations

import statistics
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnsel  # noqa: E402
from attnsel import flash_api  # noqa: E402


def per_call_us(fn, n: int = 20000) -> float:
    return statistics.median(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main() -> None:
    flash_api.configure(prefill="torch", decode="torch", use_cache=False)
    b, hq, hk, d, ps, pages = 8, 32, 8, 128, 16, 20
    q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16)
    kc = torch.randn(b * pages, ps, hk, d, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    lens = torch.full((b,), 100, dtype=torch.int32)
    call = lambda: attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table,  # noqa: E731
                                                   causal=True)
    call()
    slot = next(s for s in flash_api.default()._plans if s[0] == "decode")
    entry = flash_api.default()._plans[slot]
    out = q[:, 0].clone()
    noop = lambda q, k, v, **kwargs: out  # noqa: E731
    flash_api.default()._plans[slot] = entry[:-1] + ((entry[-1][0], noop),)
    q2 = q[:, 0]
    api, direct = per_call_us(call), per_call_us(lambda: noop(q2, kc, vc))
    print(f"flash_attn_with_kvcache: {api:.2f} us per call, no-op run alone {direct:.2f} us: overhead "
          f"{api - direct:.2f} us")
    tq = torch.randn(8 * 128, hq, d, dtype=torch.bfloat16)
    tk = torch.randn(8 * 128, hk, d, dtype=torch.bfloat16)
    tv = torch.randn_like(tk)
    cu = torch.arange(0, 8 * 128 + 1, 128, dtype=torch.int32)
    call = lambda: attnsel.flash_attn_varlen_func(tq, tk, tv, cu, cu, 128, 128, causal=True)  # noqa: E731
    call()
    slot = next(s for s in flash_api.default()._plans if s[0] == "prefill")
    flash_api.default()._plans[slot] = flash_api.default()._plans[slot][:-1] + (noop,)
    api, direct = per_call_us(call), per_call_us(lambda: noop(tq, tk, tv))
    print(f"flash_attn_varlen_func: {api:.2f} us per call, no-op run alone {direct:.2f} us: overhead "
          f"{api - direct:.2f} us")


if __name__ == "__main__":
    main()
