"""Validation worker: the entry point of the spawned process (``python -m attnsel.validate.worker``).

Reads one JSON job from stdin: ``{"spec", "device", "tasks": [{"backend", "phase"}], "measure", "mode"}``; for each
task writes JSON lines to the protocol descriptor: ``{"event": "start", ...}`` then ``{"event": "result", ...}``,
and ``{"event": "done", ...}`` at the end. File descriptor 1 is pointed at stderr first, so that C/CUDA code printing
to stdout cannot corrupt the protocol; the parent captures stderr and quotes its tail when the worker dies.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import resource
import signal
import statistics
import sys
import time
import traceback

import torch

from .. import backends
from ..spec import AttentionSpec
from . import cases

log = logging.getLogger("attnsel.worker")
VALIDATION_WORKSPACE_MB = "32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_output(spec: AttentionSpec, out, case) -> dict:
    """Compare one output with the case's reference; the fields of a result."""
    if not isinstance(out, torch.Tensor) or out.shape != case.ref.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"status": "rejected", "reason": f"output shape {got}, expected {tuple(case.ref.shape)}"}
    tol = cases.tolerance(spec, case.sdpa_err)
    result = {"tolerance": tol, "sdpa_err": case.sdpa_err}
    bad = (~torch.isfinite(out.float())).sum().item()
    if bad:
        return {**result, "status": "rejected", "max_abs_err": None,
                "reason": f"{bad} of {out.numel()} output values are NaN or inf ({case.describe()})"}
    err = cases.max_abs_err(out, case.ref)
    result["max_abs_err"] = err
    if not err <= tol:
        return {**result, "status": "rejected",
                "reason": f"max abs error {err:.3g} exceeds tolerance {tol:.3g} (torch SDPA in {spec.dtype} errs "
                          f"{case.sdpa_err:.3g}; {case.describe()})"}
    return {**result, "status": "valid", "reason": ""}


def bench(fn, device: torch.device, target_s: float = 0.02, reps: int = 5) -> float:
    """Median seconds per call of fn, timed with CUDA events (host clock on CPU), after a warm-up."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    n = max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def as_graph(run, inputs, device: torch.device):
    """A CUDA graph replay of run(*inputs): what an engine running under CUDA graphs pays per call."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(*inputs)  # warm-up outside capture (lazy init, autotuning)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*inputs)
    return graph.replay


def measure(backend, spec: AttentionSpec, phase: str, device: torch.device, mode: str) -> dict:
    """Time the backend on the spec's workloads; score = geometric mean of the per-workload times."""
    os.environ.pop("ATTNSEL_FLASHINFER_WORKSPACE_MB", None)  # runtime-sized workspace for real batches
    timings = {}
    if phase == "prefill":
        loads = [cases.make_prefill_workload(spec, device, label, lens)
                 for label, lens in cases.prefill_workloads(spec, device)]
        plan = backend.plan_prefill
    else:
        loads = [cases.make_decode_workload(spec, device, label, b, ctx)
                 for label, b, ctx in cases.decode_workloads(spec, device)]
        plan = backend.plan_decode
    for load in loads:
        run = plan(spec, *load.plan_args)
        fn = as_graph(run, load.inputs, device) if mode == "graph" else (lambda r=run, i=load.inputs: r(*i))
        timings[load.label] = bench(fn, device) * 1e6
        del run, fn
    score = math.exp(sum(math.log(t) for t in timings.values()) / len(timings))
    return {"timings_us": timings, "score_us": score}


def validate_one(name: str, phase: str, spec: AttentionSpec, device: torch.device, case, do_measure: bool,
                 mode: str) -> dict:
    backend = backends.get(name)
    os.environ["ATTNSEL_FLASHINFER_WORKSPACE_MB"] = VALIDATION_WORKSPACE_MB
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        out = cases.run_case(backend, spec, case)
        _sync(device)
        result = check_output(spec, out, case)
    except Exception as exc:
        log.error("%s %s raised:\n%s", name, phase, traceback.format_exc())
        result = {"status": "rejected", "reason": f"raised {type(exc).__name__}: {exc}"}
    result["time_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        result["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if result["status"] == "valid" and do_measure:
        try:
            result.update(measure(backend, spec, phase, device, mode))
        except Exception as exc:
            log.error("%s %s timing failed:\n%s", name, phase, traceback.format_exc())
            result["timing_error"] = f"timing in {mode} mode failed: {type(exc).__name__}: {exc}"
    return result


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

    def emit(**event) -> None:
        proto.write(json.dumps(event) + "\n")

    emit(event="ready", pid=os.getpid())
    for task in job["tasks"]:
        name, phase = task["backend"], task["phase"]
        emit(event="start", backend=name, phase=phase)
        if phase not in built:
            built[phase] = cases.make_case(spec, phase, device)
        result = validate_one(name, phase, spec, device, built[phase], job.get("measure", False),
                              job.get("mode", "eager"))
        emit(event="result", backend=name, phase=phase, **result)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    emit(event="done", peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_gpu_mem_mb=peak)


if __name__ == "__main__":
    main()
