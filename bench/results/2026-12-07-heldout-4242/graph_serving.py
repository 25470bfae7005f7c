"""graph-failed.json's cells judged among the backends that can serve CUDA-graph replays (FlashInfer's variants and
torch's prefill and extend cannot): the fastest per cell, LightLLM's static order and the per-batch-size bound
(decode: the best single backend per spec and batch size, chosen from these cells' own times). Usage: python3
graph_serving.py graph-failed.json (no torch needed)."""
import collections
import json
import math
import sys

d = json.load(open(sys.argv[1]))
stale = lambda n, phase: n.startswith("flashinfer") or (n == "torch" and phase in ("prefill", "extend"))  # noqa: E731
res, fastest, by_batch = collections.defaultdict(list), collections.Counter(), collections.defaultdict(list)
for r in d["comparison"]:
    ok = {n: v for n, v in r["ratios"].items() if not stale(n, r["phase"])}
    best = min(ok.values())
    ok = {n: v / best for n, v in ok.items()}
    fastest[(r["phase"], min(ok, key=ok.get))] += 1
    static = next(n for n in ("fa3", "flashinfer", "triton") if n in ok)
    res[(r["phase"], "static")].append(ok[static])
    if r["phase"] == "decode":
        by_batch[(r["spec"], r["batch"])].append(ok)
for cells in by_batch.values():
    names = set.intersection(*(set(c) for c in cells))
    pick = min(names, key=lambda n: sum(math.log(c[n]) for c in cells))
    res[("decode", "batch bound")] += [c[pick] for c in cells]
for k, v in sorted(res.items()):
    print(k, f"{sum(x <= 1.03 for x in v)}/{len(v)} within 3%, geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f},"
          f" worst {max(v):.2f}x")
print("fastest:", dict(fastest))
