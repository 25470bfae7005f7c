"""One decode call per backend and KV dtype at batch 64 x ctx 8192 (32/8 heads, d128, page 16), for Nsight Compute:
why does fp8 e4m3 decode stop at ~2.5 TB/s in every library while bf16 reaches 4.4 (issue 11)?

Usage (device): ncu --section SpeedOfLight ... python3 scripts/gpu_decode_profile.py [triton:fp8 fa3:bf16 ...]
Each NAME:KV runs its plan three times (the last is the one to profile: --launch-skip / -c pick it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnsel.backends import get  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402
from attnsel.validate.timing import make_decode_workload  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    for item in sys.argv[1:] or ["triton:fp8", "triton:bf16"]:
        name, kv = item.split(":")
        spec = AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype="fp8_e4m3" if kv == "fp8" else None)
        w = make_decode_workload(spec, dev, "", 64, 8192)
        extra = {}
        if spec.kv_dtype:
            extra = dict(k_scale=torch.ones(1, device=dev), v_scale=torch.ones(1, device=dev))
        run = get(name).plan_decode(spec, *w.plan_args)
        for _ in range(3):
            run(*w.inputs, **extra)
        torch.cuda.synchronize()
        print(item, "done", flush=True)


if __name__ == "__main__":
    main()
