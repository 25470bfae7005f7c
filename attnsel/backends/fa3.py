"""fa3: FlashAttention 3 (package tokenspeed-fa3, module flash_attn_interface). Hopper only.

Calls the raw op ``torch.ops.flash_attn_3.fwd``: the Python wrappers add a ``torch.library.custom_op`` layer that
costs ~100 us of host time per call (DESIGN.md), more than a small decode's kernel. Decode scheduling metadata is
computed once in plan.
"""
from __future__ import annotations

import importlib.util

import torch

from ..device import capability_reason, package_version
from ..spec import AttentionSpec
from . import Phase, RunFn

# FA3 compiles kernels for these head_dim bins; a head_dim runs in the smallest bin that holds it.
_HDIM_BINS = (64, 96, 128, 192, 256)


def _build_flags() -> dict:
    from flash_attn_config import (
        CONFIG,  # a plain dict written at build time; imports no CUDA code
    )

    return CONFIG["build_flags"]


def head_dim_reason(head_dim: int) -> str | None:
    flags = _build_flags()
    enabled = [d for d in _HDIM_BINS if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}", False)]
    bin_ = next((d for d in _HDIM_BINS if head_dim <= d), None)
    if bin_ is None or bin_ not in enabled or head_dim % 8:
        return f"head_dim {head_dim} is not supported by this FA3 build (supported: {', '.join(map(str, enabled))})"
    return None


def _fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
         page_table=None, softmax_scale, causal, scheduler_metadata=None, num_splits=1):
    return torch.ops.flash_attn_3.fwd(
        q, k, v, None, None, None, None,  # k_new, v_new, qv, out
        cu_seqlens_q, cu_seqlens_k, None, None, seqused_k, max_seqlen_q, max_seqlen_k,
        page_table, None, None, None, None, None,  # kv_batch_idx, leftpad_k, rotary cos/sin/seqlens
        None, None, None, softmax_scale, causal,  # q/k/v descale
        -1, -1, 0, 0.0, True,  # window left/right, attention_chunk, softcap, rotary_interleaved
        scheduler_metadata, num_splits, None, 0, None)[0]  # pack_gqa, sm_margin, sinks


class FA3Backend:
    name = "fa3"

    def version(self) -> str | None:
        return package_version("tokenspeed-fa3")

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None:
        if importlib.util.find_spec("flash_attn_interface") is None:
            return "flash_attn_interface is not installed (pip install tokenspeed-fa3)"
        reasons = [capability_reason("9.x (Hopper)", lambda cap: cap[0] == 9)]
        if spec.dtype not in ("fp16", "bf16"):
            reasons.append(f"dtype {spec.dtype} is not supported (fp16, bf16)")
        reasons.append(head_dim_reason(spec.head_dim))
        return "; ".join(r for r in reasons if r) or None

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        import flash_attn_interface  # noqa: F401  registers torch.ops.flash_attn_3

        cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
        scale, causal = spec.scale, spec.causal

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal)

        return run

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        from flash_attn_interface import get_scheduler_metadata

        page_table = page_table.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        max_len = int(lens.max())
        scale = spec.scale
        metadata = get_scheduler_metadata(
            lens.numel(), 1, max_len, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, lens,
            qkv_dtype=spec.torch_dtype, page_size=spec.page_size, causal=True, num_splits=0)

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            out = _fwd(q.unsqueeze(1), k_cache, v_cache, seqused_k=lens, page_table=page_table,
                       softmax_scale=scale, causal=True, scheduler_metadata=metadata, num_splits=0)
            return out.squeeze(1)

        return run


BACKEND = FA3Backend()
