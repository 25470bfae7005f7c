"""Build FlashInfer's JIT modules before a timed run: each argument NAME:KV:PHASE runs that backend once on the
validation's ragged case of the phase, judged row by row against the float32 reference. The spec: 32/8 heads,
head_dim 128, bf16, page 16 (KV: bf16 or fp8_e4m3); with ``--config CFG.json --kind KIND`` the spec of that layer
kind of a Hugging Face config instead (``attnsel.spec.layer_specs``; KV fp8_e4m3 makes its cache fp8). Run several
of these processes at once: each module's build is mostly one single-threaded compiler job. A backend that cannot
serve the spec (its reason) is skipped, not an error.

PHASE: prefill, decode or extend (new tokens over a paged prefix).

Usage (device): python3 scripts/gpu_prebuild.py flashinfer:bf16:decode flashinfer_cuda_cores:fp8_e4m3:decode
                python3 scripts/gpu_prebuild.py --config examples/configs/gemma-3-1b.json --kind full_attention \
                    flashinfer:bf16:prefill
                python3 scripts/gpu_prebuild.py --spec 32/8/64/fp16 flashinfer:bf16:prefill   (a --specs item of
                    `attnsel bench`: its head_dim, dtype and page size; KV bf16 then means the spec's own dtype)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel.backends import get  # noqa: E402
from attnsel.bench_args import SPEC_FORMAT, parse_specs  # noqa: E402
from attnsel.errors import InvalidArgument  # noqa: E402
from attnsel.spec import AttentionSpec, layer_specs  # noqa: E402
from attnsel.validate.cases import check_output, make_case, run_case  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("modules", nargs="+", metavar="NAME:KV:PHASE")
parser.add_argument("--config", help="a Hugging Face config.json: take the spec of one of its layer kinds")
parser.add_argument("--kind", default="full_attention", help="the layer kind of --config (default full_attention)")
parser.add_argument("--spec", help=f"{SPEC_FORMAT} as `attnsel bench --specs` takes one (default 32/8)")
args = parser.parse_args()
base = AttentionSpec(32, 8, 128, "bf16", 16)
if args.spec and args.config:
    parser.error("--spec and --config both give the spec: pass one")
if args.spec and "," in args.spec:
    parser.error(f"--spec {args.spec}: one {SPEC_FORMAT} item (gpu-bench runs one build per item)")
if args.spec:
    try:
        (base,) = parse_specs(args.spec, None)
    except (InvalidArgument, ValueError) as exc:
        parser.error(f"--spec {args.spec}: {exc}")
if args.config:
    kinds = {kind: spec for kind, spec, _ in layer_specs(args.config)}
    if args.kind not in kinds:
        parser.error(f"--kind {args.kind}: {args.config} has layer kinds {', '.join(kinds)}")
    base = kinds[args.kind]
failed = []
for arg in args.modules:
    name, kv, phase = arg.split(":")
    spec = dataclasses.replace(base, kv_dtype=None if kv == "bf16" else kv)
    reason = get(name).unsupported(spec, phase)
    if reason:
        print(f"{arg} on {spec.describe()}: skipped ({reason})", flush=True)
        continue
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: torch only (a check of this script)
    t0 = time.perf_counter()
    case = make_case(spec, phase, dev)  # the validation's own ragged case of the phase, judged row by row
    result = check_output(spec, run_case(get(name), spec, case), case)
    err, tol, ok = result.get("max_abs_err"), result.get("tolerance"), result["status"] == "valid"
    why = "" if ok else f": {result['status']}: {result.get('reason') or 'no reason given'}"
    # a rejection need not carry numbers (changed inputs, a shape, a rerun difference): its reason then says why
    numbers = "" if err is None else f", max abs error {err:.3g}" + ("" if tol is None else f" (tolerance {tol:.3g})")
    print(f"{arg} on {spec.describe()}: built and ran in {time.perf_counter() - t0:.1f} s{numbers}{why}", flush=True)
    if not ok:
        failed.append(arg)
if failed:
    sys.exit(f"over tolerance, not finite or rejected: {', '.join(failed)}")
