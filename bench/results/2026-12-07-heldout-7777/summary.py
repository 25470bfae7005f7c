"""Seed 7777's held-out run (40/8 only; the call ran out of time before 48/8/128/fp16): each strategy's cells within
3% of the fastest, geometric mean and worst per phase and mode; every cell over 1.03x; and, from the selection's
cached graph decode timings, each batch size's geometric mean per backend over its shapes (relative to the best)
with its ragged batch's times in us.
Usage: python3 summary.py (from this folder; needs only the standard library)."""
import json
import lzma
import math
from pathlib import Path

run = json.loads(lzma.decompress(Path("both-40.json.xz").read_bytes()))
rows = run["comparison"]


def score(cells, s):
    ratios = [r[s + "_ratio"] for r in cells if r.get(s + "_ratio") is not None]
    if not ratios:
        return None
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{sum(x <= 1.03 for x in ratios)}/{len(ratios)} within 3%, geomean {geo:.3f}, worst {max(ratios):.2f}x"


for phase in ("prefill", "decode"):
    for mode in ("eager", "graph"):
        cells = [r for r in rows if r["phase"] == phase and r["mode"] == mode]
        for s in ("selected", "one_backend", "static", "batch_bound"):
            if score(cells, s):
                print(f"{phase:8} {mode:6} {s:12} {score(cells, s)}")
print("\ncells over 1.03x (mode, phase, shape: pick, ratio; fastest)")
for r in rows:
    if r["selected_ratio"] is None or r["selected_ratio"] > 1.03:
        ratio = f"{r['selected_ratio']:.2f}x" if r["selected_ratio"] else "no time"
        print(f"{r['mode']:5} {r['phase']} {r['shape']}: {r['selected']} {ratio}; {r['fastest']}")
print("\ngraph decode timings per batch size: geomean over its shapes relative to the best; its ragged batch (us)")
cache = json.loads(lzma.decompress(Path("cache-results.json.xz").read_bytes()))
entries = cache.get("entries", cache)
measured = next(e["measured"] for e in entries.values() if isinstance(e, dict)
                and e.get("measured", {}).get("mode") == "graph" and e["measured"].get("phase") == "decode")
by_batch = {}
for b in measured["buckets"]:
    by_batch.setdefault(b["key"][0], []).append(b)
for batch, group in sorted(by_batch.items()):
    names = set.intersection(*(set(b["us"]) for b in group))
    geo = {n: math.exp(sum(math.log(b["us"][n]) for b in group) / len(group)) for n in names}
    best = min(geo, key=geo.get)
    ragged = next((b["us"] for b in group if b.get("ragged")), {})
    print(batch, best, {n: round(geo[n] / geo[best], 2) for n in sorted(geo)},
          "ragged:", {n: round(t, 1) for n, t in sorted(ragged.items())})
print("\nselections:", [(s["mode"], round(s["wall_s"], 1)) for s in run["selections"]])
