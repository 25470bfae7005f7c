"""Graph decode's table for 40/8 rebuilt from this run's timings with the ragged batch counted k times in each batch
size's geometric mean (k = 1: as selected), each scored on this run's 24 graph decode cells.
Usage (repository root): python3 bench/results/2026-12-07-heldout-7777/ragged_weight.py"""
import json
import lzma
import math
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[2]))
from attnsel.dispatch import build_table  # noqa: E402

cache = json.loads(lzma.decompress((here / "cache-results.json.xz").read_bytes()))
measured = next(e["measured"] for e in cache.get("entries", cache).values() if isinstance(e, dict)
                and e.get("measured", {}).get("mode") == "graph" and e["measured"].get("phase") == "decode")
run = json.loads(lzma.decompress((here / "both-40.json.xz").read_bytes()))
cells = [r for r in run["comparison"] if r["mode"] == "graph" and r["phase"] == "decode"]
uniform = [b for b in measured["buckets"] if not b.get("ragged")]
ragged = [b for b in measured["buckets"] if b.get("ragged")]
for k in (1, 2, 3, 4, 6):
    table = build_table(dict(measured, buckets=uniform + ragged * k), ["fa3", "fa3_packgqa", "triton", "torch"])
    ratios = [r["ratios"].get(table.backend_for((r["batch"],))) or math.inf for r in cells]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"ragged x{k}: {sum(x <= 1.03 for x in ratios)}/{len(ratios)} within 3%, geomean {geo:.3f}, "
          f"worst {max(ratios):.2f}x")
