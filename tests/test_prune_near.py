"""Eager local pruning (timing.measure, "pruned_near") on the real GPU grids, with fake timings: what it may skip,
and what the dispatch table built from the result then serves."""
import torch

import attnsel.backends as backends_mod
from attnsel import AttentionSpec
from attnsel.selection import build_table
from attnsel.validate import extend_grid as ext_grid
from attnsel.validate import timing

CUDA = torch.device("cuda")  # only its type is read by the grids: nothing is allocated
SPEC = AttentionSpec(32, 8, 128, "bf16", 16)


def _measure(monkeypatch, grid, phase, speed):
    """measure() over ``grid`` with time_bucket replaced by ``speed(name, key) -> us``; also (key, names timed)."""
    seen = []

    def fake_bucket(cands, spec, phase_, shape, device, mode, reps):
        key = tuple(shape)
        seen.append((key, sorted(cands)))
        us = {n: speed(n, key) for n in cands}
        return {"us": us, "spread": {n: 0.0 for n in us}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    out = timing.measure(SPEC, phase, ["fa3", "mtd"], torch.device("cpu"), "eager", reps=1, grid=grid)
    return out, dict(seen)


def test_extend_keeps_a_winner_that_turns_between_coarse_query_lengths(monkeypatch):
    """Extend's coarse grid steps 16-32x per axis (queries 2, 64, 1024), so most finer buckets have a nearby coarse
    bucket on one side of an axis only: 16 queries sees 64 within 4x, not 2. A multi-token-decode kernel ("mtd")
    fastest up to 16 queries and 1.4x behind from 64 on must still be timed at 16 queries (where it wins), and the
    table must serve it there and between 4 and 16 queries: pruning extrapolated from one side is no evidence."""
    ratio = {2: 0.7, 4: 0.8, 16: 0.9, 64: 1.4, 256: 2.0, 1024: 2.5}  # mtd's time over fa3's, by queries per request

    def speed(name, key):
        base = key[0] * key[1] * key[2] / 1e4 + 10.0
        return base * (ratio[key[1]] if name == "mtd" else 1.0)

    grid = ext_grid.extend_grid(SPEC, CUDA, None, "eager")
    out, seen = _measure(monkeypatch, grid, "extend", speed)
    wins = [k for k in seen if ratio[k[1]] < 1]
    assert [k for k in wins if "mtd" not in seen[k]] == []  # the winner is timed wherever it wins
    table = build_table(out, ["fa3", "mtd"])
    assert [k for k in wins if table.backend_for(k) != "mtd"] == []
    assert table.backend_for((1, 10, 1024)) == "mtd" and table.backend_for((16, 10, 16384)) == "mtd"
    assert table.backend_for((16, 128, 16384)) == "fa3"
