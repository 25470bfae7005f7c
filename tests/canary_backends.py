"""A plugin backend for the canary tests: torch underneath, right for its first GOOD_CALLS runs in a process, then
wrong (1.0 added to every output value), as a kernel whose fault shows only after many requests.

Loaded through ATTNSEL_BACKENDS="tests.canary_backends:LATE", exactly like a user's plugin. The count is per process:
the validation worker's runs are its own, so the backend passes validation and goes wrong in the serving process.
"""
from attnsel.backends.torch_sdpa import BACKEND as TORCH

GOOD_CALLS = 50


class LateWrong:
    name = "late_wrong"
    version = "test"

    def __init__(self, good: int = GOOD_CALLS):
        self.good = good
        self.calls = 0  # runs in this process, both phases

    def unsupported(self, spec, phase):
        return None

    def _late(self, run):
        def late_run(*inputs, **kwargs):
            self.calls += 1
            out = run(*inputs, **kwargs)
            return out if self.calls <= self.good else out + 1.0
        return late_run

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        return self._late(TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k))

    def plan_decode(self, spec, page_table, seq_lens):
        return self._late(TORCH.plan_decode(spec, page_table, seq_lens))


LATE = [LateWrong()]
