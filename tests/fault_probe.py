"""A plugin backend after which the worker's health probe runs out of memory (as a CUDA allocation fails when
another process has taken the memory meanwhile): a machine condition, not a verdict on the candidate.

Backend "probe_oom": torch underneath, valid. ATTNSEL_TEST_PROBE_OOM=N: in the first N workers that run it (counted
in the file ATTNSEL_TEST_PROBE_OOM_COUNT), the next health probe (attnsel.validate.worker.probe) raises
torch.OutOfMemoryError from its SDPA call; every other SDPA call, the candidate's own included, runs as usual.
"""
import os
import sys
from pathlib import Path

import torch

from tests.fault_backends import Wrapped

PROBE_OOM = "CUDA out of memory. Tried to allocate 20.00 MiB (simulated: another process took the memory)"


def _in_probe(frame) -> bool:
    while frame is not None:
        code = frame.f_code
        if code.co_name == "probe" and code.co_filename.endswith(os.path.join("validate", "worker.py")):
            return True
        frame = frame.f_back
    return False


class _ProbeOom(Wrapped):
    def __init__(self, name: str):
        super().__init__(name, after=self._arm)
        self.armed = False  # once per process

    def _arm(self, *inputs) -> None:
        counter = Path(os.environ["ATTNSEL_TEST_PROBE_OOM_COUNT"])
        done = int(counter.read_text()) if counter.exists() else 0
        if self.armed or done >= int(os.environ["ATTNSEL_TEST_PROBE_OOM"]):
            return
        self.armed = True
        counter.write_text(str(done + 1))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def once(*args, **kwargs):
            if not _in_probe(sys._getframe(1)):
                return sdpa(*args, **kwargs)
            torch.nn.functional.scaled_dot_product_attention = sdpa
            raise torch.OutOfMemoryError(PROBE_OOM)

        torch.nn.functional.scaled_dot_product_attention = once


BACKENDS = [_ProbeOom("probe_oom")]
