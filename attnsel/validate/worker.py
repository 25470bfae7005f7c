"""Validation worker: the entry point of the spawned process (``python -m attnsel.validate.worker``).

Reads one JSON job from stdin: ``{"spec", "device", "tasks": [{"backend", "phase"}], "measure", "mode",
"parent_pid"}``; writes JSON lines (events) to the protocol descriptor: ``ready`` once plugins are loaded and the
device computes correctly; per validation case ``case`` (building it) or ``case_error``; per task ``start`` then
``result``; ``done`` at the end. A task whose backend is ``timing.TIMING_TASK`` ("@timing") times the
phase's candidates interleaved over the bucket grid; its candidates come from ``measure``: ``{phase: {"backends":
[names in priority order], "vouched": [names valid in the parent's cache], "budget_s": seconds}}``. In mode
"graph" every valid candidate is also captured in a CUDA graph and replayed ("graph_capture": "ok" or a reason).

Trust: a result carries ``"fault"`` ("raised", "oom" or "unhealthy") when the process may be damaged: the candidate
raised, ran out of memory (or the health probe after it did: the machine's memory, not a verdict), or left the
process unable to compute (``probe`` after every candidate: a broken CUDA context fails every later call). After a
fault the worker stops (``done`` with ``stopped``) and the parent starts a fresh one for the rest, so every
candidate runs in a process that computed correctly just before it.
File descriptor 1 is pointed at stderr first, so that C/CUDA code printing to stdout cannot corrupt the protocol;
the parent captures stderr and quotes its tail when the worker dies. The worker dies with its parent (Linux).
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import math
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
from . import cases, graph_replay, timing

log = logging.getLogger("attnsel.worker")
PR_SET_PDEATHSIG = 1
START_FAILED = 3  # exit code when the device cannot compute before any candidate ran


def is_oom(exc: BaseException | str) -> bool:
    """A CUDA (or host) out-of-memory error: a machine condition, not a verdict on the backend."""
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return ("out of memory" in text.lower() or "MemoryError" in text  # OutOfMemoryError too (a probe's reason)
            or "can't allocate memory" in text)  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory"


def probe(device: torch.device) -> str | None:
    """None if this process still computes correctly on ``device`` (a small attention through SDPA against
    matmul + softmax, synchronised); else what went wrong. A broken CUDA context fails here."""
    try:
        x = (torch.arange(64, dtype=torch.float32, device=device).reshape(1, 2, 4, 8) % 7) / 7
        out = torch.nn.functional.scaled_dot_product_attention(x, x, x)
        ref = torch.softmax(x @ x.transpose(-1, -2) / 8**0.5, dim=-1) @ x
        timing._sync(device)
        err = (out - ref).abs().max().item()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if not err <= 1e-2:  # a broken context raises or gives garbage; TF32 left on by a library is no fault
        return f"a small SDPA differs from matmul + softmax by {err:.3g}"
    return None


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when the parent dies (Linux), whatever kills the parent."""
    if not sys.platform.startswith("linux") or not parent_pid:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.warning("prctl unavailable (%s): the worker may outlive a killed parent", exc)
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _fault(exc: BaseException) -> str:
    return "oom" if is_oom(exc) else "raised"


