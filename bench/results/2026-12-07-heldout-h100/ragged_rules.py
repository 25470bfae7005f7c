"""Ragged decode cells of heldout.json replayed with the recorded tables under three rules: the current lookup (the
ragged sub-table where it covers the batch), the uniform table by the mean, and an extend-style skew estimate (time at
the mean plus one row of the longest context). Run from the repository root with the venv:
python3 bench/results/2026-12-07-heldout-h100/ragged_rules.py bench/results/2026-12-07-heldout-h100/heldout.json"""
import json, math, sys, collections
sys.path.insert(0, '/work/main')
from attnsel.dispatch import DispatchTable
from attnsel.validate import timing
d = json.load(open(sys.argv[1]))
tabs = {f"{s['spec']['num_q_heads']}/{s['spec']['num_kv_heads']}": DispatchTable.from_json(s['dispatch']['decode']) for s in d['selections']}
def skew_pick(t, key, longest):
    lone = (1, longest)
    even = t._times(key, t._sides(key)); alone = t._times(lone, t._sides(lone))
    cost = {n: even[n] + alone[n] for n in set(even) & set(alone)}
    return min(cost, key=cost.get) if cost else None
def maxpick(t, key, longest):
    even = t._times(key, t._sides(key)); alone = t._times((1, longest), t._sides((1, longest)))
    cost = {n: max(even[n], alone[n]) for n in set(even) & set(alone)}
    return min(cost, key=cost.get)
res = collections.defaultdict(list)
for r in d['comparison']:
    if r['phase'] != 'decode' or r['spec'] not in tabs: continue
    t = tabs[r['spec']]; lens = r['lens']; b = len(lens); mean = round(sum(lens) / b); longest = max(lens)
    key = (b, mean)
    cs = set(k for bk in t.buckets for k in bk.times_us)
    inset = {k: v for k, v in r['ratios'].items() if k in cs}; best = min(inset.values())
    skewed = b >= 2 and longest >= 2.5 * mean
    picks = {'current': t.backend_for(key, longest), 'uniform': t.without('ragged').backend_for(key, longest),
             'skew-sum': skew_pick(t, key, longest) if skewed else t.backend_for(key, longest),
             'skew-sum-only': skew_pick(t, key, longest) if skewed else t.without('ragged').backend_for(key, longest)}
    for name, p in picks.items():
        v = r['ratios'].get(p, float('inf')) / best
        res[(name, 'skewed' if skewed else 'other')].append(v)
    if skewed:
        print(r['spec'], r['shape'], {n: (p, round(r['ratios'].get(p, 9) / best, 3)) for n, p in picks.items()})
for k, v in sorted(res.items()):
    print(k, f"{sum(x <= 1.03 for x in v)}/{len(v)} geo {math.exp(sum(map(math.log, v))/len(v)):.3f} worst {max(v):.2f}")
