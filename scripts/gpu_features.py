"""Speed of the issue-11 features on the GPU: sliding-window decode and fp8 KV decode, every backend that serves them.

Usage (device): python3 scripts/gpu_features.py OUT.json [backend,backend,...]
(default backends: every built-in but torch). Spec: 32/8 heads, head_dim 128, bf16, page 16 (Mistral-7B-like).
1. Sliding-window decode, batch 64 x context 32768, window 4096: time, TB/s over the window's K/V bytes, and that
   over the read-only probe (validate.timing.probes); the same batch without a window for comparison.
2. fp8 e4m3 vs bf16 KV decode, batch 64 x context 8192: time of each backend in each dtype, the per-backend speedup
   and the fastest-fp8 over fastest-bf16 speedup (what a measured selection picks).
Every timed output is first checked against a float32 reference on two rows (all heads); a wrong one is reported
as such, not timed.
"""
import json
import math
import sys

import torch

from attnsel.backends import BUILTINS, get
from attnsel.spec import AttentionSpec
from attnsel.validate.timing import bench, probes

DEV = torch.device("cuda")
BASE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bf16", page_size=16)
TOL = 2e-2
WINDOW_CASE = (64, 32768, 4096)  # batch, context, window
FP8_CASE = (64, 8192)  # batch, context


def make_decode(spec: AttentionSpec, batch: int, ctx: int, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = math.ceil(ctx / spec.page_size)
    shape = (batch * pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    k = torch.randn(shape, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device=DEV, dtype=torch.bfloat16, generator=gen)
    kwargs = {}
    if spec.kv_dtype:
        k_scale = torch.tensor([0.5], device=DEV)
        v_scale = torch.tensor([0.25], device=DEV)
        k = (k.float() / k_scale).to(spec.kv_torch_dtype)
        v = (v.float() / v_scale).to(spec.kv_torch_dtype)
        kwargs = dict(k_scale=k_scale, v_scale=v_scale)
    page_table = torch.randperm(batch * pages, device=DEV, generator=gen).to(torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device=DEV, dtype=torch.bfloat16, generator=gen)
    return dict(q=q, k=k, v=v, page_table=page_table, seq_lens=seq_lens, kwargs=kwargs)


def reference_rows(spec: AttentionSpec, w: dict, rows=(0, -1)) -> dict:
    """float32 output of the given batch rows [H, D], over the window's tokens only."""
    out = {}
    scale_k = w["kwargs"].get("k_scale", torch.ones(1, device=DEV))
    scale_v = w["kwargs"].get("v_scale", torch.ones(1, device=DEV))
    for b in rows:
        n = int(w["seq_lens"][b])
        pages = w["page_table"][b, : math.ceil(n / spec.page_size)].long()
        k = w["k"][pages].reshape(-1, spec.num_kv_heads, spec.head_dim)[:n].float() * scale_k
        v = w["v"][pages].reshape(-1, spec.num_kv_heads, spec.head_dim)[:n].float() * scale_v
        if spec.sliding_window is not None:
            k, v = k[-spec.sliding_window:], v[-spec.sliding_window:]
        group = spec.group_size
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
        s = torch.einsum("hd,nhd->hn", w["q"][b].float(), k) * spec.scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def time_backend(name: str, spec: AttentionSpec, w: dict, refs: dict) -> dict:
    backend = get(name)
    reason = backend.unsupported(spec, "decode")
    if reason:
        return {"status": "unavailable", "reason": reason}
    try:
        run = backend.plan_decode(spec, w["page_table"], w["seq_lens"])
        call = lambda: run(w["q"], w["k"], w["v"], **w["kwargs"])  # noqa: E731
        out = call()
        torch.cuda.synchronize()
    except Exception as exc:  # a library error is a result of this measurement
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:500]}
    err = max((out[b].float() - ref).abs().max().item() for b, ref in refs.items())
    if not err <= TOL:
        return {"status": "wrong", "max_abs_err": err}
    return {"status": "ok", "max_abs_err": err, "us": bench(call, DEV) * 1e6}


