"""Seed 8888's held-out runs (three device calls on one H100, one spec finished in each of the two calls cut at
their limit): per spec, each strategy's cells within 3% of the fastest, geometric mean and worst per phase and mode;
every cell over 1.03x; and the figures over the three specs together.
Usage: python3 summary.py (from this folder; needs only the standard library)."""
import json
import lzma
import math
from pathlib import Path

FILES = ("both-40.json.xz", "both-48-fp16.json.xz", "both-32-d64.json.xz")
STRATEGIES = ("selected", "one_backend", "static", "batch_bound")


def score(cells, s):
    ratios = [r[s + "_ratio"] for r in cells if r.get(s + "_ratio") is not None]
    if not ratios:
        return None
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{sum(x <= 1.03 for x in ratios)}/{len(ratios)} within 3%, geomean {geo:.3f}, worst {max(ratios):.2f}x"


rows = []
for name in FILES:
    run = json.loads(lzma.decompress(Path(name).read_bytes()))
    rows += run["comparison"]
    print(name, "selections:", [(s["mode"], round(s["wall_s"], 1)) for s in run["selections"]])
specs = list(dict.fromkeys(r["spec"] for r in rows))
for spec in specs + ["all"]:
    print(f"\n{spec}")
    for phase in ("prefill", "decode"):
        for mode in ("eager", "graph"):
            cells = [r for r in rows if r["phase"] == phase and r["mode"] == mode and spec in ("all", r["spec"])]
            for s in STRATEGIES:
                if score(cells, s):
                    print(f"  {phase:8} {mode:6} {s:12} {score(cells, s)}")
print("\ncells over 1.03x (spec, mode, phase, shape: pick, ratio; fastest)")
for r in rows:
    if r["selected_ratio"] is None or r["selected_ratio"] > 1.03:
        ratio = f"{r['selected_ratio']:.2f}x" if r["selected_ratio"] else "no time"
        print(f"{r['spec']} {r['mode']:5} {r['phase']} {r['shape']}: {r['selected']} {ratio}; {r['fastest']}")
