"""Support checks shared by the backends: the same sentence for the same limit, whichever backend states it.

Each helper returns a reason (str) or None; a backend's ``unsupported`` joins the non-None ones with ``joined``.
Also ``capturing``: whether a plan is being made during CUDA-graph capture (no host reads then), and
``live_int32``: the plan's view of an engine's metadata tensor that every run reads afresh (the CUDA-graph contract).
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from ..device import capability_reason  # noqa: F401  (one capability check, re-exported for the backends)
from ..spec import AttentionSpec

# Spec features a backend may or may not implement (AttentionSpec docstring); the keys backends name.
FEATURES = ("sliding_window", "softcap", "sinks", "kv_dtype", "non_causal")


def dtype_reason(spec: AttentionSpec, allowed: tuple[str, ...] = ("fp16", "bf16")) -> str | None:
    if spec.dtype in allowed:
        return None
    return f"dtype {spec.dtype} is not supported ({', '.join(allowed)})"




def spec_features(spec: AttentionSpec, phase: str) -> dict[str, str]:
    """The optional features this spec uses in this phase: key (FEATURES) -> words. kv_dtype is a matter of the
    phases that read the paged cache, decode and extend (prefill takes k/v in ``spec.dtype``)."""
    used = {}
    if spec.sliding_window is not None:
        used["sliding_window"] = f"sliding window ({spec.sliding_window} tokens)"
    if spec.softcap is not None:
        used["softcap"] = f"logit softcap ({spec.softcap:g})"
    if spec.sinks:
        used["sinks"] = "attention sinks"
    if spec.kv_dtype is not None and phase != "prefill":
        used["kv_dtype"] = f"{spec.kv_dtype} KV cache"
    if not spec.causal:
        used["non_causal"] = "non-causal attention"
    return used


def feature_reasons(spec: AttentionSpec, phase: str, supported: Collection[str],
                    why: dict[str, str] | None = None) -> list[str]:
    """One reason per feature the spec uses and the backend does not implement in this phase.

    ``supported``: the feature keys the backend implements; ``why``: an optional explanation per feature key
    (e.g. "this FA3 build was compiled without softcap").
    """
    why = why or {}
    reasons = []
    for key, words in spec_features(spec, phase).items():
        if key not in supported:
            reasons.append(f"{words}: not supported in {phase}" + (f" ({why[key]})" if key in why else ""))
    return reasons


def joined(reasons) -> str | None:
    """The non-empty reasons joined by '; ', or None when there are none."""
    text = "; ".join(r for r in reasons if r)
    return text or None


def capturing(t: torch.Tensor) -> bool:
    """Whether t is a CUDA tensor and a CUDA graph is being captured on the current stream (of the current device:
    torch.cuda.graph makes the capturing device current): a plan made now must not read device tensors on the host
    (no sync is allowed during capture), so it plans from host bounds instead."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def live_int32(t: torch.Tensor, *, rows: bool = False) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """(the tensor a kernel reads, refresh or None) for an engine's metadata tensor (lengths, offsets, page table).

    The CUDA-graph contract: a run captured in a graph reads the metadata's current values at every replay, so an
    engine updates them in place and replays. An int32 tensor the kernel can read as it is (contiguous; with
    ``rows``, unit stride along the last dimension, rows at any stride) is returned itself. Anything else (int64, a
    column slice of a wider table) needs an int32 contiguous copy: the plan makes it and ``refresh`` copies the
    engine's tensor into it again. A run calls ``refresh_captured`` first: while it is being captured, the copy is
    captured with it and replayed before the kernel; an eager run reads the plan's copy (eager callers plan per
    batch, so the copy is current)."""
    usable = t.dtype == torch.int32 and (t.stride(-1) == 1 if rows and t.dim() == 2 else t.is_contiguous())
    if usable:
        return t, None
    copy = t.to(torch.int32).contiguous()
    return copy, lambda: copy.copy_(t)


def read_lengths(who: str, seq_lens: torch.Tensor, window: int | None, reach: int) -> tuple[int, int, bool]:
    """An eager plan's one host read of a non-empty batch's lengths: (the longest span, the spans summed, whether
    every row with keys is as long: rows of one length, padding rows of 0 aside, are what engines plan a CUDA graph
    on), a span being a length within ``window``. ValueError naming the first row whose length is negative or past
    the page table's ``reach`` in tokens (a kernel would read the next row's page ids there)."""
    spans = seq_lens if window is None else seq_lens.clamp(max=window)
    low, high, most, summed, rows = torch.stack((seq_lens.min().long(), seq_lens.max().long(), spans.max().long(),
                                                 spans.sum().long(), (spans > 0).sum())).tolist()
    if low < 0 or high > reach:
        row = int((seq_lens < 0).logical_or(seq_lens > reach).nonzero()[0, 0])
        raise ValueError(f"{who}: seq_lens[{row}] is {int(seq_lens[row])}; allowed: 0 (a padding row) up to the "
                         f"page table's reach, {reach} tokens (page_table.shape[1] x page_size)")
    return most, summed, summed == most * rows


def refresh_captured(refreshes, t: torch.Tensor) -> None:
    """Call the ``live_int32`` refreshes that are not None when a CUDA graph is being captured on t's device."""
    if any(r is not None for r in refreshes) and capturing(t):
        for refresh in refreshes:
            if refresh is not None:
                refresh()


def rows_without_keys(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor | None:
    """Causal (bottom-right aligned) ragged attention: the query rows that see no key, as int64 row indices on the
    metadata's device, or None where there are none (the common case). A sequence with lq queries and lk < lq keys
    leaves its first lq - lk queries before every key; FlashAttention returns zeros there, FlashInfer's prefill
    does not (tests/test_flash_api.py::test_varlen_with_more_queries_than_keys, on a GPU), so its run
    zeroes these rows. Reads both offsets on the host: a sync of its own (a small one, one copy of 2 x (batch + 1)
    ints), so call it only in a plan that may sync (FlashInfer's plan syncs for its own host copies too), never
    during capture. cu_seqlens_q/k: int32 [batch + 1]."""
    host = torch.stack((cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64))).cpu()
    lens = host[:, 1:] - host[:, :-1]
    blind = (lens[0] - lens[1]).clamp(min=0)
    if not bool(blind.any()):
        return None
    starts = host[0, :-1]
    rows = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, blind) if n > 0])
    return rows.to(cu_seqlens_q.device)
