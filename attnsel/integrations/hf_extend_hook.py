"""transformers >= 5.24, the flash route (``"attnsel_flash"``, ``"attnsel/flash-attn"``; checked on 5.25): steps with
a cached prefix read it in place through attnsel's FA3-compatible paged calls, not through the copy transformers'
cache update gathers.

From 5.24 the model calls ``PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)`` before its
attention function. For a full-attention layer with a non-empty read index (a chunked prefill, a shared prefix, a
decode: hf_extend) transformers writes the new tokens into the layer's pages, then gathers every request's whole
context with index_select, and the varlen call reads that copy. ``install()`` wraps the method: for a cache whose
model runs one of attnsel's flash names, on such a layer, the wrapper writes the new tokens as transformers does
and returns them ungathered, leaving the layer's pages and read index for the attention call that follows in the
same thread (``CachedPrefix.take``). hf_kernels' ``flash_attn_varlen_func`` takes them and calls attnsel's paged
forms on a page table derived once per step from the read index (``hf_extend.paged_page_table``; the layers of a
step share it, and so flash_api's plan): ``flash_attn_with_kvcache`` for decode-only steps (the decode phase), the
paged ``flash_attn_varlen_func`` for the others (the extend phase, ``flash_extend``). Every other model, layer
(sliding, MLA) and step (block-table decode, fresh prompts only) goes to transformers' update unchanged. The wrapper
installs only over the signature it knows (``unsupported()`` says why not: 5.18 to 5.23 update from their own paged
forward, and their steps stay gathered).

CUDA graphs (transformers captures the flash route by default on CUDA): the write, the page table's derivation and
the attention are captured together; a table made during a capture is never used outside it (nor one made outside
during one), and is kept for the process like the plans flash_api keeps; the FA-compatible calls plan a captured
call on a selection in mode "graph" (graph_selection).

Gathered all the same, counted by reason (``gathered``) and logged once: a query dtype other than the cache's
(transformers cast the call's tensors), a selection that cannot serve the step's phase.
"""
from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import NamedTuple

import torch

from .. import flash_api
from ..graph_selection import capturing_now
from ..selection import SelectionError
from .hf_extend import PrefixReads, paged_page_table

log = logging.getLogger(__name__)

_KNOWN_PARAMS = ["self", "key_states", "value_states", "layer_idx", "kwargs"]


def _transformers_classes() -> tuple:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    return PagedAttentionCache, FullAttentionCacheAllocator


def unsupported() -> str | None:
    """Why the cache-update hook cannot be installed on the installed transformers, or None."""
    try:
        import transformers

        cache_cls, full = _transformers_classes()
    except ImportError as exc:
        return f"transformers has no paged cache with cache allocators (5.24's layout): {exc}"
    update = getattr(cache_cls.update, "_attnsel_original", cache_cls.update)
    params = list(inspect.signature(update).parameters)
    if params != _KNOWN_PARAMS:
        return (f"transformers {transformers.__version__}: PagedAttentionCache.update{tuple(params)} is not the known "
                f"{tuple(_KNOWN_PARAMS)}, so steps with a cached prefix read the keys it gathers")
    if not hasattr(full, "get_cache_for_block_table"):
        return (f"transformers {transformers.__version__}: FullAttentionCacheAllocator has no "
                "get_cache_for_block_table (the layer's cache pages)")
    return None


class _Layer(NamedTuple):
    """A layer whose new tokens were written and whose prefix stays in the cache, until its attention call."""

    cache: object
    layer_idx: int
    rows: int  # the new tokens, the rows of the keys the attention call gets
    k_pages: torch.Tensor  # [pages, page_size, kv_heads, head_dim] views of the layer's cache
    v_pages: torch.Tensor
    read_index: torch.Tensor  # each request's whole context, slot by slot (the new tokens included)
    cu_k: torch.Tensor
    page_size: int
    max_len: int  # transformers' max_length_k: a bound on every request's context
    group: int  # the allocator's index: one page table per group and step


