"""Runs validation tasks in a spawned worker process: timeouts, deaths by signal, respawn for the rest."""
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

from ..spec import AttentionSpec

log = logging.getLogger(__name__)

TIMEOUT_ENV = "ATTNSEL_VALIDATION_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0  # FlashInfer JIT-compiles for ~2 minutes on a fresh machine
STARTUP_TIMEOUT_S = 300.0  # importing torch and initialising CUDA, before any candidate runs
HEARTBEAT_S = 15.0
SLOW_FIRST_USE = {"flashinfer": "first use JIT-compiles kernels: about 2 minutes on a fresh machine",
                  "flashinfer_cuda_cores": "first use JIT-compiles kernels: about 20 s on a fresh machine"}
STDERR_TAIL_LINES = 12
TIMING_TASK = "@timing"  # validate.timing.TIMING_TASK: a task that times a phase's candidates (not a backend)

spawn_count = 0  # process-wide number of workers spawned (tests assert on it)


def default_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


@dataclasses.dataclass
class RunStats:
    spawns: int = 0
    deaths: int = 0
    wall_s: float = 0.0
    peak_rss_mb: float | None = None
    peak_gpu_mem_mb: float | None = None


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            text = fh.read().decode(errors="replace")
    except OSError as exc:
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
    """One spawned worker process and a thread that turns its protocol lines into a queue."""

    def __init__(self, job: dict):
        global spawn_count
        self.stderr = tempfile.NamedTemporaryFile(prefix="attnsel-worker-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "attnsel.validate.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env, start_new_session=True)
        spawn_count += 1
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.proc.stdin.write(json.dumps(job).encode())
        self.proc.stdin.close()

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

    def kill(self, dump_stack: bool = False) -> None:
        try:
            if dump_stack:  # the worker's faulthandler writes every thread's stack to stderr
                os.kill(self.proc.pid, signal.SIGUSR1)
                time.sleep(1.0)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> str:
        """Wait for exit, remove the stderr file; returns the stderr tail."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        tail = _tail(self.stderr.name)
        self.stderr.close()
        os.unlink(self.stderr.name)
        return tail


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


def run_tasks(spec: AttentionSpec, tasks: list[tuple[str, str]], *, device: str, timeout: float | None = None,
              measure: bool = False, mode: str = "eager") -> tuple[dict[tuple[str, str], dict], RunStats]:
    """Validate (and, with measure, time) each (backend, phase) in a worker; a fresh worker after each death."""
    timeout = default_timeout() if timeout is None else timeout
    results: dict[tuple[str, str], dict] = {}
    stats = RunStats()
    remaining = list(tasks)
    t_start = time.monotonic()
    while remaining:
        job = {"spec": spec.to_dict(), "device": device, "measure": measure, "mode": mode,
               "tasks": [{"backend": b, "phase": p} for b, p in remaining]}
        worker = _Worker(job)
        stats.spawns += 1
        log.info("validation worker %d started (pid %d) for %d candidate(s)", stats.spawns, worker.proc.pid,
                 len(remaining))
        in_flight: tuple[str, str] | None = None
        timed_out: float | None = None
        try:
            while True:
                if in_flight is None:
                    event = _wait(worker, STARTUP_TIMEOUT_S if not results else timeout, "starting the worker")
                else:
                    what = (f"timing the {in_flight[1]} candidates" if in_flight[0] == TIMING_TASK
                            else f"validating {in_flight[0]} {in_flight[1]}")
                    event = _wait(worker, timeout, what)
                if event is None:
                    break
                kind = event.pop("event")
                if kind == "start":
                    in_flight = (event["backend"], event["phase"])
                    note = SLOW_FIRST_USE.get(in_flight[0], "")
                    if in_flight[0] == TIMING_TASK:
                        log.info("timing the %s candidates on the bucket grid", in_flight[1])
                    else:
                        log.info("validating %s %s%s", in_flight[0], in_flight[1], f" ({note})" if note else "")
                elif kind == "result":
                    key = (event.pop("backend"), event.pop("phase"))
                    results[key] = event
                    remaining.remove(key)
                    in_flight = None
                    _log_result(key, event)
                elif kind == "done":
                    stats.peak_rss_mb = max(stats.peak_rss_mb or 0, event.get("peak_rss_mb") or 0)
                    if event.get("peak_gpu_mem_mb") is not None:
                        stats.peak_gpu_mem_mb = max(stats.peak_gpu_mem_mb or 0, event["peak_gpu_mem_mb"])
        except TimeoutError:
            timed_out = timeout if in_flight is not None else STARTUP_TIMEOUT_S
            worker.kill(dump_stack=True)
        tail = worker.close()
        if not remaining:
            break
        stats.deaths += 1
        cause = _death_reason(worker.proc.returncode, timed_out)
        if in_flight is None:
            # The worker died before starting any candidate: nothing to blame, and a respawn would die the same way.
            reason = f"validation worker failed before running a candidate: {cause}; stderr tail:\n{tail}"
            log.error("%s", reason)
            for key in remaining:
                results[key] = {"status": "rejected", "reason": reason, "time_s": 0.0}
            break
        reason = f"{cause} while running {in_flight[0]} {in_flight[1]}; stderr tail:\n{tail}"
        # A timeout may be a slow first JIT build that the next start finds done: not worth remembering.
        results[in_flight] = {"status": "rejected", "reason": reason, "time_s": None,
                              "transient": timed_out is not None}
        remaining.remove(in_flight)
        _log_result(in_flight, results[in_flight])
    for r in results.values():
        if r.get("peak_gpu_mem_mb") is not None:
            stats.peak_gpu_mem_mb = max(stats.peak_gpu_mem_mb or 0, r["peak_gpu_mem_mb"])
    stats.wall_s = time.monotonic() - t_start
    return results, stats


def _log_result(key: tuple[str, str], result: dict) -> None:
    name, phase = key
    if result["status"] == "timed":
        measured = result["measured"]
        log.info("  timed %s on %d bucket(s) in %.1f s", phase, len(measured["buckets"]), measured["wall_s"])
    elif result["status"] == "valid":
        err = result.get("max_abs_err")
        log.info("  %s %s: valid (max abs err %.3g, tolerance %.3g, %.1f s)", name, phase, err,
                 result.get("tolerance", float("nan")), result.get("time_s") or 0.0)
        if result.get("timing_error"):
            log.warning("  %s %s: %s", name, phase, result["timing_error"])
    else:
        log.warning("  %s %s: rejected: %s", name, phase, result["reason"])
