"""Host time per call of attnsel.flash_attn_varlen_func / flash_attn_with_kvcache vs the selected backend's run.

Usage (H200): python scripts/gpu_flash_api.py OUT.json [--mode eager|graph] [--heads 32,8]
Per case, the FA3-compatible call (spec inference, selection lookup, plan cache hit, argument checks, then the run)
against three direct calls of the same inputs: (a) ``vs_backend_run``, the selected backend's own run function,
planned by the backend itself and called with q in the backend protocol's [B, H, D] (no attnsel checks: the target,
within 5 us); (b) ``vs_plan_bhd``, attnsel's own API, ``Selection.plan_decode`` / ``plan_prefill`` with q [B, H, D];
(c) the row's ``overhead_us``: the very run function the call planned and reuses (q [B, 1, H, D] for decode), i.e.
the call's own Python between real launches. Host time = wall time of a burst of launches without synchronisation
(bursts short enough not to fill the launch queue); bursts of the two alternate and the overhead is the median of the
pairs' differences. The wall time of the same bursts with a sync is reported beside it. Also per decode case: the
pairing with the CUDA capture query stubbed out (no_capture_query_overhead_us); body_us, the call with its run
replaced by a no-op in a tight loop. Where FA3 serves the case: vs_fa3_public, the same pairing against
flash_attn_interface's own function of the same name (what code written for FlashAttention calls today; its
overhead_us < 0 means attnsel's call costs less host time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnsel  # noqa: E402
from attnsel import AttentionSpec, backends, flash_api  # noqa: E402

BURST, REPEATS = 50, 40
PLANS = {"made": 0}  # plans the API made: a cache hit every call means none while timing


def _counting(method):
    def plan(self, *args, **kwargs):
        PLANS["made"] += 1
        return method(self, *args, **kwargs)
    return plan


attnsel.Selection.plan_decode = _counting(attnsel.Selection.plan_decode)
attnsel.Selection.plan_prefill = _counting(attnsel.Selection.plan_prefill)


def burst(fn) -> tuple[float, float]:
    """(host, wall) us per call of a burst of BURST calls: host without a sync, wall with one."""
    t0 = time.perf_counter()
    for _ in range(BURST):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / BURST * 1e6, (time.perf_counter() - t0) / BURST * 1e6


def paired(direct, call) -> dict:
    """Bursts of the direct run and the API call alternate (REPEATS pairs, after a warm-up), so that the machine's
    drift (clocks, other processes) hits both alike; the overhead is the median of the pairs' differences."""
    for _ in range(5):
        direct()
        call()
    torch.cuda.synchronize()
    rows = []
    for _ in range(REPEATS):
        rows.append((*burst(direct), *burst(call)))
    med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
    return {"direct_host_us": round(med(0), 2), "api_host_us": round(med(2), 2),
            "overhead_us": round(statistics.median(r[2] - r[0] for r in rows), 2),
            "direct_wall_us": round(med(1), 2), "api_wall_us": round(med(3), 2)}


def _last_plan(phase: str):
    """The plan the FA3-compatible call of this phase stored (one spec per run of this script)."""
    return next(entry[-1] for slot, entry in flash_api.default()._plans.items() if slot[0] == phase)


def decode_case(batch: int, ctx: int, hq=32, hk=8, d=128, ps=16, append=False) -> dict:
    dev, dt = "cuda", torch.bfloat16
    pages = (ctx + ps) // ps + 1
    kc = torch.randn(batch * pages, ps, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    table = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, hq, d, device=dev, dtype=dt)
    k_new = torch.randn(batch, 1, hk, d, device=dev, dtype=dt) if append else None
    v_new = torch.randn_like(k_new) if append else None
    call = lambda: attnsel.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,  # noqa: E731
                                                   page_table=table, causal=True)
    call()
    spec = AttentionSpec(hq, hk, d, "bf16", page_size=ps)  # the call's spec
    sel = flash_api.selection_for(spec, q.device)
    run = _last_plan("decode")[1]  # the very run function the call reuses: q [B, 1, H, D]
    q2 = q[:, 0]
    direct = lambda: run(q, kc, vc)  # noqa: E731
    backend = sel.decode_backend_for(batch, pages * ps)  # the call's plan: context bound by the table's width
    row = {"phase": "decode", "batch": batch, "ctx": ctx, "append": append, "backend": backend,
           **measure(direct, call)}
    lens = seqlens + 1 if append else seqlens  # the new token is attended to
    raw = backends.get(backend).plan_decode(spec, table, lens)  # the backend itself, no attnsel checks
    row["vs_backend_run"] = paired(lambda: raw(q2, kc, vc), call)
    bhd = sel.plan_decode(table, lens, max_seq_len=pages * ps)  # attnsel's own API, q [B, H, D]
    row["vs_plan_bhd"] = paired(lambda: bhd(q2, kc, vc), call)
    # without the CUDA capture query (a driver call): its share of the overhead between real launches
    capturing, flash_api._capturing = flash_api._capturing, lambda t: False
    try:
        row["no_capture_query_overhead_us"] = paired(direct, call)["overhead_us"]
    finally:
        flash_api._capturing = capturing
    row["body_us"] = body_us("decode", call, q2, kc, vc)
    if backend == "fa3" and not append:  # the function code written for FlashAttention calls today
        import flash_attn_interface
        public = lambda: flash_attn_interface.flash_attn_with_kvcache(  # noqa: E731
            q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=True)
        row["vs_fa3_public"] = paired(public, call)
    return row


