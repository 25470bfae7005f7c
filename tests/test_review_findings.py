"""Adversarial review findings: each test is a hole found in the change under review."""
import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 60


class _TwoArgError(RuntimeError):
    """An exception whose constructor takes two arguments but passes one message up (a plugin's, a library's): its
    pickle does not load again."""

    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


class _HoldsLock(RuntimeError):
    """An exception carrying an unpicklable attribute."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def _agree_ranks(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime

    from attnsel.dist import agree

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))
    results = {}
    for name, exc_type in (("two_args", lambda: _TwoArgError("backend x", "kernel crashed")),
                           ("lock", lambda: _HoldsLock("backend y: kernel crashed"))):
        def decide():
            raise exc_type()
        start = time.monotonic()
        try:
            agree(decide, "q", timeout=10, decide_timeout=10)
            results[name] = {"value": "no error"}
        except Exception as exc:
            results[name] = {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - start}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()


def test_rank0_errors_that_do_not_pickle_reach_every_rank_with_their_message(tmp_path):
    """rank 0's decide raises an exception that cannot make the trip (its pickle does not load, or does not dump):
    every rank must still raise promptly with rank 0's message, not wait out decide_timeout or blame the others."""
    ctx = mp.spawn(_agree_ranks, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the ranks hung")
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for name, text in (("lock", "kernel crashed"), ("two_args", "kernel crashed")):
        for rank in range(2):
            got = r[rank][name]
            assert "error" in got, (rank, name, got)
            assert text in got["message"], (rank, name, got)
            assert got["s"] < 8, (rank, name, got)
