"""Seed 3434's figures over its four specs (three device calls on one H100): per phase and mode, each strategy's
cells within 3% of the fastest, geometric mean and worst, with 95% bootstrap intervals (attnsel.bench_stats), and
every cell over 1.03x. Run from the repository root: python3 bench/results/2026-12-07-heldout-3434/summary.py"""
import json
import lzma
import pathlib

from attnsel.bench_stats import summarise

HERE = pathlib.Path(__file__).parent
FILES = ["both-48-8-fp16.json.xz", "both-40-8-d64-32-8.json.xz", "both-28-4.json.xz"]
rows = [r for f in FILES for r in json.loads(lzma.decompress((HERE / f).read_bytes()))["comparison"]]
print("all four specs (48/8 fp16, 40/8 d64, 32/8, 28/4), seed 3434, H100")
for s in summarise(rows, 3434):
    if s["spec"] == "all":
        print(f'{s["phase"]:22} {s["mode"]:5} {s["strategy"]:12} {round(s["within"] * s["timed"])}/{s["cells"]}'
              f' within 3% [{s["within_ci"][0]:.0%}, {s["within_ci"][1]:.0%}], geomean {s["geomean"]:.3f},'
              f' worst {s["worst"]:.2f}x')
print("\ncells over 1.03x (selected):")
for r in rows:
    if r["selected_ratio"] and r["selected_ratio"] > 1.03:
        best = sorted(r["ratios"].items(), key=lambda kv: kv[1])[:3]
        print(f'{r["spec"]:9} {r["phase"]:7} {r["mode"]:5} {r["shape"][:40]:40} {r["selected"]:21}'
              f' {r["selected_ratio"]:.3f}x  ' + ", ".join(f"{n} {x:.2f}" for n, x in best))