class CachedPrefix:
    """The hook's state: the names it serves, the layer waiting for its attention call (per thread), the page tables
    of the current step per group, and the steps gathered anyway (``reads``)."""

    def __init__(self) -> None:
        self.names: frozenset = frozenset()
        self.full_attention: type | None = None  # transformers' FullAttentionCacheAllocator, set by install()
        self.reads = PrefixReads()
        self._local = threading.local()
        self._tables: dict = {}

    @property
    def gathered(self) -> dict[str, int]:
        return self.reads.gathered

    def update(self, original, cache, key_states, value_states, layer_idx: int, kwargs: dict):
        """PagedAttentionCache.update for attnsel's flash names (module docstring); ``original`` for the rest."""
        allocator = cache.layer_to_allocator[layer_idx]
        if (getattr(cache.config, "_attn_implementation", None) not in self.names
                or kwargs.get("block_table") is not None or type(allocator) is not self.full_attention
                or kwargs["read_index"][allocator.index].numel() == 0):  # no cached prefix: nothing is gathered
            return original(cache, key_states, value_states, layer_idx, kwargs)
        waiting = getattr(self._local, "layer", None)
        if waiting is not None and waiting.cache is cache:
            self._local.layer = None  # never sticky: the next forward pass starts clean
            if layer_idx > waiting.layer_idx:  # the same forward pass: a layer skipped attnsel's attention
                raise RuntimeError(f"attnsel: layer {waiting.layer_idx} left its cached prefix in the paged cache "
                                   f"for attnsel's attention call, but layer {layer_idx} updates the cache before "
                                   "any such call came: every attention layer of a model loaded with "
                                   f"{cache.config._attn_implementation!r} must call transformers' flash attention")
            # a new forward pass (layers count up within one): the last one ended between a layer's update and its
            # attention call (an exception); that layer's keys are in the cache, nothing waits for them any more
            log.warning("attnsel: layer %d's attention call never came (its forward pass ended early); layer %d "
                        "starts a new one", waiting.layer_idx, layer_idx)
        kwargs["cu_seq_lens_k"] = cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = max_len = kwargs["max_length_k"][allocator.layer_type]
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
        write_index = kwargs["write_index"][allocator.index]
        new_k, new_v = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))  # [T, KVH, D]
        k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, write_index, new_k)  # the slots transformers writes
        v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, write_index, new_v)
        self._local.layer = _Layer(cache, layer_idx, new_k.shape[0], k_pages, v_pages,
                                   kwargs["read_index"][allocator.index], cu_k, allocator.tokens_per_page,
                                   int(max_len), allocator.index)
        return key_states, value_states

    def take(self, k: torch.Tensor) -> _Layer | None:
        """The layer waiting for this attention call (k: the call's keys, the new tokens), or None."""
        layer = getattr(self._local, "layer", None)
        if layer is None:
            return None
        self._local.layer = None
        if k.shape[0] != layer.rows:
            raise RuntimeError(f"attnsel: layer {layer.layer_idx} left its cached prefix in the paged cache and "
                               f"returned its {layer.rows} new keys, but the attention call that followed got "
                               f"{k.shape[0]} keys: something between transformers' cache update and its flash "
                               "attention call changed the keys")
        return layer

    def attend(self, layer: _Layer, q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               window_size, softcap, deterministic, sinks) -> torch.Tensor:
        """out ``[T, H, D]`` of the varlen call whose keys stayed in the cache (``take``)."""
        if q.dtype != layer.k_pages.dtype:
            return self._gather(layer, f"queries in {q.dtype} over a {layer.k_pages.dtype} cache", q, cu_seqlens_q,
                                max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                deterministic, sinks)
        page_table, lens = self._table(layer)
        try:
            if type(max_seqlen_q) is int and max_seqlen_q == 1 and q.shape[0] == cu_seqlens_q.shape[0] - 1:
                out = flash_api.flash_attn_with_kvcache(q.unsqueeze(1), layer.k_pages, layer.v_pages,
                                                        cache_seqlens=lens, page_table=page_table,
                                                        softmax_scale=softmax_scale, causal=causal,
                                                        window_size=window_size, softcap=softcap, sinks=sinks)
                return out.view(q.shape)
            return flash_api.flash_attn_varlen_func(q, layer.k_pages, layer.v_pages, cu_seqlens_q, None, max_seqlen_q,
                                                    max_seqlen_k, seqused_k=lens, softmax_scale=softmax_scale,
                                                    causal=causal, window_size=window_size, softcap=softcap,
                                                    deterministic=deterministic, sinks=sinks, page_table=page_table)
        except SelectionError as exc:  # the spec's selection has no backend for this phase
            return self._gather(layer, str(exc).splitlines()[0], q, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, window_size, softcap, deterministic, sinks)

    def _table(self, layer: _Layer) -> tuple:
        """(page_table, seq_lens) of the layer's group in this step: derived once from the read index and reused by
        the group's later layers while the index tensors are the same objects at the same versions (outside
        capture; within one capture). Index tensors made under torch.inference_mode() have no version: per call."""
        try:
            versions = (layer.read_index._version, layer.cu_k._version)
        except RuntimeError:
            versions = None
        capturing = capturing_now()
        host = (versions, layer.page_size, layer.max_len, capturing)
        entry = self._tables.get(layer.group)
        if (entry is not None and versions is not None and entry[0] is layer.read_index and entry[1] is layer.cu_k
                and entry[2] == host):
            return entry[3]
        made = paged_page_table(layer.read_index, layer.cu_k, layer.page_size, layer.max_len)
        self._tables[layer.group] = (layer.read_index, layer.cu_k, host, made)  # holding them keeps the ids unique
        if capturing:  # a graph replays the derivation into these tensors
            self.reads.captured.append(made)
        return made

    def _gather(self, layer: _Layer, reason: str, q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size, softcap, deterministic, sinks) -> torch.Tensor:
        """What transformers' update would have given: the whole contexts gathered, through the ragged varlen call."""
        self.reads.gather(reason)
        k, v = (pages.view(-1, *pages.shape[2:]).index_select(0, layer.read_index).to(q.dtype)
                for pages in (layer.k_pages, layer.v_pages))
        return flash_api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, layer.cu_k, max_seqlen_q, max_seqlen_k,
                                                softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                                softcap=softcap, deterministic=deterministic, sinks=sinks)


@functools.cache
def default() -> CachedPrefix:
    """The hook's state (the only module-level state)."""
    return CachedPrefix()


def install(names) -> None:
    """Serve the caches of models running one of ``names`` (added to those already served) and wrap
    ``PagedAttentionCache.update`` once. RuntimeError with the reason on a transformers it does not know."""
    reason = unsupported()
    if reason:
        raise RuntimeError(f"attnsel: cannot read cached prefixes in place: {reason}")
    cache_cls, full = _transformers_classes()
    state = default()
    state.names |= frozenset(names)
    state.full_attention = full
    if hasattr(cache_cls.update, "_attnsel_original"):
        return
    original = cache_cls.update

    @torch.compiler.disable  # host-side bookkeeping: runs eagerly inside compiled models
    def update(self, key_states, value_states, layer_idx, kwargs):
        return default().update(original, self, key_states, value_states, layer_idx, kwargs)

    update._attnsel_original = original
    cache_cls.update = update
