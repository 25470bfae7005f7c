"""Replay eager pruning near finer buckets on recorded tables (every candidate timed on every bucket): which buckets'
winners it would have left untimed, and the share of timed candidate-time it saves."""
import json, sys
from attnsel.validate.timing import near_coarse, prune
from attnsel.validate import grid as G
for f in sys.argv[1:]:
    d = json.load(open(f))
    for s in d['selections']:
        for phase in ('prefill', 'decode'):
            t = s['dispatch'][phase]
            bs = [b for b in t['buckets'] if not b.get('ragged')]
            # level of each bucket
            def level(key):
                if phase == 'prefill':
                    n, tok, L = key
                    return max(G._level(n, G.PREFILL_SEQS), G._level(L, G.PREFILL_LENS))
                b, c = key
                base = c - G.DECODE_TILE_TAIL
                lb = G._level(b, G.DECODE_BATCHES) if b in G.DECODE_BATCHES else 2
                return max(lb, G._level(base, G.DECODE_CTX_POW2))
            coarse = [(tuple(b['key']), {'us': b['times_us']}) for b in bs if level(tuple(b['key'])) == 0]
            glob = prune([c for _, c in coarse], list({n for b in bs for n in b['times_us']}))
            lost = saved = total = 0
            for b in bs:
                key = tuple(b['key'])
                us = {n: v for n, v in b['times_us'].items() if n not in glob}
                total += sum(us.values())
                if level(key) == 0:
                    continue
                near = near_coarse(coarse, key)
                loc = prune(near, list(us))
                saved += sum(us[n] for n in loc)
                best = min(us, key=us.get)
                if best in loc:
                    rest = min(v for n, v in us.items() if n not in loc)
                    lost += 1
                    print('  lost', s['spec']['num_q_heads'], phase, b['label'], best, f"{rest/us[best]:.3f}")
            print(s['spec']['num_q_heads'], s['spec']['num_kv_heads'], phase, 'buckets', len(bs), 'coarse', len(coarse), 'global', list(glob), 'winners lost', lost, f'saved {saved/total:.1%} of timed us')
