"""Triton's split decode: merge in the decode kernel (its last program per row and KV head) vs a second kernel.

Usage (device): python3 scripts/gpu_triton_merge_probe.py OUT.json
Per head layout (32/8, 28/4, 8/1; bf16, d128, page 16) and decode bucket where Triton's plan splits: the selection's
own timing (timing.time_bucket: candidates interleaved, data from HBM, outputs spot-checked against the float32
reference after the timed runs) of Triton with the in-kernel merge ("merge"), Triton with the reduce kernel
("reduce") and FA3, in eager mode (3 times: host-bound buckets are noisy) and in graph mode; plus each Triton
variant's host issue time per call (a burst of calls between two synchronisations).
"""
import json
import statistics
import sys
import time

import torch

import attnsel.backends.triton as tb
from attnsel import backends
from attnsel.spec import AttentionSpec
from attnsel.validate import timing


class Variant:
    """Triton's backend with MERGE_IN_DECODE_KERNEL fixed for its plans (the flag is read when a plan is made)."""

    def __init__(self, merge: bool):
        self.merge = merge

    def __getattr__(self, name):
        return getattr(tb.BACKEND, name)

    def plan_decode(self, spec, page_table, seq_lens):
        old, tb.MERGE_IN_DECODE_KERNEL = tb.MERGE_IN_DECODE_KERNEL, self.merge
        try:
            return tb.BACKEND.plan_decode(spec, page_table, seq_lens)
        finally:
            tb.MERGE_IN_DECODE_KERNEL = old


def host_us(backend, spec, shape, dev) -> float:
    plan_args, sets = timing.rotated_workloads(spec, "decode", shape, dev)
    run = backend.plan_decode(spec, *plan_args)
    for s in sets[:3]:
        run(*s)
    torch.cuda.synchronize()
    host = []
    for _ in range(7):
        t0 = time.perf_counter()
        for i in range(50):
            run(*sets[i % len(sets)])
        host.append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(host), 1)


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cands = {"merge": Variant(True), "reduce": Variant(False), "fa3": backends.get("fa3")}
    layouts = {(32, 8): [(1, 200), (1, 9000), (8, 2048), (24, 512), (16, 4096), (1, 2048)],
               (28, 4): [(1, 700), (45, 512), (64, 256), (64, 1024), (8, 9000)],
               (8, 1): [(1, 9000), (8, 700), (64, 512), (128, 256)]}
    rows = []
    for (hq, hk), shapes in layouts.items():
        spec = AttentionSpec(hq, hk, 128, "bf16", 16)
        for batch, ctx in shapes:
            row = {"heads": [hq, hk], "shape": [batch, ctx],
                   "splits": tb.decode_splits(batch, hk, ctx, batch * ctx, 64, sms)[0]}
            eager = [timing.time_bucket(cands, spec, "decode", (batch, ctx), dev, "eager", 21) for _ in range(3)]
            graph = timing.time_bucket(cands, spec, "decode", (batch, ctx), dev, "graph", 11)
            row["eager_us"] = [e["us"] for e in eager]
            row["graph_us"] = graph["us"]
            row["errors"] = {k: v for e in eager + [graph] for k, v in e["errors"].items()}
            row["host_us"] = {n: host_us(cands[n], spec, (batch, ctx), dev) for n in ("merge", "reduce")}
            eager_med = {n: statistics.median(e[n] for e in row["eager_us"] if n in e) for n in cands
                         if all(n in e for e in row["eager_us"])}
            row["eager_median_us"] = {n: round(v, 2) for n, v in eager_med.items()}
            rows.append(row)
            print(f"{hq}/{hk} {batch}x{ctx} splits {row['splits']}: graph " +
                  " ".join(f"{n} {v:.1f}" for n, v in graph["us"].items()) +
                  " | eager median " + " ".join(f"{n} {v:.1f}" for n, v in eager_med.items()) +
                  f" | host {row['host_us']}" + (f" | errors {row['errors']}" if row["errors"] else ""),
                  flush=True)
    json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
               "command": "python3 scripts/gpu_triton_merge_probe.py " + sys.argv[1], "rows": rows},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
