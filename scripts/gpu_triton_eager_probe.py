"""Why does Triton's eager decode time jump between neighbouring buckets? (issue 10: round 10's one eager miss,
28/4 heads decode 100 x 700, was served from buckets where Triton measured 1.9-3x its neighbours: 64 x 512 at
118.9 us beside 64 x 256 at 73.0 and 91 x 512 at 37.7.)

Usage (device): python3 scripts/gpu_triton_eager_probe.py OUT.json
For 28/4 heads (bf16, d128, page 16) and a few decode buckets: the selection's eager timing (timing.time_bucket, Triton
and FA3 interleaved) three times, the graph-mode timing once (device time alone), and Triton's host issue time per
call (perf_counter over a burst of calls between two synchronisations), with the split plan Triton makes there.
"""
import json
import statistics
import sys
import time

import torch

from attnsel import backends
from attnsel.backends.triton import decode_splits
from attnsel.spec import AttentionSpec
from attnsel.validate import timing

dev = torch.device("cuda")
spec = AttentionSpec(28, 4, 128, "bf16", 16)
SHAPES = [(64, 256), (64, 512), (64, 1024), (91, 512), (100, 700), (128, 256), (128, 512), (128, 1024), (45, 512)]
cands = {n: backends.get(n) for n in ("triton", "fa3")}
sms = torch.cuda.get_device_properties(dev).multi_processor_count
rows = []
for batch, ctx in SHAPES:
    row = {"shape": [batch, ctx], "splits": decode_splits(batch, 4, ctx, batch * ctx, 64, sms)[0]}
    row["eager"] = [timing.time_bucket(cands, spec, "decode", (batch, ctx), dev, "eager", 21)["us"] for _ in range(3)]
    row["graph"] = timing.time_bucket(cands, spec, "decode", (batch, ctx), dev, "graph", 7)["us"]
    plan_args, sets = timing.rotated_workloads(spec, "decode", (batch, ctx), dev)
    run = cands["triton"].plan_decode(spec, *plan_args)
    for s in sets[:3]:
        run(*s)
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(50):
            run(*sets[i % len(sets)])
        host.append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
    row["triton_host_us"] = statistics.median(host)
    rows.append(row)
    print(batch, ctx, "splits", row["splits"], "eager triton", [round(e.get("triton", -1), 1) for e in row["eager"]],
          "fa3", [round(e.get("fa3", -1), 1) for e in row["eager"]], "graph", {k: round(v, 1) for k, v in
          row["graph"].items()}, "triton host", round(row["triton_host_us"], 1), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
