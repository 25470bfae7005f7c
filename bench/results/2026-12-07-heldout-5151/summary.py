"""The held-out rows of this folder's runs over every spec they finished (40/8, 48/8, 32/8): per phase and mode,
each strategy's cells within 3% of the fastest, geometric mean and worst; then every cell over 1.03x.
Usage: python3 summary.py (from this folder; needs only the standard library)."""
import json
import lzma
import math
from pathlib import Path

STRATEGIES = ("selected", "one_backend", "static", "batch_bound")
rows = [r for f in ("both-40-48.json.xz", "both-32.json.xz")
        for r in json.loads(lzma.decompress(Path(f).read_bytes()))["comparison"]]
for phase in ("prefill", "decode"):
    for mode in ("eager", "graph"):
        cells = [r for r in rows if r["phase"] == phase and r["mode"] == mode]
        for s in STRATEGIES:
            ratios = [r[s + "_ratio"] for r in cells if r.get(s + "_ratio") is not None]
            if ratios:
                within = sum(x <= 1.03 for x in ratios)
                geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
                print(f"{phase:8} {mode:6} {s:12} {within}/{len(ratios)} within 3%, geomean {geo:.3f}, "
                      f"worst {max(ratios):.2f}x")
print("\ncells over 1.03x (spec, mode, batch, ragged, mean and longest context: pick, ratio; fastest)")
for r in rows:
    if r["phase"] == "decode" and r["selected_ratio"] > 1.03:
        lens = r["lens"]
        print(f"{r['spec']} {r['mode']:5} b{r['batch']:<4} {'ragged ' if r['ragged'] else 'uniform'} "
              f"mean {sum(lens) / len(lens):6.0f} max {max(lens):6}: {r['selected']} {r['selected_ratio']:.2f}x; "
              f"{r['fastest']}")
    elif r["phase"] == "prefill" and r["selected_ratio"] > 1.03:
        print(f"{r['spec']} {r['mode']:5} prefill {r['shape']}: {r['selected']} {r['selected_ratio']:.2f}x; "
              f"{r['fastest']}")
