"""Test plugin backends with real faults, each in one phase; the other phase runs the torch backend.

Loaded through ATTNSEL_BACKENDS="tests.fault_backends:ALL", exactly like a user's plugin.

"sticky" and "poison" break the process the way a CUDA kernel fault breaks a CUDA context: every later attention
call in the same process raises (SDPA is replaced by a function that raises, in this process only). "sticky" raises
itself; "poison" returns correct outputs and breaks the process after its last validation run (two cases, each plan
run twice), as an asynchronous fault that surfaces only after the candidate is done would: the health probe must
catch it.
"""
import ctypes
import importlib
import itertools
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F

from attnsel.backends.torch_sdpa import BACKEND as TORCH

VALIDATION_RUNS = 4  # runs of one candidate in the validation: two cases (ragged, one sequence), each plan run twice
FAULTS = ("import_error", "raise", "segfault", "abort", "hang", "nan", "wrong", "sticky", "poison")
BROKEN_CONTEXT = "CUDA error: an illegal memory access was encountered (simulated: this process is broken)"


def _broken(*args, **kwargs):
    raise RuntimeError(BROKEN_CONTEXT)


def break_process() -> None:
    """From now on every SDPA call in this process raises, like every call in a broken CUDA context."""
    F.scaled_dot_product_attention = _broken
    torch.nn.functional.scaled_dot_product_attention = _broken


def in_worker() -> bool:
    """True in a validation worker (python -m attnsel.validate.worker), False in the selecting process."""
    main = sys.modules.get("__main__")
    return getattr(getattr(main, "__spec__", None), "name", None) == "attnsel.validate.worker"


def _fault(kind: str, out_fn, calls=None):
    if kind == "import_error":
        importlib.import_module("attnsel_missing_kernel_lib")
    if kind == "raise":
        raise RuntimeError("injected failure")
    if kind == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV in this process
    if kind == "abort":
        os.abort()
    if kind == "hang":
        time.sleep(3600)
    if kind == "sticky":
        break_process()
        raise RuntimeError(BROKEN_CONTEXT)
    out = out_fn()
    if kind == "poison" and (calls is None or next(calls) >= VALIDATION_RUNS - 1):
        break_process()
    if kind == "nan":
        out[0, 0, 0] = float("nan")
    if kind == "wrong":
        out = torch.roll(out, shifts=1, dims=1)  # every head gets its neighbour's result
    return out


class FaultBackend:
    def __init__(self, fault: str, phase: str):
        self.name = f"{fault}_{phase}"
        self.fault, self.phase = fault, phase
        self.calls = itertools.count()  # runs of the faulty phase, over all plans (poison)
        self.version = "test"

    def unsupported(self, spec, phase):
        return None

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        run = TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k)
        if self.phase != "prefill":
            return run
        return lambda q, k, v: _fault(self.fault, lambda: run(q, k, v), self.calls)

    def plan_decode(self, spec, page_table, seq_lens):
        run = TORCH.plan_decode(spec, page_table, seq_lens)
        if self.phase != "decode":
            return run
        return lambda q, kc, vc: _fault(self.fault, lambda: run(q, kc, vc), self.calls)


ALL = [FaultBackend(f, p) for p in ("prefill", "decode") for f in FAULTS]


class Wrapped:
    """A valid backend (torch underneath) whose run first calls ``before(q)`` and then ``after(q, k, v)``."""

    def __init__(self, name: str, before=None, after=None, **attrs):
        self.name, self.before, self.after = name, before, after
        if not hasattr(type(self), "version"):
            self.version = "test"
        for key, value in attrs.items():
            setattr(self, key, value)

    def unsupported(self, spec, phase):
        return None

    def _wrap(self, run):
        def wrapped(*inputs):
            if self.before:
                self.before(*inputs)
            out = run(*inputs)
            if self.after:
                self.after(*inputs)
            return out
        return wrapped

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        return self._wrap(TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k))

    def plan_decode(self, spec, page_table, seq_lens):
        return self._wrap(TORCH.plan_decode(spec, page_table, seq_lens))


def _sleep_forever():
    time.sleep(3600)


def _start_thread(*inputs):
    """A library that leaves a non-daemon thread behind: the process cannot exit on its own."""
    threading.Thread(target=_sleep_forever, daemon=False).start()


def _oom(*inputs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (simulated)")


def _oom_while_timing(*inputs):
    if any(frame.f_code.co_filename.endswith(os.path.join("validate", "timing.py"))
           for frame in _frames(sys._getframe())):
        _oom()


def _frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _mutate(q, *rest):
    q.mul_(2)  # after computing its output: the output is right, the input is not


class _RaisingVersion(Wrapped):
    def version(self):
        raise RuntimeError("cannot read the kernel library's version")


class _RaisingNote(Wrapped):
    @property
    def first_use_note(self):
        raise RuntimeError("note unavailable")

    def report_extras(self):
        raise RuntimeError("extras unavailable")


def _device_assert(q, *rest):
    """A real CUDA kernel fault: an out-of-range gather trips a device-side assert; the context stays broken."""
    q.new_zeros(4)[torch.tensor([1 << 40], device=q.device)].sum().item()


CUDA_FAULT = Wrapped("cuda_fault", before=_device_assert)
NO_EXIT = Wrapped("noexit", after=_start_thread)
OOM = Wrapped("oom", before=_oom)
OOM_TIMING = Wrapped("oom_timing", before=_oom_while_timing)
MUTATE = Wrapped("mutate", after=_mutate)
BAD_VERSION = _RaisingVersion("bad_version")
BAD_NOTE = _RaisingNote("bad_note")


class _DeviceAware(Wrapped):
    """Records the device its availability check is asked about (the protocol's optional ``device`` keyword)."""

    seen: list = []

    def unsupported(self, spec, phase, device=None):
        self.seen.append(device)
        return None


DEVICE_AWARE = _DeviceAware("device_aware")


class _HangingCheck(Wrapped):
    """A plugin whose availability check never returns (a library import that deadlocks, a driver query that
    blocks): it runs in the selecting process, so it must cost a backend, not the selection."""

    def unsupported(self, spec, phase):
        time.sleep(3600)


HANGING_CHECK = _HangingCheck("hanging_check")
PREFILL = {b.name: b for b in ALL if b.phase == "prefill"}
WRONG_PREFILL = PREFILL["wrong_prefill"]
NAN_DECODE = next(b for b in ALL if b.name == "nan_decode")


def _killed(*inputs):
    """What the kernel's OOM killer does to a process that outgrows host memory."""
    os.kill(os.getpid(), signal.SIGKILL)


OOM_KILLED = Wrapped("oom_killed", before=_killed)
