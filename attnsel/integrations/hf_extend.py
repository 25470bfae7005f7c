"""Continuous batching's steps with a cached prefix read it in place, through the extend phase
(``Selection.plan_extend``), instead of a copy of every request's whole context gathered into contiguous K/V.

A step has a cached prefix when a request's new tokens follow tokens already in the paged cache: a later chunk of a
prompt longer than the step's token budget (chunked prefill), a prompt whose first pages another request computed
(prefix sharing), a decode. transformers says so with a non-empty read index: per request, the cache slots of its
whole context, page by page (full-attention layers; a sliding layer's read index is a ring over its window and
stays gathered). The new tokens are written into the cache first, as transformers does, then the extend plan reads
the pages from a page table derived from the read index (``paged_page_table``): row b's queries are its last
tokens, bottom-right causal.

This module: the page-table derivation, ``PrefixReads`` (the steps gathered anyway, by reason, and the plans a CUDA
graph replays), and the "paged|attnsel" path of transformers 5.17 (``paged_extend``). transformers >= 5.24's flash
route: ``hf_extend_hook``.

CUDA graphs: a call made while a graph is captured plans on a selection made in mode "graph" (graph_selection's
rule), afresh and from host bounds (the page table's reach, transformers' ``max_seqlen_k``), with the page table
derived inside the capture from transformers' static index buffers; the plan is kept for the process.
"""
from __future__ import annotations

import logging
import math

import torch

from ..graph_selection import GRAPH, capturing_now

log = logging.getLogger(__name__)


def paged_page_table(read_index: torch.Tensor, cu_k: torch.Tensor, block_size: int,
                     max_len: int | None = None) -> tuple:
    """(page_table, seq_lens) of a step from transformers' read index: sequence i reads slots
    ``read_index[cu_k[i]:cu_k[i+1]]``, which lie block by block in its pages. Columns past a sequence's pages hold
    page 0 (a page that exists: harmless to any backend). With ``max_len`` (a bound on every sequence's length) no
    value is read on the host."""
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    longest = int(lens.max()) if max_len is None else max_len
    max_pages = max(1, math.ceil(longest / block_size))
    offsets = cu_k[:-1, None].long() + torch.arange(max_pages, device=cu_k.device)[None, :] * block_size
    valid = offsets < cu_k[1:, None].long()
    slots = read_index[offsets.clamp(max=read_index.numel() - 1)]
    page_table = torch.where(valid, slots // block_size, torch.zeros_like(slots)).to(torch.int32)
    return page_table, lens


class PrefixReads:
    """The steps with a cached prefix that were gathered all the same, by reason (each reason logged once), and the
    plans made during CUDA-graph capture (a graph replays their buffers: kept for the process)."""

    def __init__(self) -> None:
        self.gathered: dict[str, int] = {}
        self._logged: set[str] = set()
        self.captured: list = []

    def clear(self) -> None:
        """Forget the counts (the captured plans stay: graphs may still replay them)."""
        self.gathered.clear()
        self._logged.clear()

    def gather(self, reason: str) -> None:
        self.gathered[reason] = self.gathered.get(reason, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("attnsel: a step with a cached prefix reads it gathered into contiguous keys and values: %s",
                        reason)


def paged_extend(state, sel, layer_idx: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache,
                 group: int, layer_in_group: int, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                 read_index: torch.Tensor, write_index: torch.Tensor, features: dict) -> torch.Tensor | None:
    """transformers 5.17 ("paged|attnsel"): a full-attention layer's step with a cached prefix and more than one query
    somewhere. Writes the new keys/values into the layer's cache and returns out ``[T, H, D]`` from plan_extend over
    the cache pages; None (nothing written) where the selection cannot serve extend: the caller gathers.

    ``state``: the HFAttention (selections, per-step plans, ``prefix``); q ``[T, H, D]``; key/value
    ``[1, KVH, T, D]``; the rest as transformers passes them, for this layer's group."""
    if not sel.extend:
        state.prefix.gather(f"no extend backend for {sel.spec.describe()}: {sel.phases['extend'].error}")
        return None
    k_cache, v_cache = cache.key_cache[layer_in_group], cache.value_cache[layer_in_group]
    k_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
    v_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
    block, tokens, capturing = cache.block_size, q.shape[0], capturing_now()

    def plan(on):
        page_table, lens = paged_page_table(read_index, cu_k, block, int(max_k))
        return on.plan_extend(cu_q.to(torch.int32), page_table, lens, int(max_q), max_seq_len=int(max_k),
                              total_q=tokens, context_tokens=None if capturing else read_index.numel(),
                              longest=None if capturing else int(max_k))

    if capturing:
        run = plan(sel if sel.mode == GRAPH else state.selection_for(sel.spec, q.device, GRAPH))
        state.prefix.captured.append(run)
    else:
        run = state.paged_steps.get(layer_idx, ("extend", group, id(sel)), lambda: plan(sel), q.device)
    kvh, d = k_cache.shape[-2:]
    return run(q, k_cache.view(-1, block, kvh, d), v_cache.view(-1, block, kvh, d), **features)
