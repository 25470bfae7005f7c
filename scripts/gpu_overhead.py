"""Host cost per call of the checked run functions that Selection.plan_prefill/plan_decode return, against the
backend's unchecked run (issue 14 item 4: target within 2 us per call on the H200).

Usage (device): python3 scripts/gpu_overhead.py OUT.json [--calls N]
For every available backend x phase on the Llama-3-8B shape (32/8 heads, d128, bf16, page 16), small batches (decode
batch 1 x 512, prefill 1 x 64): the median over 7 rounds of N calls of the host time per call (time.perf_counter
around a loop of launches, synchronised before and after each round, so that the GPU queue never fills: the
kernels are shorter than the host work), for the unchecked and the checked run; plus the check alone (the checked
wrapper around a no-op). Prints one JSON line per measurement and writes them all to OUT.json.
"""
import argparse
import json
import statistics
import time

import torch

from attnsel import AttentionSpec
from attnsel.backends import get
from attnsel.selection import checked_decode, checked_prefill
from attnsel.validate import timing

ROUNDS = 7


def per_call(fn, args, calls: int) -> float:
    """Median over ROUNDS of the host seconds per call of fn(*args)."""
    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    dev = torch.device("cuda")
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    pre = timing.make_prefill_workload(spec, dev, "1x64", [64])
    dec = timing.make_decode_workload(spec, dev, "1x512", 1, 512)
    noop = lambda *a, **k: None  # noqa: E731
    emit(what="check only", phase="prefill",
         us=per_call(checked_prefill(noop, spec, dev.index or 0, 64, 64), pre.inputs, args.calls) * 1e6)
    emit(what="check only", phase="decode",
         us=per_call(checked_decode(noop, spec, dev.index or 0, 1), dec.inputs, args.calls) * 1e6)
    for name in ("fa3", "flashinfer", "flashinfer_cuda_cores", "triton", "torch"):
        backend = get(name)
        for phase, load in (("prefill", pre), ("decode", dec)):
            reason = backend.unsupported(spec, phase)
            if reason:
                emit(what="unavailable", backend=name, phase=phase, reason=reason)
                continue
            plan = backend.plan_prefill if phase == "prefill" else backend.plan_decode
            run = plan(spec, *load.plan_args)
            checked = (checked_prefill(run, spec, dev.index or 0, 64, 64) if phase == "prefill"
                       else checked_decode(run, spec, dev.index or 0, 1))
            plain = per_call(run, load.inputs, args.calls)
            wrapped = per_call(checked, load.inputs, args.calls)
            emit(what="run", backend=name, phase=phase, unchecked_us=plain * 1e6, checked_us=wrapped * 1e6,
                 overhead_us=(wrapped - plain) * 1e6)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(dev), "calls": args.calls, "rounds": ROUNDS, "rows": rows},
                  fh, indent=1)


if __name__ == "__main__":
    main()
