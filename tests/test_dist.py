"""Distributed agreement: two gloo ranks on CPU; rank 0 validates, both get the same Selection."""
import json
import os

import torch.distributed as dist
import torch.multiprocessing as mp

from attnsel.spec import AttentionSpec


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from attnsel import select
    from attnsel.validate import runner

    results = []
    for _ in range(2):  # cold, then warm
        sel = select(AttentionSpec(4, 2, 64, "fp16"), policy="priority")
        results.append({"prefill": sel.prefill, "decode": sel.decode, "cache": sel.cache,
                        "spawned": runner.spawn_count})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()


def test_two_gloo_ranks_agree(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert [(r["prefill"], r["decode"]) for r in r0] == [(r["prefill"], r["decode"]) for r in r1]
    assert r0[0]["spawned"] == 1 and r1[0]["spawned"] == 0  # only rank 0 spawned a worker
    assert r0[1]["spawned"] == 1 and r1[1]["spawned"] == 0  # the warm run spawned nothing
    assert [r["cache"] for r in r1] == ["miss", "hit"]  # rank 1 got rank 0's cache state
