"""Test plugin backends with real faults, each in one phase; the other phase runs the torch backend.

Loaded through ATTNSEL_BACKENDS="tests.fault_backends:ALL", exactly like a user's plugin.
"""
import ctypes
import importlib
import os
import time

import torch

from attnsel.backends.torch_sdpa import BACKEND as TORCH

FAULTS = ("import_error", "raise", "segfault", "abort", "hang", "nan", "wrong")


def _fault(kind: str, out_fn):
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
    out = out_fn()
    if kind == "nan":
        out[0, 0, 0] = float("nan")
    if kind == "wrong":
        out = torch.roll(out, shifts=1, dims=1)  # every head gets its neighbour's result
    return out


class FaultBackend:
    def __init__(self, fault: str, phase: str):
        self.name = f"{fault}_{phase}"
        self.fault, self.phase = fault, phase
        self.version = "test"

    def unsupported(self, spec, phase):
        return None

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        run = TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k)
        if self.phase != "prefill":
            return run
        return lambda q, k, v: _fault(self.fault, lambda: run(q, k, v))

    def plan_decode(self, spec, page_table, seq_lens):
        run = TORCH.plan_decode(spec, page_table, seq_lens)
        if self.phase != "decode":
            return run
        return lambda q, kc, vc: _fault(self.fault, lambda: run(q, kc, vc))


ALL = [FaultBackend(f, p) for p in ("prefill", "decode") for f in FAULTS]
PREFILL = {b.name: b for b in ALL if b.phase == "prefill"}
WRONG_PREFILL = PREFILL["wrong_prefill"]
NAN_DECODE = next(b for b in ALL if b.name == "nan_decode")
