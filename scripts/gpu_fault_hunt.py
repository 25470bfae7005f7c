"""Find the kernel behind the device faults of `attnsel bench`'s decode grid on the H200 (device-side gather assert in
the torch backend, "operation not supported on global/shared address space" without torch), 2026-12-03.

Usage (device):
  python3 scripts/gpu_fault_hunt.py mixed [names]   the bench's decode cells 1x200, 1x700, 12x700 (eager then graph),
                                                   every candidate in one process as the bench runs them, with a sync
                                                   and an integrity check of the shared page table and sequence
                                                   lengths after every prepare and every timed sample
  python3 scripts/gpu_fault_hunt.py one NAME        one backend alone, eager then graph, on 1x700 and 12x700 (run it
                                                   under compute-sanitizer with PYTORCH_NO_CUDA_MEMORY_CACHING=1 for
                                                   eager only: ONE_EAGER_ONLY=1)
Prints one line per event; the first "CORRUPT" or "ERROR" line names the candidate and the stage.
"""
import os
import sys

import torch

from attnsel.backends import get
from attnsel.spec import AttentionSpec
from attnsel.validate import timing
from attnsel.validate.cases import spot_check

SPEC = AttentionSpec(32, 8, 128, "bf16", 16)
DEV = torch.device("cuda")
DEFAULT = "fa3,fa3_packgqa,flashinfer,flashinfer_cuda_cores,triton,torch"


def guard(label: str, plan_args: tuple, saved: list) -> None:
    torch.cuda.synchronize()
    for name, t, copy in zip(("page_table", "seq_lens"), plan_args, saved):
        if not torch.equal(t.cpu(), copy):
            print(f"CORRUPT {name} after {label}", flush=True)
            raise SystemExit(3)


def mixed(names: list[str]) -> None:
    cands = {n: get(n) for n in names}
    for shape in ((1, 200), (1, 700), (12, 700), (3, 3000)):
        for mode in ("eager", "graph"):
            plan_args, sets = timing.rotated_workloads(SPEC, "decode", shape, DEV)
            saved = [t.cpu().clone() for t in plan_args]
            prepared = {}
            for name, backend in cands.items():
                try:
                    prepared[name] = timing._prepare(backend, SPEC, "decode", plan_args, sets, mode, DEV)
                    guard(f"prepare {name} {shape} {mode}", plan_args, saved)
                except SystemExit:
                    raise
                except Exception as exc:
                    print(f"ERROR prepare {name} {shape} {mode}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    raise SystemExit(4)
            cursor = 0
            for r in range(3):
                for name, item in prepared.items():
                    try:
                        timing._sample(item, cursor, DEV)
                        cursor += item.repeat
                        guard(f"sample {r} {name} {shape} {mode}", plan_args, saved)
                    except SystemExit:
                        raise
                    except Exception as exc:
                        print(f"ERROR sample {name} {shape} {mode}: {type(exc).__name__}: {str(exc)[:300]}",
                              flush=True)
                        raise SystemExit(4)
            for name, item in prepared.items():
                for index, out in item.outputs():
                    reason = spot_check(SPEC, "decode", plan_args, sets[index], out, {})
                    print(f"{'WRONG' if reason else 'ok'} {name} {shape} {mode} set {index}: {reason or ''}",
                          flush=True)
            del prepared, sets
            torch.cuda.synchronize()
            print(f"done {shape} {mode}", flush=True)


def one(name: str) -> None:
    backend = get(name)
    modes = ("eager",) if os.environ.get("ONE_EAGER_ONLY") else ("eager", "graph")
    for shape in ((1, 700), (12, 700)):
        plan_args, sets = timing.rotated_workloads(SPEC, "decode", shape, DEV)
        sets = sets[:3]
        saved = [t.cpu().clone() for t in plan_args]
        run = backend.plan_decode(SPEC, *plan_args)
        for mode in modes:
            if mode == "eager":
                outs = [run(*s) for s in sets for _ in range(2)][1::2]
            else:
                graph, outs = timing.capture(run, sets, DEV)
                for _ in range(3):
                    graph.replay()
            guard(f"{name} {shape} {mode}", plan_args, saved)
            bad = [spot_check(SPEC, "decode", plan_args, s, o, {}) for s, o in zip(sets, outs)]
            print(f"{name} {shape} {mode}: {[b or 'ok' for b in bad]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "mixed":
        mixed((sys.argv[2] if len(sys.argv) > 2 else DEFAULT).split(","))
    else:
        one(sys.argv[2])
