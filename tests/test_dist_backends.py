"""Ranks whose installs differ: a backend of one name that is another version or source on another rank (another
node's image), or unavailable there. Rank 0 validates its own; every rank must agree on what the name means, or all
of them raise, instead of a rank silently serving code nobody validated."""
import json
import os
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from attnsel.spec import AttentionSpec

SPEC = AttentionSpec(4, 2, 64, "fp16")
DEADLINE_S = 90
PLUGIN = {0: "tests.fixtures.fault_numerics:TORCH_COPY", 1: "tests.fixtures.dist_plugins:OTHER_TORCH_COPY"}


def _ranks(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime

    os.environ["ATTNSEL_BACKENDS"] = PLUGIN[rank]  # this rank's install
    os.environ["ATTNSEL_DIST_TIMEOUT_S"] = "10"
    os.environ["ATTNSEL_CACHE_DIR"] = os.path.join(out_dir, f"cache{rank}")
    from attnsel import select

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))
    try:
        sel = select(SPEC, prefill="torch_copy", decode="torch_copy", extend="torch", policy="priority")
        result = {"value": {"prefill": sel.prefill, "decode": sel.decode}}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def test_a_backend_that_differs_between_ranks_raises_on_every_rank(tmp_path):
    """Was: both ranks got a Selection serving "torch_copy", rank 1 its own copy that rank 0 never validated (and
    that doubles every output). Now AgreementError on both, naming the backend and each rank's identity."""
    ctx = mp.spawn(_ranks, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the ranks hung: not done after {DEADLINE_S} s")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(records):
        assert got.get("error") == "AgreementError", (rank, got)
        assert "They differ in: backends" in got["message"], got["message"]
        assert "torch_copy" in got["message"] and "'other'" in got["message"], got["message"]
