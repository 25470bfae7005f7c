"""Tile-config sweep of the Triton prefill kernel against FA3 / FlashInfer / torch on the H200 (one device call).

Usage (device): python3 scripts/gpu_tune.py OUT_DIR. Prints one line per measurement and writes tune.json.
"""
import json
import sys
import time

import torch

import attnsel.backends.triton as tb
from attnsel.backends import get
from attnsel.spec import AttentionSpec
from attnsel.validate import cases, timing
from attnsel.validate.cases import check_output
from attnsel.validate.timing import bench

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
dev = torch.device("cuda")
spec = AttentionSpec(32, 8, 128, "bf16", 16)
rows = []


def emit(**row):
    rows.append(row)
    print(json.dumps(row), flush=True)


# Bandwidth probes.
x = torch.randn(1 << 30, dtype=torch.bfloat16, device=dev)
y = torch.empty_like(x)
emit(what="copy", tbps=2 * 2 * x.numel() / bench(lambda: y.copy_(x), dev) / 1e12)
emit(what="read(sum)", tbps=2 * x.numel() / bench(lambda: x.sum(dtype=torch.float32), dev) / 1e12)
x = y = None

names = ["torch", "triton", "fa3", "flashinfer", "flashinfer_cuda_cores"]
for phase in ("prefill", "decode"):
    case = cases.make_case(spec, phase, dev)
    for name in names:
        b = get(name)
        why = b.unsupported(spec, phase)
        if why:
            emit(what="check", name=name, phase=phase, status="unavailable", reason=why)
            continue
        t0 = time.perf_counter()
        try:
            o = cases.run_case(b, spec, case)
            torch.cuda.synchronize()
            r = check_output(spec, o, case)
        except Exception as exc:
            r = {"status": "error", "reason": repr(exc)}
        emit(what="check", name=name, phase=phase, secs=time.perf_counter() - t0, **r)


def time_prefill(run, w, lens):
    t = bench(lambda: run(*w.inputs), dev)
    return t * 1e6, timing.prefill_flops(spec, lens) / t / 1e12


for label, lens in [("1x8192", [8192]), ("4x2048", [2048] * 4), ("32x256", [256] * 32)]:
    w = timing.make_prefill_workload(spec, dev, label, lens)
    for name in ["torch", "fa3", "flashinfer"]:
        run = get(name).plan_prefill(spec, *w.plan_args)
        us, tf = time_prefill(run, w, lens)
        emit(what="prefill", shape=label, name=name, us=us, tflops=tf)
    for cfg in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                (128, 64, 8, 4), (128, 32, 4, 3), (256, 64, 8, 3)]:
        tb.prefill_config = lambda d, c=cfg: tb.TileConfig(*c)
        try:
            run = get("triton").plan_prefill(spec, *w.plan_args)
            us, tf = time_prefill(run, w, lens)
            emit(what="prefill", shape=label, name="triton", cfg=cfg, us=us, tflops=tf)
        except Exception as exc:
            emit(what="prefill", shape=label, name="triton", cfg=cfg, error=repr(exc)[:300])
        if label != "1x8192":
            break

# The Triton decode launch plan (split counts, tile configs) is swept by scripts/gpu_triton_decode.py.

with open(f"{out_dir}/tune.json", "w") as fh:
    json.dump(rows, fh, indent=1)
