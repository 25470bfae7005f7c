"""Distributed agreement: rank 0 decides, every rank receives the same result (torch.distributed broadcast)."""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")


def agree(decide: Callable[[], T]) -> T:
    """Run ``decide`` on rank 0 only and broadcast its result (or its error) to all ranks.

    Without an initialised process group (or with one rank) this is just ``decide()``. Errors are re-raised on
    every rank with rank 0's message, so that no rank goes on alone.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", decide())
        except Exception as exc:
            log.error("rank 0 failed to decide: %s", exc)
            payload[0] = ("error", exc)
    device = None
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dist.broadcast_object_list(payload, src=0, device=device)
    status, value = payload[0]
    if status == "error":
        raise value
    if dist.get_rank() != 0:
        log.info("rank %d received the selection from rank 0", dist.get_rank())
    return value
