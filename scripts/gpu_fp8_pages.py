"""fp8 e4m3 vs bf16 KV-cache decode at batch 64 x ctx 8192 on the H200, per page size: does the fp8 cache's speed-up
depend on how many contiguous bytes a page holds per KV head (issue 11: every library stopped at ~2.5 TB/s of fp8
bytes with 16-token pages)?

Usage (device): python3 scripts/gpu_fp8_pages.py OUT.json [--pages 16,64,256]
Per page size: the bf16 cell, then the fp8 cell (FlashInfer, FA3, Triton, Triton tile variants), each timed by
timing.time_bucket in graph mode (rotated input sets from HBM, candidates interleaved, every timed output checked).
One JSON line per cell, with TB/s over the cache bytes read.
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

import attnsel.backends.triton as tb  # noqa: E402
from attnsel.backends import get  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402
from gpu_triton_decode import Variant, cell  # noqa: E402

BATCH, CTX = 64, 8192


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--pages", default="16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--refs", default="flashinfer,flashinfer_cuda_cores,fa3,fa3_packgqa",
                    help="library backends timed beside Triton")
    ap.add_argument("--tiles", default="128-4-3,128-8-3,64-4-4",
                    help="Triton decode tiles tried on the fp8 cache: BLOCK_N-warps-stages, comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for page in map(int, args.pages.split(",")):
        for kv in (None, "fp8_e4m3"):
            spec = AttentionSpec(32, 8, 128, "bf16", page, kv_dtype=kv)
            cands = {n: get(n) for n in args.refs.split(",") if n and not get(n).unsupported(spec, "decode", dev)}
            cands["triton"] = tb.BACKEND
            if kv:
                for tile in filter(None, args.tiles.split(",")):
                    cands["triton-cfg" + tile] = Variant(cfg=tuple(map(int, tile.split("-"))))
            row = cell(spec, (BATCH, CTX), cands, dev, args.reps)
            nbytes = BATCH * CTX * 8 * 128 * 2 * (1 if kv else 2)
            row.update(page=page, cache_bytes=nbytes, tbps={n: nbytes / (t * 1e-6) / 1e12 for n, t in row["us"].items()})
            print(json.dumps({"page": page, "kv": row["kv"], "best": row["best"],
                              "tbps": {n: round(v, 2) for n, v in row["tbps"].items()}}), flush=True)
            rows.append(row)
    for page in sorted({r["page"] for r in rows}):
        pair = {r["kv"]: r for r in rows if r["page"] == page}
        if len(pair) == 2:
            b, f = pair["bf16"], pair["fp8_e4m3"]
            print(json.dumps({"page": page, "fastest_bf16_over_fastest_fp8":
                              round(min(b["us"].values()) / min(f["us"].values()), 3)}), flush=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
