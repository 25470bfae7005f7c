"""The argument checks of the FA-compatible calls with ragged queries over the paged cache (flash_extend): layouts,
dtypes, devices and the argument combinations FA3 takes, each error naming the argument and what is allowed."""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from .errors import InvalidArgument
from .flash_checks import cache_scales, non_tensor, show, sinks_kwargs, unit_stride
from .flash_masks import UnsupportedArgument, spec_masks

KVCACHE = ("k_cache", "v_cache", "cache_seqlens")  # the caller's names of the caches and lengths, per function
VARLEN = ("k", "v", "seqused_k")


class ExtendCall(NamedTuple):
    """A checked call: q as ``[total_q, H, D]``, the batch, the queries per row of a batched q (None: varlen, rows
    from cu_seqlens_q), the host bound of the longest row's queries, the cached lengths as an int32 tensor, the new
    tokens as ``[total_new, KVH, D]`` (or None) with their count per row of a batched k (None: from cu_seqlens_k_new),
    the run's descale and sinks kwargs, and the spec's sliding_window and softcap."""

    q: torch.Tensor
    batch: int
    seqlen_q: int | None
    max_q: int
    cache_seqlens: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    new_len: int | None
    cu_new: torch.Tensor | None
    scales: dict
    extra: dict
    window: int | None
    cap: float | None


def host_bound(func: str, name: str, x, what: str) -> int:
    """A host int >= 0 (numpy ints too); InvalidArgument naming it otherwise (a tensor would be a device read:
    operator.index takes a 0-dim integer tensor)."""
    try:
        if isinstance(x, (bool, torch.Tensor)):
            raise TypeError
        value = operator.index(x)
    except TypeError:
        value = -1
    if value < 0:
        raise InvalidArgument(f"attnsel.{func}: {name} must be a non-negative Python int ({what}), got {show(x)}")
    return value


def _index(func: str, name: str, t: torch.Tensor, shape: tuple, device: torch.device, what: str) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device:
        dims = ", ".join(map(str, shape))
        raise InvalidArgument(f"attnsel.{func}: {name} must be int32 [{dims}] on {device} ({what}), got "
                              f"{t.dtype} {tuple(t.shape)} on {t.device}")


