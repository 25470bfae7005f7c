"""Held-out comparisons judged two ways: against every valid backend the bench timed (opt-in ones included) and
against the selection's own candidates (the backends its dispatch tables timed). Usage: python3 against_candidates.py
heldout.json (no torch needed)."""
import json, math, sys, collections
d = json.load(open(sys.argv[1]))
cands = {}
for s in d['selections']:
    cands[f"{s['spec']['num_q_heads']}/{s['spec']['num_kv_heads']}"] = {p: set(k for b in t['buckets'] for k in b['times_us']) for p, t in s['dispatch'].items() if t}
res = collections.defaultdict(list)
for r in d['comparison']:
    sp = r['spec']
    if sp not in cands: continue
    cs = cands[sp][r['phase']]
    inset = {b: v for b, v in r['ratios'].items() if b in cs}
    best = min(inset.values())
    for strat in ('selected', 'one_backend', 'static'):
        pick = r.get(strat)
        v = r['ratios'].get(pick, float('inf')) if pick else float('inf')
        res[(r['phase'], strat, 'all valid')].append(v)
        res[(r['phase'], strat, 'candidates')].append(v / best)
for k, v in sorted(res.items()):
    fin = [x for x in v if x != float('inf')]
    print(k, f"{sum(x <= 1.03 for x in v)}/{len(v)} geomean {math.exp(sum(map(math.log, fin))/len(fin)):.3f} worst {max(v):.2f}x")