def body_us(phase: str, call, q2, kc, vc) -> dict:
    """The call's own host time on this host's CPU with CUDA tensors: the stored plan's run replaced by a no-op, in a
    tight loop (warm caches) against the no-op alone; the rest of a measured overhead is the body's cost between real
    launches (cold caches)."""
    slot = next(s for s in flash_api.default()._plans if s[0] == phase)
    entry = flash_api.default()._plans[slot]
    out = q2.clone()
    noop = lambda q, k, v, **kwargs: out  # noqa: E731
    flash_api.default()._plans[slot] = entry[:-1] + (((entry[-1][0], noop) if phase == "decode" else noop),)
    try:
        api, alone = loop_us(call, 5000), loop_us(lambda: noop(q2, kc, vc), 5000)
    finally:
        flash_api.default()._plans[slot] = entry
    return {"api_noop_us": api, "noop_us": alone, "body_us": round(api - alone, 3)}


def prefill_case(lens: list[int], hq=32, hk=8, d=128) -> dict:
    dev, dt = "cuda", torch.bfloat16
    total = sum(lens)
    q = torch.randn(total, hq, d, device=dev, dtype=dt)
    k = torch.randn(total, hk, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    call = lambda: attnsel.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)  # noqa: E731
    call()
    spec = AttentionSpec(hq, hk, d, "bf16", page_size=flash_api.DEFAULT_PAGE_SIZE)
    sel = flash_api.selection_for(spec, q.device)
    run = _last_plan("prefill")  # the very run function the call reuses
    direct = lambda: run(q, k, v)  # noqa: E731
    backend = sel.prefill_backend_for(len(lens), total, max(lens))
    row = {"phase": "prefill", "lens": lens, "backend": backend, **measure(direct, call),
           "body_us": body_us("prefill", call, q, k, v)}
    raw = backends.get(backend).plan_prefill(spec, cu, cu, max(lens), max(lens))  # the backend itself, no checks
    row["vs_backend_run"] = paired(lambda: raw(q, k, v), call)
    if backend == "fa3":  # the function code written for FlashAttention calls today
        import flash_attn_interface
        public = lambda: flash_attn_interface.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu, cu, max(lens), max(lens), causal=True)
        row["vs_fa3_public"] = paired(public, call)
    return row


def loop_us(fn, n: int = 2000) -> float:
    """Host time of one call of a cheap host-side step (median of 5 loops of n)."""
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(times), 3)


def breakdown(hq=32, hk=8, d=128, ps=16) -> dict:
    """Host time of the steps flash_attn_with_kvcache adds to a direct run (CUDA tensors: where the 5 us go)."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(8, 1, hq, d, device=dev, dtype=dt)
    kc = torch.randn(8 * 130, ps, hk, d, device=dev, dtype=dt)
    seqlens = torch.full((8,), 2048, dtype=torch.int32, device=dev)
    out = q[:, 0]
    sel = flash_api.selection_for(AttentionSpec(hq, hk, d, "bf16", page_size=ps), q.device)
    table = torch.arange(8 * 130, device=dev, dtype=torch.int32).view(8, 130)
    run = sel.plan_decode(table, seqlens)
    from attnsel.run_checks import plan_is_current
    return {"is_current_stream_capturing": loop_us(torch.cuda.is_current_stream_capturing),
            "q.squeeze(1)": loop_us(lambda: q.squeeze(1)), "unsqueeze(1)": loop_us(lambda: out.unsqueeze(1)),
            "q.device": loop_us(lambda: q.device), "tensor._version": loop_us(lambda: seqlens._version),
            "_resolve": loop_us(lambda: flash_api.default()._resolve("flash_attn_with_kvcache", q, kc, kc, q.shape, kc.shape,
                                                           ps, None, True, None, None, False)),
            "plan_is_current": loop_us(lambda: plan_is_current(run)),
            "shape checks": loop_us(lambda: (q.dim() != 4 or q.shape[1] != 1, kc.dim(), kc.shape == kc.shape,
                                            table.dtype != torch.int32, table.dim(), table.shape[0] != q.shape[0],
                                            seqlens.dtype, seqlens.shape != (8,)))}


def measure(direct, call) -> dict:
    before = PLANS["made"]
    row = paired(direct, call)
    return {**row, "plans_made_while_timing": PLANS["made"] - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON output path")
    parser.add_argument("--mode", default="eager", choices=("eager", "graph"),
                        help="selection mode (the calls themselves run eagerly: host time is what is measured)")
    parser.add_argument("--heads", default="32,8", help="query and KV heads (head_dim 128, bf16, page 16)")
    args = parser.parse_args()
    hq, hk = map(int, args.heads.split(","))
    flash_api.configure(mode=args.mode)
    rows = [decode_case(1, 256, hq, hk), decode_case(8, 2048, hq, hk), decode_case(64, 4096, hq, hk),
            decode_case(8, 2048, hq, hk, append=True), prefill_case([1024], hq, hk), prefill_case([128] * 8, hq, hk)]
    for row in rows:
        print(json.dumps(row))
    parts = breakdown(hq, hk)
    print(json.dumps({"breakdown_us": parts}))
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "mode": args.mode, "heads": [hq, hk], "burst": BURST, "repeats": REPEATS,
              "command": " ".join(sys.argv), "rows": rows, "breakdown_us": parts,
              "max_overhead_us": max(r["vs_backend_run"]["overhead_us"] for r in rows if not r.get("append")),
              "max_overhead_vs_reused_run_us": max(r["overhead_us"] for r in rows if not r.get("append"))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"max overhead (no append) vs the backend's own run: {result['max_overhead_us']} us, vs the run the call "
          f"reuses: {result['max_overhead_vs_reused_run_us']} us -> {args.out}")


if __name__ == "__main__":
    main()