def triton_config_sweep(case) -> list:
    """Triton decode tile configs on fp8 and bf16 caches (batch x ctx of FP8_CASE): fp8 tiles hold half the bytes,
    so a longer BLOCK_N may pay. The current config is the first row of each dtype."""
    import attnsel.backends.triton as tb

    batch, ctx = case
    rows, current = [], tb.decode_config
    for kv_dtype in (None, "fp8_e4m3"):
        spec = AttentionSpec(**BASE, kv_dtype=kv_dtype)
        w = make_decode(spec, batch, ctx, seed=2)
        refs = reference_rows(spec, w)
        for cfg in [None, (0, 64, 4, 4), (0, 128, 4, 3), (0, 128, 8, 3), (0, 128, 4, 4), (0, 256, 8, 3)]:
            tb.decode_config = current if cfg is None else (lambda d, c=cfg: tb.TileConfig(*c))
            try:
                r = time_backend("triton", spec, w, refs)
            finally:
                tb.decode_config = current
            label = (list(tb.decode_config(spec.head_dim).__dict__.values()) if cfg is None
                     else list(cfg))
            row = {"kv_dtype": kv_dtype or "bf16", "config": label, "current": cfg is None, **r}
            rows.append(row)
            print("triton config", json.dumps(row), flush=True)
        del w, refs
        torch.cuda.empty_cache()
    return rows


def emit(row: dict, rows: list) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python3 scripts/gpu_features.py OUT.json [backend,...]")
    names = sys.argv[2].split(",") if len(sys.argv) == 3 else [n for n in BUILTINS if n != "torch"]
    result = {"gpu": torch.cuda.get_device_name(), "backends": names, "probe": probes(DEV)}
    read_tbps = result["probe"]["read_tbps"]
    print("probe:", result["probe"], flush=True)

    rows: list = []
    batch, ctx, window = WINDOW_CASE
    for spec in (AttentionSpec(**BASE, sliding_window=window), AttentionSpec(**BASE)):
        w = make_decode(spec, batch, ctx)
        refs = reference_rows(spec, w)
        read = min(ctx, spec.sliding_window or ctx)
        nbytes = 2 * batch * read * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
        for name in names:
            r = time_backend(name, spec, w, refs)
            if r["status"] == "ok":
                r["tbps_over_read_bytes"] = nbytes / (r["us"] * 1e-6) / 1e12
                r["fraction_of_read_probe"] = r["tbps_over_read_bytes"] / read_tbps
            emit({"what": "window decode" if spec.sliding_window else "full decode", "batch": batch, "ctx": ctx,
                  "window": spec.sliding_window, "backend": name, **r}, rows)
        del w, refs
        torch.cuda.empty_cache()
    result["window"] = [r for r in rows if r["what"] in ("window decode", "full decode")]

    fp8_rows: list = []
    batch, ctx = FP8_CASE
    for kv_dtype in (None, "fp8_e4m3"):
        spec = AttentionSpec(**BASE, kv_dtype=kv_dtype)
        w = make_decode(spec, batch, ctx, seed=1)
        refs = reference_rows(spec, w)
        item = 1 if kv_dtype else 2
        nbytes = 2 * batch * ctx * spec.num_kv_heads * spec.head_dim * item
        for name in names:
            r = time_backend(name, spec, w, refs)
            if r["status"] == "ok":
                r["tbps"] = nbytes / (r["us"] * 1e-6) / 1e12
            emit({"what": "kv dtype decode", "kv_dtype": kv_dtype or "bf16", "batch": batch, "ctx": ctx,
                  "backend": name, **r}, fp8_rows)
        del w, refs
        torch.cuda.empty_cache()
    result["kv_dtype"] = fp8_rows
    times = {(r["kv_dtype"], r["backend"]): r["us"] for r in fp8_rows if r["status"] == "ok"}
    per_backend = {n: times[("bf16", n)] / times[("fp8_e4m3", n)] for n in names
                   if ("bf16", n) in times and ("fp8_e4m3", n) in times}
    fastest = {d: min(((t, n) for (dd, n), t in times.items() if dd == d), default=None)
               for d in ("bf16", "fp8_e4m3")}
    result["fp8_speedup_per_backend"] = per_backend
    if fastest["bf16"] and fastest["fp8_e4m3"]:
        result["fp8_speedup_fastest"] = {"bf16": fastest["bf16"][1], "fp8": fastest["fp8_e4m3"][1],
                                         "speedup": fastest["bf16"][0] / fastest["fp8_e4m3"][0]}
    result["triton_fp8_configs"] = triton_config_sweep(FP8_CASE)
    print("fp8 speedup per backend:", json.dumps(per_backend))
    print("fp8 speedup fastest vs fastest:", json.dumps(result.get("fp8_speedup_fastest")))
    for r in result["window"]:
        if r["status"] == "ok":
            print(f"{r['what']:14} {r['backend']:22} {r['us']:9.1f} us  {r['tbps_over_read_bytes']:5.2f} TB/s "
                  f"({r['fraction_of_read_probe']:.2f} of read probe)")
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
