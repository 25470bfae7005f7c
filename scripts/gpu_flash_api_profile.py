"""Where the host time of a flash_attn_with_kvcache call goes on the GPU machine: cProfile of the direct run and of
the FA-compatible call (explicit backends from the environment), top functions by own time.

Usage (device): python3 scripts/gpu_flash_api_profile.py [--mode graph] [--batch 8] [--ctx 2048]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnsel  # noqa: E402
from attnsel import flash_api  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="graph")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--ctx", type=int, default=2048)
args = ap.parse_args()
flash_api.configure(mode=args.mode)
b, ps, hq, hk, d = args.batch, 16, 32, 8, 128
pages = args.ctx // ps + 2
kc = torch.randn(b * pages, ps, hk, d, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
lens = torch.full((b,), args.ctx, dtype=torch.int32, device="cuda")
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
call = lambda: attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True)  # noqa
call()
run = next(e[-1] for s, e in flash_api._plans.items() if s[0] == "decode")[1]
q2 = q[:, 0]
direct = lambda: run(q2, kc, vc)  # noqa: E731
for name, fn in (("direct", direct), ("api", call)):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"==== {name}: 500 calls\n" + "\n".join(buf.getvalue().splitlines()[4:]))
