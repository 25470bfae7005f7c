"""Which lookup space predicts the prefill winner on shapes a table never timed? Replays the recorded H100 selections
of bench/results/2026-12-06-round20 (eager and graph, 32/8, 28/4, 8/1) on the CPU, for four lookup spaces:
  - held out: each table's level-2 uniform buckets (the sqrt(2) steps), predicted by a table of its other buckets;
  - the fixed bench's prefill cells (every backend timed there), predicted by the full table.
Run from the repository root: python3 bench/results/2026-12-07-prefill-key/prefill_key.py
"""
import glob
import json
import math
import sys

sys.path.insert(0, ".")
from attnsel import bench  # noqa: E402
from attnsel.dispatch import Bucket, DispatchTable  # noqa: E402
from attnsel.validate import grid  # noqa: E402

# name -> (point of a (seqs, tokens, longest) key, whether the two ragged buckets take part)
SPACES = {
    "(seqs, tokens, longest)": (lambda k: tuple(k), True),
    "(seqs, longest)": (lambda k: (k[0], k[2]), True),
    "(tokens, longest)": (lambda k: (k[1], k[2]), True),
    "(tokens / longest, longest)": (lambda k: (k[1] / k[2], k[2]), False),
}


def level(key):
    return max(grid._level(key[0], grid.PREFILL_SEQS), grid._level(key[2], grid.PREFILL_LENS))


def table(buckets, f, mode):
    """A table over the point space (keys replaced by points; the generic lookup, prefill's own point not used)."""
    moved = [Bucket(f(b.key), b.label, b.backend, b.us, b.runner_up, b.runner_up_us, b.times_us, b.spread)
             for b in buckets]
    return DispatchTable("lookup", mode, ("x",) * len(moved[0].key), tuple(moved), moved[0].backend, 0)


def summary(ratios):
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{sum(r <= 1.03 for r in ratios)}/{len(ratios)} within 3%, geomean {geo:.4f}, worst {max(ratios):.2f}x"


out = {name: ([], []) for name in SPACES}
for path in sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else "bench/results/2026-12-06-round20/*/bench-*.json")):
    data = json.load(open(path))
    cells = {}
    for c in data["cells"]:
        if c["phase"] == "prefill" and c["us"]:
            cells.setdefault(c["shape"], {})[c["backend"]] = c["us"]
    for sel in data["selections"]:
        full = DispatchTable.from_json(sel["dispatch"]["prefill"]).buckets
        uniform = [b for b in full if b.key[1] == b.key[0] * b.key[2]]
        for name, (f, ragged) in SPACES.items():
            train = table([b for b in full if level(b.key) < 2 and (ragged or b in uniform)], f, sel["mode"])
            for b in uniform:
                if level(b.key) == 2:
                    out[name][0].append(b.times_us[train.backend_for(f(b.key))] / min(b.times_us.values()))
            served = table([b for b in full if ragged or b in uniform], f, sel["mode"])
            for lens in bench.PREFILL_GRID:
                times = cells.get(grid.prefill_label(lens))
                if times:
                    out[name][1].append(times[served.backend_for(f(grid.prefill_key(lens)))] / min(times.values()))
for name, (held, fixed) in out.items():
    print(f"{name}: level 2 held out {summary(held)}; bench cells {summary(fixed)}")
