"""The cells a held-out run's dispatch missed (over 1.03x the fastest valid backend), the pick replayed with the
current lookup on the run's recorded tables, and the totals per phase. Usage: python3 misses.py heldout.json
(attnsel importable)."""
import json, sys, math, collections
from attnsel.dispatch import DispatchTable
from attnsel.validate.grid import prefill_key
d = json.load(open(sys.argv[1]))
tabs = {}
for s in d['selections']:
    sp = f"{s['spec']['num_q_heads']}/{s['spec']['num_kv_heads']}"
    tabs[(sp, s['mode'])] = {p: DispatchTable.from_json(t) for p, t in s['dispatch'].items() if t}
res = collections.defaultdict(list)
for r in d['comparison']:
    t = tabs.get((r['spec'], r['mode']), {}).get(r['phase'])
    if not t: continue
    lens = r['lens']
    if r['phase'] == 'prefill':
        pick = t.backend_for(prefill_key(lens))
    else:
        b = len(lens); key = (b, -(-sum(lens)//b))
        pick = t.backend_for(key, max(lens))
    cands = set(k for b in t.buckets for k in b.times_us)
    best_c = min(v for k, v in r['ratios'].items() if k in cands)
    v = r['ratios'].get(pick, float('inf'))
    res[(r['phase'], 'new', 'all')].append(v); res[(r['phase'], 'new', 'cands')].append(v / best_c)
    res[(r['phase'], 'rec', 'all')].append(r['selected_ratio'])
    if v > 1.03: print(r['spec'], r['phase'], r['shape'], pick, round(v, 3), 'fastest', r['fastest'], 'rec', r['selected'], round(r['selected_ratio'], 3))
for k, v in sorted(res.items()):
    print(k, f"{sum(x <= 1.03 for x in v)}/{len(v)} geo {math.exp(sum(map(math.log, v))/len(v)):.3f} worst {max(v):.2f}")