def validate_one(name: str, phase: str, spec: AttentionSpec, device: torch.device, phase_cases: list,
                 do_measure: bool, mode: str) -> dict:
    """One candidate on the phase's cases in order (the ragged case first, then a batch of one sequence): the first
    that fails decides, its reason naming the case; the result's error fields are the first case's."""
    backend = backends.get(name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    main, *more = phase_cases
    try:
        out = cases.run_case(backend, spec, main)
        timing._sync(device)
        result = cases.check_output(spec, out, main)
        for extra in more if result["status"] == "valid" else []:  # e.g. a batch of one sequence
            out = cases.run_case(backend, spec, extra)
            timing._sync(device)
            checked = cases.check_output(spec, out, extra)
            if checked["status"] != "valid":
                result = {**checked, "reason": f"on {extra.describe()}: {checked['reason']}"}
                break
    except Exception as exc:
        log.error("%s %s raised:\n%s", name, phase, traceback.format_exc())
        result = {"status": "rejected", "reason": f"raised {type(exc).__name__}: {exc}", "fault": _fault(exc)}
    result["time_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        result["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if result["status"] == "valid" and mode == "graph":
        result.update(graph_replay.check(backend, spec, phase, device))
        if is_oom(result["graph_capture"]):
            result["fault"] = "oom"
    return result


def time_phase(phase: str, spec: AttentionSpec, device: torch.device, job: dict, outcomes: dict,
               unspent_s: float = 0.0) -> dict:
    """The TIMING_TASK of a phase: time its candidates interleaved over the bucket grid (timing.measure). Times the
    candidates of job["measure"][phase]["backends"] that passed validation in this process or that the parent
    vouches for (valid in its cache); a result {"status": "timed", "measured": ...} or "rejected" with a reason.
    ``unspent_s``: what earlier phases of this job left of their time budgets, added to this phase's."""
    order = job["measure"][phase]
    vouched = set(order.get("vouched", ()))
    names = [n for n in order["backends"] if outcomes.get((n, phase), n in vouched)]
    budget = order.get("budget_s")
    if budget is not None:
        budget = min(budget + unspent_s, order.get("max_budget_s", math.inf))
    t0 = time.perf_counter()
    try:
        measured = timing.measure(spec, phase, names, device, job.get("mode", "eager"), budget,
                                  max_budget_s=order.get("max_budget_s"))
    except Exception as exc:
        log.error("timing %s raised:\n%s", phase, traceback.format_exc())
        return {"status": "rejected", "reason": f"timing raised {type(exc).__name__}: {exc}",
                "time_s": time.perf_counter() - t0, "fault": _fault(exc)}
    counted = measured.get("counted_s", measured["wall_s"])  # what the budget counted (timing.measure)
    result = {"status": "timed", "reason": "", "measured": measured, "time_s": time.perf_counter() - t0,
              "unspent_s": max(0.0, budget - counted) if budget is not None else 0.0}
    errors = [e for b in measured.get("buckets", []) for e in b.get("errors", {}).values()]
    if any(is_oom(e) for e in errors):
        result["fault"] = "oom"
        result["reason"] = f"out of memory while timing: {next(e for e in errors if is_oom(e))}"
    elif errors:
        result["fault"] = "raised"
    return result


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    faulthandler.enable()  # a crash in a kernel library leaves the Python stack in the stderr tail
    faulthandler.register(signal.SIGUSR1)  # the parent asks for the stack of a hung candidate before killing
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[worker] %(levelname)s %(message)s")
    job = json.load(sys.stdin)
    _die_with_parent(job.get("parent_pid"))

    def emit(**event) -> None:
        proto.write(json.dumps(event) + "\n")

    code = run(job, emit)
    if code:
        sys.exit(code)


def run(job: dict, emit) -> int:
    """The job's tasks in this process, each event handed to ``emit(**event)``; the exit code: START_FAILED when the
    device cannot compute before any candidate ran, else 0. main() gives it the process and the protocol line."""
    spec = AttentionSpec.from_dict(job["spec"])
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backends.registry()  # plugins load now: an import that kills the process is a failed start, blamed on nobody
    broken = probe(device)
    if broken:
        log.error("the device cannot compute before any candidate ran: %s", broken)
        return START_FAILED
    built: dict[str, object] = {}
    outcomes: dict[tuple[str, str], bool] = {}  # (backend, phase) -> usable, for the timing tasks
    stopped = None
    unspent_s = 0.0  # timing budget left by the phases timed so far (the next phase may use it)
    emit(event="ready", pid=os.getpid())
    for task in job["tasks"]:
        name, phase = task["backend"], task["phase"]
        if name != timing.TIMING_TASK and phase not in built:
            emit(event="case", phase=phase)
            try:
                built[phase] = [cases.make_case(spec, phase, device), cases.single_case(spec, phase, device)]
            except Exception as exc:  # attnsel's or the machine's fault, not the next candidate's
                log.error("building the %s validation case raised:\n%s", phase, traceback.format_exc())
                emit(event="case_error", phase=phase, reason=f"{type(exc).__name__}: {exc}", oom=is_oom(exc))
                stopped = f"could not build the {phase} validation case"
                break
        emit(event="start", backend=name, phase=phase)
        if name == timing.TIMING_TASK:
            result = time_phase(phase, spec, device, job, outcomes, unspent_s)
            unspent_s = result.pop("unspent_s", 0.0)
        else:
            result = validate_one(name, phase, spec, device, built[phase], job.get("measure", False),
                                  job.get("mode", "eager"))
        if not result.get("fault"):
            broken = probe(device)
            if broken and is_oom(broken):  # the machine's memory, not the candidate: retried, never cached
                log.error("after %s %s the health probe ran out of memory: %s", name, phase, broken)
                result.update(status="rejected", fault="oom",
                              reason=f"the health probe after it ran out of memory ({broken})")
            elif broken:
                log.error("after %s %s the process cannot compute: %s", name, phase, broken)
                what = "ran" if name != timing.TIMING_TASK else "timing ran"
                result.update(status="rejected", fault="unhealthy",
                              reason=f"the process could not compute after it {what} ({broken}): it left the "
                                     f"device or the process broken")
        if name != timing.TIMING_TASK:
            outcomes[(name, phase)] = result["status"] == "valid" and result.get("graph_capture", "ok") == "ok"
            if result["status"] != "valid":
                built.pop(phase, None)  # a rejected candidate may have written into the case: build it again
        emit(event="result", backend=name, phase=phase, **result)
        if result.get("fault"):
            stopped = f"{name} {phase}: {result['fault']}"
            break
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    emit(event="done", peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_gpu_mem_mb=peak,
         stopped=stopped)
    return 0


if __name__ == "__main__":
    main()
