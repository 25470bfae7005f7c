"""How fast the host launches work while eager buckets are timed: the probe and a phase's reference probe."""
from __future__ import annotations

import functools
import math
import time

import torch

HOST_SLOW = 1.2  # eager: a bucket whose host probe ran this much slower than the phase's reference was timed on a
# slow host (the report counts them)
HOST_PROBE_CALLS = 32  # launches per run of the host probe, which takes the faster of two runs (well under a
# millisecond in all at a few us per launch)


def host_probe(device: torch.device) -> float | None:
    """How fast the host launches work right now: seconds per launch of a one-element add on ``device``, the least
    of two runs of HOST_PROBE_CALLS launches after a sync (the queue empty: launches do not wait on the GPU), and a
    sync after (the next timed sample starts on an empty queue). None off CUDA. Eager calls of small batches are
    bound by this host time (timing's module doc)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    x = _probe_tensor(index)
    torch.cuda.synchronize(index)
    best = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(HOST_PROBE_CALLS):
            x.add_(0)
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize(index)
    return best / HOST_PROBE_CALLS


@functools.lru_cache(maxsize=None)
def _probe_tensor(index: int) -> torch.Tensor:
    """The probe's one-element tensor on CUDA device ``index`` (kept: the probe must not allocate)."""
    return torch.zeros(1, device=torch.device("cuda", index))


def host_reference(probes_us: list[float]) -> float | None:
    """A phase's reference host probe: the lower decile of its buckets' probes (the least with fewer than 10), so
    that one bucket timed in a lucky moment does not make every other look slow. None without probes."""
    if not probes_us:
        return None
    ordered = sorted(probes_us)
    return ordered[(len(ordered) - 1) // 10] if len(ordered) >= 10 else ordered[0]
