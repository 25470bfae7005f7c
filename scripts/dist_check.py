"""Multi-GPU agreement check (issue: all ranks agree over NCCL). Run with torchrun, one process per GPU:

    torchrun --nproc_per_node=2 scripts/dist_check.py OUT.json

Rank 0 validates and selects; every rank must receive the same Selection; only rank 0 spawns a worker; a second
(warm) call must hit the cache; ranks that ask for different specs (rank 0 a sliding-window one) must all raise
AgreementError naming both. Writes every rank's view to OUT.json (rank 0) and exits non-zero on disagreement.
"""
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from attnsel import AttentionSpec, select
from attnsel.dist import AgreementError
from attnsel.validate import runner

# NVLink multicast stays off (device README): set here too in case the launcher's environment lacks it.
for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)
local_rank = int(os.environ["LOCAL_RANK"])
cuda = torch.cuda.is_available()  # without CUDA: gloo on the CPU, a dry run of this script
if cuda:
    torch.cuda.set_device(local_rank)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = AttentionSpec.from_hf_config(os.path.join(root, "examples", "configs", "llama-3-8b.json"))
views = []
for attempt in ("cold", "warm"):
    sel = select(spec)
    views.append({"rank": rank, "attempt": attempt, "prefill": sel.prefill, "decode": sel.decode, "cache": sel.cache,
                  "spawned_here": runner.spawn_count, "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu",
                  "backend": dist.get_backend()})
asked = dataclasses.replace(spec, sliding_window=4096) if rank == 0 else spec
try:
    select(asked)
    mismatch = "no error"
except AgreementError as exc:
    mismatch = str(exc)
views.append({"rank": rank, "attempt": "mismatch", "error": mismatch})
gathered = [None] * world
dist.all_gather_object(gathered, views)
if rank == 0:
    flat = [v for rank_views in gathered for v in rank_views]
    mismatches = [v.pop("error") for v in flat if v["attempt"] == "mismatch"]
    flat = [v for v in flat if v["attempt"] != "mismatch"]
    agree = len({(v["attempt"], v["prefill"], v["decode"]) for v in flat}) == 2
    mismatch_raised = all("sliding_window=4096" in m and "sliding_window=None" in m for m in mismatches)
    only_rank0 = all(v["spawned_here"] == 0 for v in flat if v["rank"] != 0)
    warm_hit = all(v["cache"] == "hit" for v in flat if v["attempt"] == "warm")
    result = {"world": world, "agree": agree, "only_rank0_spawned": only_rank0, "warm_hit": warm_hit,
              "mismatch_raised_everywhere": mismatch_raised, "views": flat, "mismatch_errors": mismatches}
    print(json.dumps(result, indent=1))
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)
    ok = agree and only_rank0 and warm_hit and mismatch_raised
else:
    ok = True
dist.destroy_process_group()
sys.exit(0 if ok else 1)
