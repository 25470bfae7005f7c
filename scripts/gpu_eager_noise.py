"""How noisy are eager (host-bound) bucket timings, and which sampling rule makes a candidate's ratio to the fastest
repeatable? (issue 10: most eager misses are host-bound cells where the measured winner changes from run to run.)

Usage (device): python3 scripts/gpu_eager_noise.py OUT.json [--repeats N] [--backends a,b,c]
For a few host-bound buckets (bf16, d128, page 16), every variant times the candidates interleaved, the way
timing.time_bucket does, ``--repeats`` times in a row; each sample's CUDA-event time per call and the host's
issue time per call (perf_counter around the launches, before the synchronisation) are kept. Variants:
  base    the selection's rule: 7 samples of >= 1 ms each, candidates interleaved
  nogc    the same with Python's garbage collector disabled while sampling
  long    7 samples of >= 5 ms each
  many    21 samples of >= 1 ms each
Printed per bucket, variant and estimator (median, min, mean of the lower half): for every candidate the spread of
its ratio to the repeat's fastest over the repeats (max/min), and how often the repeat's winner differs from the
most frequent one. No claim is made from one run; the raw samples are in OUT.json.
"""
import gc
import json
import statistics
import sys
import time

import torch

from attnsel import backends
from attnsel.spec import AttentionSpec
from attnsel.validate import timing

args = sys.argv[1:]
out_path = args[0]
repeats = int(args[args.index("--repeats") + 1]) if "--repeats" in args else 6
wanted = args[args.index("--backends") + 1].split(",") if "--backends" in args else None
dev = torch.device("cuda")

BUCKETS = [
    (AttentionSpec(8, 1, 128, "bf16", 16), "decode", (32, 2048)),
    (AttentionSpec(32, 8, 128, "bf16", 16), "decode", (12, 3000)),
    (AttentionSpec(32, 8, 128, "bf16", 16), "decode", (1, 256)),
    (AttentionSpec(28, 4, 128, "bf16", 16), "prefill", [300] * 10),
    (AttentionSpec(8, 1, 128, "bf16", 16), "prefill", [400]),
]
VARIANTS = {"base": (7, 1e-3, False), "nogc": (7, 1e-3, True), "long": (7, 5e-3, False), "many": (21, 1e-3, False)}


def estimators(values: list[float]) -> dict[str, float]:
    low = sorted(values)[: max(1, len(values) // 2)]
    return {"median": statistics.median(values), "min": min(values), "lowhalf": sum(low) / len(low)}


def sample(item, cursor: int) -> tuple[float, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for i in range(item.repeat):
        item.unit(cursor + i)
    end.record()
    host = time.perf_counter() - t0
    end.synchronize()
    n = item.repeat * item.calls
    return start.elapsed_time(end) / 1e3 / n, host / n


rows = []
for spec, phase, shape in BUCKETS:
    names = [n for n in (wanted or ["fa3", "fa3_split", "fa3_packgqa", "triton"])
             if backends.availability(backends.get(n), spec, phase, dev)[0] is None]
    plan_args, sets = timing.rotated_workloads(spec, phase, shape, dev)
    prepared = {n: timing._prepare(backends.get(n), spec, phase, plan_args, sets, "eager", dev) for n in names}
    torch.cuda.synchronize()
    label = f"{spec.num_q_heads}/{spec.num_kv_heads} {phase} " + (timing.prefill_label(shape) if phase == "prefill"
                                                                   else f"{shape[0]}x{shape[1]}")
    for variant, (reps, sample_s, no_gc) in VARIANTS.items():
        cursor = 0
        for name, item in prepared.items():  # calibrate as time_bucket does
            item.repeat = 1
            per, _ = sample(item, cursor)
            item.repeat = max(1, min(10000, int(-(-sample_s // max(per, 1e-9)))))
        for rep in range(repeats):
            samples = {n: [] for n in prepared}
            order = list(prepared)
            if no_gc:
                gc.disable()
            try:
                for r in range(reps):
                    shift = r % len(order)
                    for name in order[shift:] + order[:shift]:
                        samples[name].append(sample(prepared[name], cursor))
                        cursor += prepared[name].repeat
            finally:
                gc.enable()
            rows.append({"bucket": label, "variant": variant, "repeat": rep,
                         "event_us": {n: [s[0] * 1e6 for s in v] for n, v in samples.items()},
                         "host_us": {n: [s[1] * 1e6 for s in v] for n, v in samples.items()}})
    del prepared, sets
    torch.cuda.empty_cache()

with open(out_path, "w") as f:
    json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeats": repeats, "rows": rows}, f)

for label in dict.fromkeys(r["bucket"] for r in rows):
    for variant in VARIANTS:
        group = [r for r in rows if r["bucket"] == label and r["variant"] == variant]
        for est in ("median", "min", "lowhalf"):
            per_rep = [{n: estimators(v)[est] for n, v in r["event_us"].items()} for r in group]
            winners = [min(t, key=t.get) for t in per_rep]
            common = max(set(winners), key=winners.count)
            ratios = {n: [t[n] / min(t.values()) for t in per_rep] for n in per_rep[0]}
            level = statistics.median(min(t.values()) for t in per_rep)
            host = statistics.median(statistics.median(v) for r in group for v in r["host_us"].values())
            print(f"{label:32s} {variant:5s} {est:8s} fastest~{level:6.1f}us host~{host:6.1f}us "
                  f"winner flips {sum(w != common for w in winners)}/{len(winners)} ({common}); ratio spread " +
                  ", ".join(f"{n} {min(v):.2f}-{max(v):.2f}" for n, v in ratios.items()), flush=True)
