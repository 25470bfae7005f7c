"""Build FlashInfer's JIT modules before a timed run: each argument NAME:KV:PHASE runs that backend once on a small
case of the 32/8-head, head_dim 128, bf16, page-16 spec (KV: bf16 or fp8_e4m3), checked against the float32
reference. Run several of these processes at once: each module's build is mostly one single-threaded compiler job.

Usage (device): python3 scripts/gpu_prebuild.py flashinfer:bf16:decode flashinfer_cuda_cores:fp8_e4m3:decode
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel.backends import get  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402
from tests.feature_cases import decode_case, prefill_case  # noqa: E402

failed = []
for arg in sys.argv[1:]:
    name, kv, phase = arg.split(":")
    spec = AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype=None if kv == "bf16" else kv)
    dev = torch.device("cuda")
    case = (decode_case(spec, dev, [17, 300]) if phase == "decode"
            else prefill_case(spec, dev, [13, 97], [13, 97]))
    t0 = time.perf_counter()
    err = case.error(case.run(get(name), spec))
    print(f"{arg}: built and ran in {time.perf_counter() - t0:.1f} s, max abs error {err:.3g} "
          f"(tolerance {case.tolerance(spec):.3g})", flush=True)
    if not err <= case.tolerance(spec):  # NaN included
        failed.append(arg)
if failed:
    sys.exit(f"over tolerance or not finite: {', '.join(failed)}")
