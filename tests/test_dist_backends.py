"""Ranks whose installs differ: a backend of one name that is another version or source on another rank (another
node's image), or unavailable there. Rank 0 validates its own; every rank must agree on what the name means, or all
of them raise, instead of a rank silently serving code nobody validated."""
import json
import os

import torch.distributed as dist

from attnsel.spec import AttentionSpec
from tests.test_dist_agree import _run_ranks

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
    """Rank 1's "torch_copy" is other code (it doubles every output) that rank 0 never validated: AgreementError on
    both ranks, naming the backend and each rank's identity, instead of rank 1 serving it."""
    records = _run_ranks(_ranks, tmp_path)
    for rank, got in enumerate(records):
        assert got.get("error") == "AgreementError", (rank, got)
        assert "They differ in: backends" in got["message"], got["message"]
        assert "torch_copy" in got["message"] and "'other'" in got["message"], got["message"]