def extend_inputs(func: str, names: tuple[str, str, str], q, k_cache, v_cache, k, v, cache_seqlens, page_table,
                  cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, k_descale, v_descale, causal, window_size, softcap,
                  sinks) -> ExtendCall:
    """Every check of a call with more than one query or new token per sequence (or varlen queries) over the paged
    cache, before anything is written; raises on the first bad argument. ``names``: the caller's names of the caches
    and the cached lengths (KVCACHE or VARLEN)."""
    kn, vn, ln = names
    optional = ("k", "v", "cu_seqlens_q", "cu_seqlens_k_new", "k_descale", "v_descale", "sinks")
    new = dict(k=k, v=v, cu_seqlens_k_new=cu_seqlens_k_new) if names == KVCACHE else {}  # varlen: k/v are caches
    non_tensor(func, optional, q=q, **{kn: k_cache, vn: v_cache}, **new, page_table=page_table,
               **{ln: cache_seqlens}, cu_seqlens_q=cu_seqlens_q, k_descale=k_descale, v_descale=v_descale,
               sinks=sinks)
    ks = k_cache.shape
    if len(ks) != 4 or v_cache.shape != ks or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"attnsel.{func}: {kn} and {vn} must both be paged caches [num_pages, page_size, kv_heads, "
                         f"head_dim] of one dtype, got {tuple(ks)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                         f"{v_cache.dtype}")
    device = q.device
    if cu_seqlens_q is not None:
        if q.dim() != 3:
            raise InvalidArgument(f"attnsel.{func}: with cu_seqlens_q, q must be [total_q, heads, head_dim] (FA3's "
                                  f"varlen layout), got {tuple(q.shape)}; allowed: that, or q [batch, seqlen_q, "
                                  "heads, head_dim] without cu_seqlens_q")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise InvalidArgument(f"attnsel.{func}: cu_seqlens_q must be int32 [batch + 1] (each sequence's first "
                                  f"query row, then the total), got {show(cu_seqlens_q)}")
        batch = cu_seqlens_q.shape[0] - 1
        _index(func, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), device, "each sequence's first query row")
        if max_seqlen_q is None:
            raise InvalidArgument(f"attnsel.{func}: max_seqlen_q is required with cu_seqlens_q (as in FA3): the "
                                  "longest sequence's queries, a Python int (an upper bound is fine)")
        max_q = host_bound(func, "max_seqlen_q", max_seqlen_q, "the longest sequence's queries, an upper bound is "
                                                                 "fine")
        seqlen_q, q3 = None, q
    else:
        if q.dim() == 3:
            raise InvalidArgument(f"attnsel.{func}: q {tuple(q.shape)} is [total_q, heads, head_dim]: give "
                                  "cu_seqlens_q and max_seqlen_q with it (FA3's varlen form); allowed: that, or q "
                                  "[batch, seqlen_q, heads, head_dim]")
        if q.dim() != 4:
            raise ValueError(f"attnsel.{func}: q must be [batch, seqlen_q, heads, head_dim], or [total_q, heads, "
                             f"head_dim] with cu_seqlens_q, got {tuple(q.shape)}")
        batch, seqlen_q = q.shape[0], q.shape[1]
        if max_seqlen_q is not None and host_bound(func, "max_seqlen_q", max_seqlen_q, "a bound") < seqlen_q:
            raise InvalidArgument(f"attnsel.{func}: max_seqlen_q={max_seqlen_q!r} is less than q's {seqlen_q} "
                                  "queries per sequence; allowed: None (q [batch, seqlen_q, ...] says it) or a "
                                  "bound >= seqlen_q")
        max_q, q3 = seqlen_q, q.reshape(batch * seqlen_q, q.shape[2], q.shape[3])
    qs = q3.shape
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32 \
            or page_table.device != device:
        raise ValueError(f"attnsel.{func}: page_table must be int32 [batch, max_pages] with batch {batch} on "
                         f"{device}, got {page_table.dtype} {tuple(page_table.shape)} on {page_table.device}")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    _index(func, ln, cache_seqlens, (batch,), device, "each sequence's tokens in the cache" + (
        ", its queries' included" if ln == "seqused_k" else " before the new k/v"))
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        unit_stride(func, q=q, **{kn: k_cache, vn: v_cache})
    if (k is None) != (v is None):
        raise ValueError(f"attnsel.{func}: give both k and v (new tokens) or neither")
    scales = cache_scales(func, q, k_cache, k, v, k_descale, v_descale)
    new_len = cu_new = None
    if k is not None:
        k, v, new_len, cu_new = _new_tokens(func, k, v, k_cache, cu_seqlens_k_new, batch, device)
    extra = sinks_kwargs(func, sinks, qs[1]) if sinks is not None else {}
    one_query = max_q <= 1  # each query at its sequence's last position: causal or not is the same attention
    causal_, window, cap = (bool(causal) or one_query, None, None) if window_size == (-1, -1) and softcap == 0.0 \
        else spec_masks(func, causal, window_size, softcap, one_query=one_query)
    if not causal_:
        raise UnsupportedArgument(
            f"attnsel.{func}: causal=False with up to {max_q} queries per sequence over the paged cache: not "
            "supported by attnsel (its queries are each sequence's last tokens, bottom-right causal); allowed: "
            "causal=True, window_size (left, 0), or one query per sequence")
    return ExtendCall(q3, batch, seqlen_q, max_q, cache_seqlens, k, v, new_len, cu_new, scales, extra, window, cap)


def _new_tokens(func: str, k, v, k_cache, cu_seqlens_k_new, batch: int, device) -> tuple:
    """New k/v as ``[total_new, KVH, D]``, their count per row (batched) or cu_seqlens_k_new (ragged)."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    if k.device != device or v.device != device:
        raise ValueError(f"attnsel.{func}: k and v (new tokens) must be on q's device {device}, got {k.device} "
                         f"and {v.device}")
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError(f"attnsel.{func}: k/v ({k.dtype}/{v.dtype}) must have the cache's dtype {k_cache.dtype}")
    if cu_seqlens_k_new is not None:
        if k.dim() != 3 or k.shape[1:] != (kvh, d) or v.shape != k.shape:
            raise InvalidArgument(f"attnsel.{func}: with cu_seqlens_k_new, k and v must be [total_k_new, kv_heads, "
                                  f"head_dim] = [*, {kvh}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}; "
                                  "allowed: that, or [batch, seqlen_new, kv_heads, head_dim] without "
                                  "cu_seqlens_k_new")
        _index(func, "cu_seqlens_k_new", cu_seqlens_k_new, (batch + 1,), device,
               "each sequence's first row of k/v, then the total")
        new_len, cu_new, k3, v3 = None, cu_seqlens_k_new, k, v
    else:
        if k.dim() == 3:
            raise InvalidArgument(f"attnsel.{func}: k {tuple(k.shape)} is [total_k_new, kv_heads, head_dim]: give "
                                  "cu_seqlens_k_new with it; allowed: that, or k/v [batch, seqlen_new, kv_heads, "
                                  "head_dim]")
        if k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != (kvh, d) or v.shape != k.shape:
            raise ValueError(f"attnsel.{func}: k and v must be [batch, seqlen_new, kv_heads, head_dim] = "
                             f"[{batch}, *, {kvh}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
        new_len, cu_new = k.shape[1], None
        k3, v3 = k.reshape(-1, kvh, d), v.reshape(-1, kvh, d)
    if k3.stride(-1) != 1 or v3.stride(-1) != 1:
        unit_stride(func, k=k3, v=v3)
    return k3, v3, new_len, cu_new
