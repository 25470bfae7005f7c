"""Tile sweep of the Triton extend kernel at the issue's two speed targets, with FA3/FlashInfer baselines."""
import json, sys, time
import torch, triton.testing
import attnsel.backends.triton.extend as te
from attnsel.backends import get
from attnsel.spec import AttentionSpec
from tests.fixtures.extend_cases import make_batch

def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")

spec = AttentionSpec(32, 8, 128, "bf16", 16)
res = {}
tri = get("triton")
orig = te.extend_tiles
mtp = make_batch(spec, [(2, 4098)] * 64, device="cuda", sentinel=-1)
chunk = make_batch(spec, [(512, 8704)] * 8, device="cuda", sentinel=-1)
last = (mtp.cu_seqlens_q[1:] - 1).long()
q1 = mtp.q[last]
dec = tri.plan_decode(spec, mtp.page_table, mtp.seq_lens)
res["triton_decode"] = ms(lambda: dec(q1, mtp.k_cache, mtp.v_cache))
for name in ("fa3",):
    try:
        b = get(name)
        d = b.plan_decode(spec, mtp.page_table, mtp.seq_lens)
        res[f"{name}_decode"] = ms(lambda: d(q1, mtp.k_cache, mtp.v_cache))
        r = mtp.plan(b)
        res[f"{name}_mtp"] = ms(lambda: r(mtp.q, mtp.k_cache, mtp.v_cache))
        r = chunk.plan(b)
        res[f"{name}_chunk"] = ms(lambda: r(chunk.q, chunk.k_cache, chunk.v_cache))
    except Exception as e:
        res[f"{name}_error"] = repr(e)[:200]
    print(json.dumps(res), flush=True)

def tiles(bq, bg, bn, w, s, long):
    return lambda hd, g, mq: te.ExtendTiles(bq, bg, bn, w, s, long) if mq > 1 else orig(hd, g, mq)

# usage: python3 sweep_ext.py OUT.json [1|2]: the configurations of the first sweep (default) or the second
SECOND = len(sys.argv) > 2 and sys.argv[2] == "2"
mtp_cfgs = [(4, 4, 64, 4, 2), (4, 4, 128, 4, 2)] if SECOND else [(4, 4, 64, 4, 4), (4, 4, 32, 4, 4), (4, 4, 128, 4, 3), (4, 4, 64, 4, 2), (4, 4, 64, 8, 4), (4, 4, 64, 4, 3),
            (2, 8, 64, 4, 4), (4, 4, 32, 4, 2), (4, 4, 128, 8, 2)]
long_cfgs = [(64, 4, 64, 8, 3), (64, 4, 64, 8, 4), (64, 4, 64, 4, 3), (64, 4, 32, 4, 3), (64, 4, 64, 8, 2),
             (32, 4, 64, 4, 4), (32, 4, 32, 4, 3)] if SECOND else [(32, 4, 128, 8, 3), (32, 4, 64, 8, 3), (32, 4, 64, 4, 3), (32, 4, 128, 8, 2), (32, 4, 128, 8, 4),
             (16, 4, 128, 4, 3), (16, 4, 64, 4, 3), (16, 4, 64, 4, 4), (64, 4, 64, 8, 3), (32, 4, 32, 4, 4),
             (64, 4, 128, 8, 2), (16, 4, 128, 8, 3)]
T0 = time.time()
import attnsel.backends.triton as tbk
r = mtp.plan(tri); res["mtp_default"] = [ms(lambda: r(mtp.q, mtp.k_cache, mtp.v_cache)), r.splits, str(r.tiles)]
tbk.MERGE_IN_DECODE_KERNEL = False
r = mtp.plan(tri); res["mtp_nomerge"] = [ms(lambda: r(mtp.q, mtp.k_cache, mtp.v_cache)), r.splits]
dec2 = tri.plan_decode(spec, mtp.page_table, mtp.seq_lens); res["decode_nomerge"] = ms(lambda: dec2(q1, mtp.k_cache, mtp.v_cache))
tbk.MERGE_IN_DECODE_KERNEL = True
print(res, flush=True)
def sweep(tag, batch, cfgs, long, deadline):
    """Each configuration checked row by row against float32, then timed."""
    for cfg in cfgs:
        if time.time() - T0 > deadline:
            break
        te.extend_tiles = tiles(*cfg, long)
        try:
            r = batch.plan(tri); out = r(batch.q, batch.k_cache, batch.v_cache); torch.cuda.synchronize(); batch.check(out)
            res[f"{tag}{cfg}"] = [ms(lambda: r(batch.q, batch.k_cache, batch.v_cache)), r.splits]
        except Exception as e:
            res[f"{tag}{cfg}"] = repr(e)[:200]
        print(f"{tag}{cfg}", res[f"{tag}{cfg}"], flush=True)


sweep("mtp", mtp, mtp_cfgs, False, 100)
sweep("long", chunk, long_cfgs, True, 230)
te.extend_tiles = orig
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res))
