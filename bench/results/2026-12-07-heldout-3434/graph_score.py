"""Graph decode: the table's score per batch size (geometric mean of times over its shapes, as dispatch.build_table)
against a score by shapes within 3% of their fastest (ties: the geometric mean), each replayed on a held-out run's
graph decode cells of the same spec and run (per-shape times from the run's result cache). Lookup as the table's:
a timed batch size takes its choice; between two, the least log-interpolated slowdown.
Usage (from bench/results): python3 2026-12-07-heldout-3434/graph_score.py 2026-12-07-heldout-3434/cache-40-8-d64-32-8.json.xz
2026-12-07-heldout-3434/both-40-8-d64-32-8.json.xz 2026-12-07-heldout-7777/cache-results.json.xz
2026-12-07-heldout-7777/both-40.json.xz   (output: graph_score.txt)"""
import json
import lzma
import math
import sys


def load(path):
    raw = open(path, "rb").read()
    return json.loads(lzma.decompress(raw) if path.endswith(".xz") else raw)


def gm(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def scores(measured, names):
    by = {}
    for b in measured["buckets"]:
        by.setdefault(b["key"][0], []).append(b)
    out = {}
    for batch, group in sorted(by.items()):
        left = set().union(*(b.get("left_out", {}) for b in group))
        ok = [n for n in names if n not in left and all((b["us"].get(n) or 0) > 0 for b in group)]
        if not ok:
            continue
        geo = {n: gm([b["us"][n] for b in group]) for n in ok}
        within = {n: sum(b["us"][n] <= 1.03 * min(b["us"][m] for m in ok) for b in group) for n in ok}
        best_geo = min(geo.values())
        a = {n: geo[n] / best_geo for n in ok}
        top = max(within.values())
        bb = {n: 1 + 0.05 * (top - within[n]) + 0.01 * math.log(geo[n] / best_geo) for n in ok}
        out[batch] = (a, bb)
    return out


def choose(table, batch, which):
    keys = sorted(table)
    if batch <= keys[0] or batch >= keys[-1] or batch in table:
        k = min(keys, key=lambda x: abs(math.log(x) - math.log(batch)))
        s = table[k][which]
        return min(s, key=s.get)
    lo = max(k for k in keys if k < batch)
    hi = min(k for k in keys if k > batch)
    w = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
    s_lo, s_hi = table[lo][which], table[hi][which]
    common = set(s_lo) & set(s_hi)
    return min(common, key=lambda n: (1 - w) * s_lo[n] + w * s_hi[n])


def spec_name(spec):
    name = f'{spec["num_q_heads"]}/{spec["num_kv_heads"]}'
    if spec["head_dim"] != 128:
        name += f' d{spec["head_dim"]}'
    if spec["dtype"] != "bf16":
        name += f' {spec["dtype"]}'
    return name


def main(args):
    total = {"recorded": [0, 0], "geomean": [0, 0], "within": [0, 0]}
    for cache_path, heldout_path in zip(args[::2], args[1::2]):
        entries = load(cache_path)["entries"]
        cells = [r for r in load(heldout_path)["comparison"] if r["phase"] == "decode" and r["mode"] == "graph"]
        for e in entries.values():
            if e.get("phase") != "decode" or e.get("mode") != "graph" or "measured" not in e:
                continue
            name = spec_name(e["spec"])
            mine = [r for r in cells if r["spec"] == name]
            if not mine:
                continue
            table = scores(e["measured"], [n for n in e.get("candidates") or [] if n != "torch"] or
                           sorted({n for b in e["measured"]["buckets"] for n in b["us"]} - {"torch"}))
            for label, pick in (("recorded", lambda r: r["selected"]),
                                ("geomean", lambda r: choose(table, r["batch"], 0)),
                                ("within", lambda r: choose(table, r["batch"], 1))):
                ratios = [r["ratios"].get(pick(r)) for r in mine]
                hit = sum(x is not None and x <= 1.03 for x in ratios)
                worst = max((x for x in ratios if x is not None), default=float("nan"))
                total[label][0] += hit
                total[label][1] += len(mine)
                print(f"{heldout_path.split('/')[-2]} {name:10} {label:8} {hit}/{len(mine)} within 3%, "
                      f"geomean {gm([x for x in ratios if x]):.3f}, worst {worst:.2f}x")
    for label, (hit, n) in total.items():
        print(f"all {label:8} {hit}/{n}")


if __name__ == "__main__":
    main(sys.argv[1:])
