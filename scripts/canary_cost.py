"""What the serving canary costs (GPU): tokens/s of an engine-shaped decode loop with the canary off, N=1000 and N=100.

The loop: one Selection.plan_decode per step (host sizes: context_tokens, longest), then the plan's run over a stack of
layers, each with its own paged KV cache (batch 64, context 2048, 32 q / 8 kv heads, head_dim 128, bf16, page 16;
pages shuffled as an engine's allocator leaves them). The contexts stay at 2048 (a steady state, not growing
sequences). One explicit backend serves every configuration (--backend, default triton: built in, no extra package).
The checks still in flight when a configuration's loop ends are finished outside its timing; "off" runs first and
last, so that drift of the GPU shows.

    python scripts/canary_cost.py [--backend triton] [--steps 1000] [--layers 32]

About 40-60 s on an H100 with the defaults (17 GiB of caches).
"""
from __future__ import annotations

import argparse
import time

import torch

from attnsel.canary import Canary
from attnsel.selection import PhaseChoice, Selection
from attnsel.spec import AttentionSpec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="triton", help="decode backend (explicit; default triton)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=1000, help="timed decode steps per configuration")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu runs the code path on small sizes")
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("canary_cost.py measures the canary on a GPU; no CUDA device here (--device cpu: a smoke run)")
    spec = AttentionSpec(32, 8, 128, "bf16", page_size=16)
    ps, pages_per_row = spec.page_size, -(-args.ctx // spec.page_size)
    num_pages = args.batch * pages_per_row
    gen = torch.Generator(device=dev).manual_seed(0)
    page_table = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32).view(args.batch, pages_per_row)
    seq_lens = torch.full((args.batch,), args.ctx, dtype=torch.int32, device=dev)
    shape = (num_pages, ps, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen),
               torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)) for _ in range(args.layers)]
    q = torch.randn(args.batch, spec.num_q_heads, spec.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
    host = dict(context_tokens=args.batch * args.ctx, longest=args.ctx)

    def selection(every: int) -> Selection:
        phases = {p: PhaseChoice(args.backend, "explicit", []) for p in ("prefill", "decode")}
        canary = Canary(every, spec, fingerprint={}, device=str(dev), cache=None) if every else None
        return Selection(spec, phases, "measure", "eager", "off", {}, {}, canary=canary)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def loop(sel: Selection, steps: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            run = sel.plan_decode(page_table, seq_lens, **host)
            for k, v in caches:
                run(q, k, v)
        sync()
        return time.perf_counter() - t0

    warm = selection(1)  # compiles, the canary's first stream and reference (not timed)
    loop(warm, 3)
    warm.canary.drain()
    if warm.canary.mismatches():
        raise SystemExit(f"{args.backend} failed the canary's check: {warm.canary.report()['mismatches']}")
    rows = []
    for label, every in (("off", 0), ("N=1000", 1000), ("N=100", 100), ("off again", 0)):
        sel = selection(every)
        wall = loop(sel, args.steps)
        stats = {"sampled": 0, "checked": 0, "mismatches": 0}
        if sel.canary is not None:
            sel.canary.drain()
            for counts in sel.canary.report()["phases"].get("decode", {}).values():
                stats = {k: stats[k] + counts[k] for k in stats}
        rows.append((label, wall, args.batch * args.steps / wall, stats))
    base = (rows[0][2] + rows[-1][2]) / 2
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}: {args.backend} decode, batch {args.batch} x ctx {args.ctx}, "
          f"{args.layers} layers, 32/8 heads d128 bf16 page 16, {args.steps} steps per configuration")
    print(f"{'canary':<10} {'wall s':>7} {'tokens/s':>10} {'vs off':>7} {'sampled':>8} {'checked':>8} {'mismatch':>8}")
    for label, wall, tps, s in rows:
        print(f"{label:<10} {wall:7.2f} {tps:10.0f} {tps / base:7.3f} {s['sampled']:8d} {s['checked']:8d} "
              f"{s['mismatches']:8d}")


if __name__ == "__main__":
    main()
