"""The lengths a CUDA graph is planned and captured with, as engines do it.

An engine plans a graph's batch on dummy lengths (SGLang captures decode with every sequence 1 token long, a row of
extend holding its queries; vLLM's full graphs with every sequence max_model_len long), captures the run once per
batch size, and before each replay writes the step's lengths into the same tensor. A plan-time choice that depends
on the lengths (the Triton kernels' split count) is therefore made on the dummy lengths in an engine: rows of one
length, whatever it is, get the same split count within one (decode_splits keeps the splits such rows need at any
length), so the timing plans on the short ones. Timing a graph planned on a batch's own lengths would measure a plan
no engine ever replays: on a ragged batch, one with splits for its long rows where the engine's has none.
``capture_args`` gives the plan arguments to capture with and the step that writes the real lengths in.
"""
from __future__ import annotations

from typing import Callable

import torch


def capture_args(phase: str, plan_args: tuple) -> tuple[tuple, Callable[[], None]]:
    """(plan arguments with the lengths an engine captures with, fill): decode ``(page_table, seq_lens)`` gets
    seq_lens of ones (zero-length rows stay 0: CUDA-graph padding), extend ``(cu_seqlens_q, page_table, seq_lens,
    ...)`` gets each row's query count (at least 1, at most the row's length); both in a new tensor that ``fill()``
    overwrites in place with the real lengths, after capture and before the replays. Prefill plans as it is given
    (its metadata are the batch's own offsets in both cases)."""
    if phase not in ("decode", "extend"):
        return plan_args, lambda: None
    at = 1 if phase == "decode" else 2
    real = plan_args[at]
    if not isinstance(real, torch.Tensor):
        raise TypeError(f"{phase} plan arguments: seq_lens (argument {at}) must be a tensor, got {type(real).__name__}")
    if phase == "decode":
        dummy = real.clamp(max=1)
    else:
        cu_q = plan_args[0]
        queries = (cu_q[1:] - cu_q[:-1]).to(real.dtype)
        # never past the real length: the table holds pages for the real tokens only (a row may have more queries
        # than keys, and a row of no keys may have queries)
        dummy = torch.minimum(queries.clamp(min=1), real)
    dummy = dummy.contiguous()

    def fill() -> None:
        dummy.copy_(real)

    return (*plan_args[:at], dummy, *plan_args[at + 1:]), fill
