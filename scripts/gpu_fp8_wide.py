"""Triton decode with several KV heads per program (wide rows: kernels.decode_kernel's KV_PER) against FlashInfer,
FA3 and the one-head Triton kernel, fp8 e4m3 and bf16 caches, batch 64 x ctx 8192, 32/8 heads, d128 (issue 11: the
fp8 cache's speed-up over bf16 stopped at 1.12-1.20x, every library at ~2.5 TB/s of fp8 bytes with 128-byte head rows).

Usage (device): python3 scripts/gpu_fp8_wide.py OUT.json [--pages 16,64] [--quick]
Each cell is timed by timing.time_bucket in graph mode (rotated input sets from HBM, candidates interleaved, every
timed output checked against the float32 reference). Variant names: w{KV_PER}-{BLOCK_N}-{warps}-{stages}.
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


def variants(fp8: bool, quick: bool) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, warps, stages, KV_PER) tuples."""
    out = []
    for per in (2, 4, 8):
        for bn in (16, 32, 64) if fp8 else (16, 32):
            for warps, stages in ((4, 3), (8, 3), (4, 2)) if not quick else ((4, 3), (8, 3)):
                out.append((bn, warps, stages, per))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--shapes", default="64x8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--refs", default="flashinfer,fa3,fa3_packgqa", help="library backends timed beside Triton")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for page in map(int, args.pages.split(",")):
        for shape in args.shapes.split(","):
            batch, ctx = map(int, shape.split("x"))
            for kv in (None, "fp8_e4m3"):
                spec = AttentionSpec(32, 8, 128, "bf16", page, kv_dtype=kv)
                cands = {n: get(n) for n in args.refs.split(",")
                         if n and not get(n).unsupported(spec, "decode", dev)}
                cands["triton"] = tb.BACKEND
                for cfg in variants(kv is not None, args.quick):
                    cands["w{3}-{0}-{1}-{2}".format(*cfg)] = Variant(cfg=cfg)
                row = cell(spec, (batch, ctx), cands, dev, args.reps)
                nbytes = batch * ctx * 8 * 128 * 2 * (1 if kv else 2)
                row.update(page=page, shape=shape, cache_bytes=nbytes,
                           tbps={n: nbytes / (t * 1e-6) / 1e12 for n, t in row["us"].items()})
                top = sorted(row["us"].items(), key=lambda kv_: kv_[1])[:6]
                print(json.dumps({"page": page, "shape": shape, "kv": row["kv"],
                                  "top": [(n, round(t, 1), round(row["tbps"][n], 2)) for n, t in top],
                                  "libs": {n: round(row["us"][n], 1) for n in ("flashinfer", "fa3", "triton")
                                           if n in row["us"]}}), flush=True)
                rows.append(row)
    for page in sorted({r["page"] for r in rows}):
        for shape in sorted({r["shape"] for r in rows}):
            pair = {r["kv"]: r for r in rows if r["page"] == page and r["shape"] == shape}
            if len(pair) == 2:
                b, f = pair["bf16"], pair["fp8_e4m3"]
                print(json.dumps({"page": page, "shape": shape, "fastest_bf16_over_fastest_fp8":
                                  round(min(b["us"].values()) / min(f["us"].values()), 3)}), flush=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
