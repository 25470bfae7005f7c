"""The held-out rows of this folder's runs: prefill and decode over the four specs (40/8, 48/8, 32/8, 28/4) per mode,
each strategy's cells within 3% of the fastest, geometric mean and worst; every prefill/decode cell over 1.03x; the
extend run's rows per spec; each selection's wall time.
Usage: python3 summary.py (from this folder; needs only the standard library)."""
import json
import lzma
import math
from pathlib import Path

STRATEGIES = ("selected", "one_backend", "static", "batch_bound")


def score(rows, s):
    ratios = [r[s + "_ratio"] for r in rows if r.get(s + "_ratio") is not None]
    if not ratios:
        return None
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{sum(x <= 1.03 for x in ratios)}/{len(ratios)} within 3%, geomean {geo:.3f}, worst {max(ratios):.2f}x"


runs = {f: json.loads(lzma.decompress(Path(f).read_bytes()))
        for f in ("both-40-48.json.xz", "both-32-28.json.xz", "extend.json.xz")}
rows = [r for f in ("both-40-48.json.xz", "both-32-28.json.xz") for r in runs[f]["comparison"]]
for phase in ("prefill", "decode"):
    for mode in ("eager", "graph"):
        cells = [r for r in rows if r["phase"] == phase and r["mode"] == mode]
        for s in STRATEGIES:
            if score(cells, s):
                print(f"{phase:8} {mode:6} {s:12} {score(cells, s)}")
print("\ncells over 1.03x (spec, mode, shape: pick, ratio; fastest)")
for r in rows:
    if r["selected_ratio"] is None or r["selected_ratio"] > 1.03:
        ratio = f"{r['selected_ratio']:.2f}x" if r["selected_ratio"] else "no time"
        print(f"{r['spec']} {r['mode']:5} {r['phase']} {r['shape']}: {r['selected']} {ratio}; {r['fastest']}")
print("\nextend, eager, per spec")
ext = runs["extend.json.xz"]["comparison"]
for spec in dict.fromkeys(r["spec"] for r in ext):
    mine = [r for r in ext if r["spec"] == spec]
    print(f"{spec}: selected {score(mine, 'selected')}; one backend {score(mine, 'one_backend')}; "
          f"static {score(mine, 'static')}")
print(f"all: selected {score(ext, 'selected')}")
print("\nselections (spec, mode: wall s)")
for f, data in runs.items():
    for s in data["selections"]:
        spec = s["spec"]
        print(f"{f}: {spec['num_q_heads']}/{spec['num_kv_heads']} {s['mode']}: {s['wall_s']:.1f} s")
