"""Runs validation tasks in spawned worker processes (validate/worker.py) and decides whom each failure blames.

- A candidate that raises, crashes the worker or hangs while it runs is rejected (a crash or an exception is a
  verdict; a timeout is reported as transient: it may be a slow first JIT build).
- Anything about the machine is reported, retried once in a fresh worker, and if it happens again the affected
  tasks get ``"transient": True`` (the selection does not cache those): the worker fails to start (exits or hangs
  before "ready", or the device cannot compute), dies between candidates, cannot build a validation case, or a
  candidate (or the health probe after it) runs out of memory.
- After any fault the worker is not trusted: it stops and the rest runs in a fresh worker (worker.py, "Trust").
- A worker that does not exit after "done" is killed DONE_GRACE_S later. On every exit path, KeyboardInterrupt
  included, the worker's process group is killed and reaped; its stderr log is unlinked as soon as it is opened,
  so no file is left behind whatever happens to the parent (and the worker dies with the parent, Linux).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .. import backends, settings
from ..device import resolve
from ..spec import AttentionSpec
from . import TIMING_TASK

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # importing torch and initialising CUDA, before any candidate runs
HEARTBEAT_S = 15.0
DONE_GRACE_S = 5.0  # after "done", how long a worker may take to exit before it is killed
RETRIES = 1  # fresh-worker retries of a machine fault (failed start, case build, out of memory)
STDERR_TAIL_LINES = 12
NOT_CACHED = "a machine condition, not the backend's fault: reported, not cached"

spawn_count = 0  # process-wide number of workers spawned (tests assert on it)


def default_timeout() -> float:
    """$ATTNSEL_VALIDATION_TIMEOUT: seconds per candidate (FlashInfer JIT-compiles for minutes on a fresh machine)."""
    return settings.read("validation_timeout_s")


@dataclasses.dataclass
class RunStats:
    spawns: int = 0
    deaths: int = 0
    restarts: int = 0  # fresh workers after a fault the worker survived (a raise, out of memory, a case error)
    wall_s: float = 0.0
    peak_rss_mb: float | None = None
    peak_gpu_mem_mb: float | None = None


def _tail(fh) -> str:
    try:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 8192))
        text = fh.read().decode(errors="replace")
    except (OSError, ValueError) as exc:
        return f"(stderr unreadable: {exc})"
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("Extension modules:")]
    return "\n".join(lines[-STDERR_TAIL_LINES:]) or "(empty)"


def _death_reason(returncode: int | None, killed_for_timeout: float | None) -> str:
    if killed_for_timeout is not None:
        return f"timed out after {killed_for_timeout:.0f} s (worker killed)"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"worker died with {name}"
    return f"worker exited with code {returncode} without a result"


class _Worker:
    """One spawned worker process and a thread that turns its protocol lines into a queue. A context manager: on
    leaving it (normally or by an exception) the worker's process group is killed and reaped and the log closed."""

    def __init__(self, job: dict):
        global spawn_count
        fd, path = tempfile.mkstemp(prefix="attnsel-worker-", suffix=".log")
        try:
            self.log = open(path, "rb")  # the parent's own offset: reading the tail never moves the worker's
        finally:
            os.unlink(path)  # nameless from now on: nothing is left behind, whatever ends the parent
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "attnsel.validate.worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=fd, env=env, start_new_session=True)
        except BaseException:
            self.log.close()
            raise
        finally:
            os.close(fd)
        spawn_count += 1
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.proc.stdin.write(json.dumps(job).encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            log.warning("validation worker %d exited before reading its job", self.proc.pid)

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                log.warning("worker wrote a line that is not protocol JSON: %r", line[:200])
        self.events.put(None)  # EOF

    def next_event(self, timeout: float):
        """The next event, None at EOF, or raises queue.Empty after timeout seconds."""
        return self.events.get(timeout=timeout)

    def stop(self, grace: float = 0.0, dump_stack: bool = False) -> None:
        """Give the worker ``grace`` seconds to exit, then kill its process group (what it started too) and reap it."""
        if grace > 0:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("validation worker %d did not exit %.0f s after it was done (a thread that never ends?):"
                            " killing it", self.proc.pid, grace)
        try:
            if dump_stack and self.proc.poll() is None:  # the worker's faulthandler writes every thread's stack
                os.kill(self.proc.pid, signal.SIGUSR1)
                time.sleep(1.0)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def tail(self) -> str:
        return _tail(self.log)


def _wait(worker: _Worker, timeout: float, what: str):
    """Next event within timeout, logging a heartbeat so that a long JIT compile never looks like a hang."""
    start = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            raise TimeoutError
        try:
            return worker.next_event(min(left, HEARTBEAT_S))
        except queue.Empty:
            elapsed = time.monotonic() - start
            if elapsed < timeout:
                log.info("  ... still %s (%.0f s of %.0f s timeout)", what, elapsed, timeout)


@dataclasses.dataclass
class _Outcome:
    """What one worker did before it ended."""

    ready: bool = False
    done: bool = False
    stopped: str | None = None  # why a worker that survived a fault stopped early
    building: str | None = None  # the phase whose validation case was being built
    case_error: dict | None = None
    in_flight: tuple[str, str] | None = None
    timed_out: float | None = None


def _note(name: str) -> str:
    try:
        return backends.first_use_note(backends.get(name))
    except backends.UnknownBackendError:
        return ""


def _doing(out: _Outcome) -> str:
    if out.in_flight is not None:
        name, phase = out.in_flight
        if name == TIMING_TASK:
            return f"timing the {phase} candidates"
        return f"validating {name} {phase}"
    if out.building is not None:
        return f"building the {out.building} validation case"
    return "waiting for the worker"


class _Tasks:
    """The results so far and what is left; retries of out-of-memory results."""

    def __init__(self, tasks: list[tuple[str, str]]):
        self.results: dict[tuple[str, str], dict] = {}
        self.remaining = list(tasks)
        self.retried: set[tuple[str, str]] = set()

    def record(self, key: tuple[str, str], result: dict) -> None:
        fault = result.pop("fault", None)
        if fault == "oom" and key not in self.retried:
            self.retried.add(key)
            log.warning("  %s %s: out of memory (%s); retrying once in a fresh worker", key[0], key[1],
                        result.get("reason") or "while timing")
            return
        if fault == "oom":
            result["transient"] = True
            result["reason"] = f"{result.get('reason') or 'out of memory'} (out of memory in two workers: {NOT_CACHED})"
            if isinstance(result.get("measured"), dict):
                result["measured"]["transient"] = True
        if fault == "unhealthy" and key[0] == TIMING_TASK:  # which candidate broke it is unknown
            result["transient"] = True
        self.results[key] = result
        self.remaining.remove(key)
        _log_result(key, result)

    def reject(self, keys: list[tuple[str, str]], reason: str) -> None:
        """Transient rejections: reported, never cached."""
        for key in keys:
            self.results[key] = {"status": "rejected", "reason": reason, "time_s": None, "transient": True}
            self.remaining.remove(key)
            _log_result(key, self.results[key])

    def measure_job(self, measure):
        """The timing part of a job: candidates validated by earlier workers of this run are vouched for."""
        if not isinstance(measure, dict):
            return measure
        job = {}
        for phase, order in measure.items():
            valid = [n for (n, p), r in self.results.items() if p == phase and n != TIMING_TASK
                     and r.get("status") == "valid" and r.get("graph_capture", "ok") == "ok"]
            job[phase] = {**order, "vouched": list(dict.fromkeys([*order.get("vouched", ()), *valid]))}
        return job


def _drive(worker: _Worker, timeout: float, tasks: _Tasks, stats: RunStats) -> _Outcome:
    """Read the worker's events until it is done, dies (EOF) or times out."""
    out = _Outcome()
    try:
        while True:
            if not out.ready:
                event = _wait(worker, STARTUP_TIMEOUT_S, "starting the worker")
            else:
                event = _wait(worker, timeout, _doing(out))
            if event is None:
                return out
            kind = event.pop("event")
            if kind == "ready":
                out.ready = True
            elif kind == "case":
                out.building = event["phase"]
            elif kind == "case_error":
                out.case_error = event
            elif kind == "start":
                out.building = None
                out.in_flight = (event["backend"], event["phase"])
                if out.in_flight[0] == TIMING_TASK:
                    log.info("timing the %s candidates on the bucket grid", out.in_flight[1])
                else:
                    note = _note(out.in_flight[0])
                    log.info("validating %s %s%s", *out.in_flight, f" ({note})" if note else "")
            elif kind == "result":
                key = (event.pop("backend"), event.pop("phase"))
                out.in_flight = None
                tasks.record(key, event)
            elif kind == "done":
                out.done, out.stopped = True, event.get("stopped")
                stats.peak_rss_mb = max(stats.peak_rss_mb or 0, event.get("peak_rss_mb") or 0)
                if event.get("peak_gpu_mem_mb") is not None:
                    stats.peak_gpu_mem_mb = max(stats.peak_gpu_mem_mb or 0, event["peak_gpu_mem_mb"])
                return out  # stop waiting: a worker that cannot exit (a thread that never ends) is killed below
    except TimeoutError:
        out.timed_out = timeout if out.ready else STARTUP_TIMEOUT_S
        return out


def run_tasks(spec: AttentionSpec, tasks: list[tuple[str, str]], *, device: str, timeout: float | None = None,
              measure=False, mode: str = "eager") -> tuple[dict[tuple[str, str], dict], RunStats]:
    """Validate (and time, with ``measure``) each (backend, phase) in workers; a fresh worker after every fault.

    Returns a result per task: the worker's result, or a rejection naming the failure; results that say nothing
    about the backend (machine faults, timeouts) carry ``"transient": True``."""
    timeout = default_timeout() if timeout is None else timeout
    device = resolve(device)
    state = _Tasks(tasks)
    stats = RunStats()
    machine_faults = 0
    case_faults: dict[str, int] = {}
    t_start = time.monotonic()
    while state.remaining:
        job = {"spec": spec.to_dict(), "device": device, "measure": state.measure_job(measure), "mode": mode,
               "parent_pid": os.getpid(), "tasks": [{"backend": b, "phase": p} for b, p in state.remaining]}
        progress = (len(state.results), len(state.retried))
        with _Worker(job) as worker:
            stats.spawns += 1
            log.info("validation worker %d started (pid %d) for %d task(s)", stats.spawns, worker.proc.pid,
                     len(state.remaining))
            out = _drive(worker, timeout, state, stats)
            worker.stop(grace=DONE_GRACE_S if out.done else 0.0, dump_stack=out.timed_out is not None)
            tail = worker.tail()
        if not state.remaining:
            break
        if out.case_error is not None:
            phase = out.case_error["phase"]
            case_faults[phase] = case_faults.get(phase, 0) + 1
            reason = (f"could not build the {phase} validation case: {out.case_error['reason']} (an attnsel or "
                      f"machine fault, not the backend's)")
            if case_faults[phase] <= RETRIES:
                log.warning("%s; retrying once in a fresh worker", reason)
            else:
                state.reject([k for k in state.remaining if k[1] == phase], f"{reason}; twice: {NOT_CACHED}")
            stats.restarts += 1
            continue
        if out.done and (len(state.results), len(state.retried)) != progress:
            log.info("validation worker stopped after a fault (%s): the rest runs in a fresh worker", out.stopped)
            stats.restarts += 1
            continue
        if out.in_flight is not None and not out.done:
            stats.deaths += 1
            cause = _death_reason(worker.proc.returncode, out.timed_out)
            name, phase = out.in_flight
            what = f"timing the {phase} candidates" if name == TIMING_TASK else f"running {name} {phase}"
            # A timeout may be a slow first JIT build that the next start finds done, and SIGKILL/SIGTERM come from
            # outside (the kernel's OOM killer, an operator): about the machine, not worth remembering.
            killed = worker.proc.returncode in (-signal.SIGKILL, -signal.SIGTERM)
            state.results[out.in_flight] = {"status": "rejected", "time_s": None,
                                            "reason": f"{cause} while {what}; stderr tail:\n{tail}",
                                            "transient": out.timed_out is not None or killed}
            state.remaining.remove(out.in_flight)
            _log_result(out.in_flight, state.results[out.in_flight])
            continue
        # Nothing to blame: a failed start, a death between candidates or while building a case.
        if not out.done:
            stats.deaths += 1
        cause = "finished without running its tasks" if out.done else _death_reason(worker.proc.returncode,
                                                                                   out.timed_out)
        where = "before it was ready" if not out.ready else (
            f"while building the {out.building} validation case" if out.building else "between candidates")
        reason = f"validation worker failed {where}: {cause}; stderr tail:\n{tail}"
        machine_faults += 1
        if machine_faults <= RETRIES:
            log.warning("%s\nretrying once in a fresh worker", reason)
            continue
        log.error("%s", reason)
        state.reject(list(state.remaining), f"{reason}\n(happened in {machine_faults} workers: {NOT_CACHED})")
    for r in state.results.values():
        if r.get("peak_gpu_mem_mb") is not None:
            stats.peak_gpu_mem_mb = max(stats.peak_gpu_mem_mb or 0, r["peak_gpu_mem_mb"])
    stats.wall_s = time.monotonic() - t_start
    return state.results, stats


def _log_result(key: tuple[str, str], result: dict) -> None:
    name, phase = key
    if result["status"] == "timed":
        measured = result["measured"]
        steps = measured.get("steps_s") or {}
        counted = measured.get("counted_s")
        log.info("  timed %s on %d bucket(s) in %.1f s%s%s", phase, len(measured["buckets"]), measured["wall_s"],
                 f", {counted:.1f} s of it against the budget" if counted is not None else "",
                 f" ({', '.join(f'{step} {s:.1f} s' for step, s in steps.items())})" if steps else "")
    elif result["status"] == "valid":
        err = result.get("max_abs_err")
        log.info("  %s %s: valid (max abs err %.3g, tolerance %.3g, %.1f s)", name, phase, err,
                 result.get("tolerance", float("nan")), result.get("time_s") or 0.0)
        if result.get("timing_error"):
            log.warning("  %s %s: %s", name, phase, result["timing_error"])
    else:
        log.warning("  %s %s: rejected: %s", name, phase, result["reason"])
