"""Sweep of the Triton decode kernel's launch plan on the H200: split count, the split plan's programs per SM, tile
configs, against FlashInfer and FA3 in the same interleaved timing.

Usage (device): python3 scripts/gpu_triton_decode.py OUT.json [--quick]
Cells: uniform batches x contexts chosen off the bench grid (attnsel bench judges the result on its own grid),
ragged batches (one or a few long rows among short ones), and batch 64 x ctx 8192 with bf16 and fp8 e4m3 caches.
Every cell is timed by timing.time_bucket in graph mode (one CUDA graph per candidate over rotated input sets read
from HBM, candidates interleaved, each timed output checked against the float32 reference). One JSON line per cell.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attnsel.backends.triton as tb  # noqa: E402
from attnsel.backends import get  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402
from attnsel.validate import timing  # noqa: E402


@contextlib.contextmanager
def patched(**attrs):
    old = {k: getattr(tb, k) for k in attrs}
    for k, v in attrs.items():
        setattr(tb, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(tb, k, v)


class Variant:
    """The Triton backend with its launch plan overridden while it plans (the run function keeps what it planned)."""

    def __init__(self, splits: int | None = None, per_sm: int | None = None, cfg: tuple | None = None,
                 legacy: bool = False):
        self.splits, self.per_sm, self.cfg, self.legacy = splits, per_sm, cfg, legacy

    def plan_decode(self, spec, page_table, seq_lens):
        attrs = {}
        base_splits = tb.decode_splits
        if self.cfg:
            attrs["decode_config"] = lambda head_dim, c=self.cfg: tb.TileConfig(0, *c)
        if self.per_sm:
            attrs["SPLIT_PROGRAMS_PER_SM"] = self.per_sm
        if self.splits:
            attrs["decode_splits"] = lambda b, h, n, t, bn, d, s=self.splits: (s, 2**30, 1)  # every row: s
        if self.legacy:  # every row uses the longest row's split count (as before 2026-12-03, third session)
            def legacy(b, h, n, t, bn, sms):
                return base_splits(b, h, n, n * b, bn, sms)[0], 2**30, 1
            attrs["decode_splits"] = legacy
        with patched(**attrs):
            return tb.BACKEND.plan_decode(spec, page_table, seq_lens)


def cell(spec, shape, cands, dev, reps):
    t0 = time.perf_counter()
    r = timing.time_bucket(cands, spec, "decode", shape, dev, "graph", reps)
    label = f"{shape[0]}x{shape[1]}" if isinstance(shape, tuple) else f"ragged {len(shape)} max {max(shape)} " \
                                                                        f"total {sum(shape)}"
    us = r["us"]
    best = min(us.values()) if us else float("nan")
    row = {"cell": label, "kv": spec.kv_dtype or spec.dtype, "us": us, "best": min(us, key=us.get) if us else None,
           "ratio": {n: t / best for n, t in sorted(us.items(), key=lambda kv: kv[1])}, "errors": r["errors"],
           "wall_s": time.perf_counter() - t0}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--refs", default="flashinfer,fa3", help="reference backends timed beside Triton")
    ap.add_argument("--no-fp8", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf16 = AttentionSpec(32, 8, 128, "bf16", 16)
    fp8 = AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype="fp8_e4m3")
    refs = {n: get(n) for n in args.refs.split(",") if n and not get(n).unsupported(bf16, "decode", dev)}
    rows = []
    uniform = [(1, 1500), (2, 6000), (6, 2500), (6, 12000), (24, 1200), (24, 6000), (64, 400), (64, 5000),
               (160, 1000), (160, 5000), (256, 2048)]
    if args.quick:
        uniform = uniform[:3]
    for b, c in uniform:
        cands = dict(refs)
        cands["triton"] = tb.BACKEND
        cands["legacy"] = Variant(legacy=True)
        for w in (2, 4):
            cands[f"per_sm{w}"] = Variant(per_sm=w)
        for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            if s * 4 * 64 <= c and b * 8 * s <= 8 * 132:
                cands[f"s{s}"] = Variant(splits=s)
        for cfg in ((64, 4, 3), (64, 8, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 4, 2), (64, 2, 4)):
            cands["cfg" + "-".join(map(str, cfg))] = Variant(cfg=cfg)
        rows.append(cell(bf16, (b, c), cands, dev, args.reps))
    ragged = [[100, 3000, 500, 9000, 20, 1500, 700, 4000][::-1], [16000] + [300] * 15, [6000] * 2 + [200] * 30,
              [2000 + 997 * i for i in range(12)]]
    for lens in ragged[:1] if args.quick else ragged:
        cands = dict(refs)
        cands["triton"] = tb.BACKEND
        cands["legacy"] = Variant(legacy=True)
        for w in (2, 4):
            cands[f"per_sm{w}"] = Variant(per_sm=w)
        rows.append(cell(bf16, lens, cands, dev, args.reps))
    if not args.no_fp8:
        # fp8 e4m3 cache at 64 x 8192 (issue 11's figure), next to bf16 in the same process
        cands = dict(refs)
        cands["triton"] = tb.BACKEND
        rows.append(cell(bf16, (64, 8192), cands, dev, args.reps))
        cands = {n: b for n, b in refs.items() if not b.unsupported(fp8, "decode", dev)}
        for cfg in ((128, 4, 3), (64, 4, 4), (128, 4, 4)):
            cands["cfg" + "-".join(map(str, cfg))] = Variant(cfg=cfg)
        for s in (2, 4):
            cands[f"s{s}"] = Variant(splits=s)
        rows.append(cell(fp8, (64, 8192), cands, dev, args.reps))
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
