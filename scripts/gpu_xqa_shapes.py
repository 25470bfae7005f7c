"""FlashInfer's XQA decode against FA3, FA3 with GQA packing and Triton on bf16 caches over batch x context cells
(graph mode, 16-token pages), for 32/8, 8/1 and 28/4 heads: does it win cells, i.e. belong in the default
decode priority?

Usage (device): python3 scripts/gpu_xqa_shapes.py OUT.json [--heads 32/8,8/1,28/4]
Each cell: timing.time_bucket in graph mode (rotated input sets from HBM, candidates interleaved, every timed output
checked against the float32 reference). One JSON line per cell.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnsel.backends import get  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402
from gpu_triton_decode import cell  # noqa: E402

CELLS = [(1, 700), (1, 9000), (3, 3000), (12, 700), (12, 9000), (48, 3000), (100, 200), (100, 9000), (200, 700)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--heads", default="32/8,8/1,28/4")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for heads in args.heads.split(","):
        hq, hk = map(int, heads.split("/"))
        spec = AttentionSpec(hq, hk, 128, "bf16", 16)
        cands = {n: get(n) for n in ("flashinfer_xqa", "fa3", "fa3_packgqa", "triton")
                 if not get(n).unsupported(spec, "decode", dev)}
        for shape in CELLS:
            row = cell(spec, shape, cands, dev, args.reps)
            row["heads"] = heads
            rows.append(row)
    wins = {}
    for r in rows:
        wins[r["best"]] = wins.get(r["best"], 0) + 1
    xqa = [r["ratio"].get("flashinfer_xqa") for r in rows if "flashinfer_xqa" in r["ratio"]]
    print(json.dumps({"wins": wins, "xqa_over_fastest": [round(x, 3) for x in xqa]}), flush=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
