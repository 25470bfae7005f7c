"""Validation worker: the entry point of the spawned process (``python -m attnsel.validate.worker``).

Reads one JSON job from stdin: ``{"spec", "device", "tasks": [{"backend", "phase"}], "measure", "mode"}``; for each
task writes JSON lines to the protocol descriptor: ``{"event": "start", ...}`` then ``{"event": "result", ...}``,
and ``{"event": "done", ...}`` at the end. File descriptor 1 is pointed at stderr first, so that C/CUDA code printing
to stdout cannot corrupt the protocol; the parent captures stderr and quotes its tail when the worker dies.

A task whose backend is ``timing.TIMING_TASK`` ("@timing") times the phase's candidates interleaved over the bucket
grid; its candidates come from ``measure``: ``{phase: {"backends": [names in priority order], "vouched": [names
valid in the parent's cache], "budget_s": seconds}}``. In mode "graph" every valid candidate is also captured in a
CUDA graph and replayed ("graph_capture": "ok" or a reason).
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import resource
import signal
import sys
import time
import traceback

import torch

from .. import backends
from ..spec import AttentionSpec
from . import cases, timing

log = logging.getLogger("attnsel.worker")
VALIDATION_WORKSPACE_MB = "32"


def validate_one(name: str, phase: str, spec: AttentionSpec, device: torch.device, case, do_measure: bool,
                 mode: str) -> dict:
    backend = backends.get(name)
    os.environ["ATTNSEL_FLASHINFER_WORKSPACE_MB"] = VALIDATION_WORKSPACE_MB
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        out = cases.run_case(backend, spec, case)
        timing._sync(device)
        result = cases.check_output(spec, out, case)
    except Exception as exc:
        log.error("%s %s raised:\n%s", name, phase, traceback.format_exc())
        result = {"status": "rejected", "reason": f"raised {type(exc).__name__}: {exc}"}
    result["time_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        result["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if result["status"] == "valid" and mode == "graph":
        result.update(timing.graph_check(backend, spec, case, device))
    return result


def time_phase(phase: str, spec: AttentionSpec, device: torch.device, job: dict, outcomes: dict) -> dict:
    """The TIMING_TASK of a phase: time its candidates interleaved over the bucket grid (timing.measure). Times the
    candidates of job["measure"][phase]["backends"] that passed validation in this process or that the parent
    vouches for (valid in its cache); a result {"status": "timed", "measured": ...} or "rejected" with a reason."""
    order = job["measure"][phase]
    vouched = set(order.get("vouched", ()))
    names = [n for n in order["backends"] if outcomes.get((n, phase), n in vouched)]
    t0 = time.perf_counter()
    try:
        measured = timing.measure(spec, phase, names, device, job.get("mode", "eager"), order.get("budget_s"))
    except Exception as exc:
        log.error("timing %s raised:\n%s", phase, traceback.format_exc())
        return {"status": "rejected", "reason": f"timing raised {type(exc).__name__}: {exc}",
                "time_s": time.perf_counter() - t0}
    return {"status": "timed", "reason": "", "measured": measured, "time_s": time.perf_counter() - t0}


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    faulthandler.enable()  # a crash in a kernel library leaves the Python stack in the stderr tail
    faulthandler.register(signal.SIGUSR1)  # the parent asks for the stack of a hung candidate before killing
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[worker] %(levelname)s %(message)s")
    job = json.load(sys.stdin)
    spec = AttentionSpec.from_dict(job["spec"])
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    built: dict[str, object] = {}
    outcomes: dict[tuple[str, str], bool] = {}  # (backend, phase) -> usable, for the timing tasks

    def emit(**event) -> None:
        proto.write(json.dumps(event) + "\n")

    emit(event="ready", pid=os.getpid())
    for task in job["tasks"]:
        name, phase = task["backend"], task["phase"]
        emit(event="start", backend=name, phase=phase)
        if name == timing.TIMING_TASK:
            emit(event="result", backend=name, phase=phase, **time_phase(phase, spec, device, job, outcomes))
            continue
        if phase not in built:
            built[phase] = cases.make_case(spec, phase, device)
        result = validate_one(name, phase, spec, device, built[phase], job.get("measure", False),
                              job.get("mode", "eager"))
        outcomes[(name, phase)] = result["status"] == "valid" and result.get("graph_capture", "ok") == "ok"
        emit(event="result", backend=name, phase=phase, **result)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    emit(event="done", peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_gpu_mem_mb=peak)


if __name__ == "__main__":
    main()
