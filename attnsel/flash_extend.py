"""The FA-compatible calls with ragged queries over the paged cache, served by ``Selection.plan_extend``: chunked
prefill, a prompt-cache hit, multi-token decode, speculative verify.

The forms, as FA3 takes them (hopper/flash_api.cpp, seqlen.h):

- ``flash_attn_with_kvcache(q [batch, seqlen_q, H, D], k_cache, v_cache, cache_seqlens=, page_table=, k=, v=)``:
  seqlen_q queries per sequence. With k/v ``[batch, seqlen_new, KVH, D]`` the new tokens are written into the cache
  first at positions ``cache_seqlens[b]``, ``+ 1``, ... (in place), and each sequence's context is
  ``cache_seqlens[b] + seqlen_new``; without them it is ``cache_seqlens[b]``.
- the varlen form (LightLLM's): q ``[total_q, H, D]`` with ``cu_seqlens_q`` and ``max_seqlen_q`` (required, as in
  FA3); new tokens, if any, as k/v ``[total_k_new, KVH, D]`` with ``cu_seqlens_k_new``. Without k/v FA3 ignores
  ``cu_seqlens_k_new`` (LightLLM passes its cumulative context lengths there): so does attnsel, and
  ``cache_seqlens`` is each sequence's whole context, its queries' tokens included.
- ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, seqused_k=,
  page_table=)``: FA3's paged varlen form; ``seqused_k`` is each sequence's whole context (FA3 refuses
  cu_seqlens_k with a page table, and so does attnsel).

A sequence's queries are its last tokens, bottom-right causal (``causal=True``, or a window (left, 0); one query
per sequence is served either way). Plans are cached as flash_api's: reused while the metadata tensors are the
same objects at the same versions and the host sizes are equal; during CUDA-graph capture every call plans afresh
on the mode "graph" selection (graph_selection), from host bounds, and the plan is kept for the process. Outside
capture a plan reads the lengths once on the host (one sync per step): the dispatch's context, and the checks that
keep a kernel or the append inside each sequence's pages.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch

from . import kv_append
from .errors import InvalidArgument
from .flash_checks import speed_hints, unsupported
from .flash_extend_checks import KVCACHE, VARLEN, ExtendCall, extend_inputs, host_bound
from .graph_selection import GRAPH

log = logging.getLogger(__name__)


class ExtendPlan(NamedTuple):
    """A plan of an extend call: the run, the slots of the new tokens (or None) and the tensors the plan made (a
    batched q's cu_seqlens_q, the context lengths with the new tokens), alive as long as the plan."""

    run: Callable
    slots: kv_append.Slots | None
    made: tuple


class _Entry(NamedTuple):
    tensors: tuple
    versions: tuple | None
    host: tuple
    current: Callable | None
    plan: ExtendPlan


class ExtendCalls:
    """The extend calls of one ``flash_api.FlashAttention`` (``fa``): their plans, keyed by (phase, spec number) as
    fa's own. ``capturing(t)``: whether a CUDA graph is being captured (flash_api's stub point)."""

    def __init__(self, fa, capturing: Callable[[torch.Tensor], bool]):
        self._fa = fa
        self._capturing = capturing
        self._plans: dict = {}
        self._captured: list = []  # plans made during capture: a graph replays their buffers, kept for good
        self._no_versions_logged = False

    def clear(self) -> None:
        self._plans.clear()

    def with_kvcache(self, q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q, cu_seqlens_k_new,
                     max_seqlen_q, k_descale, v_descale, softmax_scale, causal, window_size, softcap, sinks):
        """flash_attn_with_kvcache with more than one query or new token per sequence, or varlen queries."""
        return self._call("flash_attn_with_kvcache", KVCACHE, q, k_cache, v_cache, k, v, cache_seqlens, page_table,
                          cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, k_descale, v_descale, softmax_scale, causal,
                          window_size, softcap, sinks)

    def varlen_paged(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                     softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk, softcap,
                     num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs, sinks, page_table):
        """flash_attn_varlen_func with a page_table: k/v are the paged caches, seqused_k the lengths."""
        func = "flash_attn_varlen_func"
        given = {n: x for n, x in (("seqused_q", seqused_q), ("qv", qv), ("q_descale", q_descale)) if x is not None}
        speed_hints(func, num_splits, pack_gqa)
        given.update({n: x for n, x, d in (("attention_chunk", attention_chunk, 0),
                                           ("deterministic", deterministic, False),
                                           ("sm_margin", sm_margin, 0), ("return_attn_probs", return_attn_probs,
                                                                         False)) if x != d})
        if given:
            unsupported(func, given)
        if cu_seqlens_k is not None:
            raise InvalidArgument(f"attnsel.{func}: cu_seqlens_k with a page_table: FA3 refuses it too (cu_seqlens_k "
                                  "offsets packed k/v); with paged caches pass cu_seqlens_k=None and seqused_k "
                                  "(int32 [batch]: each sequence's tokens in the cache)")
        if seqused_k is None:
            raise InvalidArgument(f"attnsel.{func}: a page_table needs seqused_k (int32 [batch]: each sequence's "
                                  "tokens in the cache, its queries' tokens included)")
        if max_seqlen_k is not None:
            host_bound(func, "max_seqlen_k", max_seqlen_k, "a bound on the longest sequence; None is fine")
        return self._call(func, VARLEN, q, k, v, None, None, seqused_k, page_table, cu_seqlens_q, None,
                          max_seqlen_q, k_descale, v_descale, softmax_scale, causal, window_size, softcap, sinks)

    def _call(self, func, names, q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q,
              cu_seqlens_k_new, max_seqlen_q, k_descale, v_descale, softmax_scale, causal, window_size, softcap,
              sinks):
        fa = self._fa
        call = extend_inputs(func, names, q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q,
                             cu_seqlens_k_new, max_seqlen_q, k_descale, v_descale, causal, window_size, softcap,
                             sinks)
        page_size = k_cache.shape[1]
        spec, sel, number = fa._resolve(func, q, k_cache, v_cache, q.shape, k_cache.shape, page_size, softmax_scale,
                                        True, call.window, call.cap, sinks is not None)
        append = call.k is not None
        tensors = (cu_seqlens_q, call.cache_seqlens, page_table, call.cu_new)
        host = (call.batch, call.q.shape[0], call.max_q, call.seqlen_q, call.new_len,
                call.k.shape[0] if append else None, page_table.shape[1])
        slot, capturing = ("extend", number), self._capturing(q)
        plan = self._cached(slot, tensors, host, capturing)
        if plan is None:
            if capturing and sel.mode != GRAPH:
                sel = fa.selection_for(spec, q.device, GRAPH)
            versions = self._versions(tensors)
            plan = _plan(sel, call, cu_seqlens_q, page_table, page_size, capturing, func, names[2])
            self._store(slot, tensors, versions, host, capturing, plan)
        if k_cache.shape[0] == 0 and call.batch:  # the backends gather page 0 for rows with nothing to read
            raise ValueError(f"attnsel.{func}: {names[0]}/{names[1]} hold 0 pages ({tuple(k_cache.shape)}); "
                             "allowed: at least one page (padding rows still need a page for their page ids)")
        if append:
            check_pages = getattr(plan.run, "check_pages", None)  # ATTNSEL_CHECK_METADATA: before the write
            if check_pages is not None:
                check_pages(k_cache)
            kv_append.write(k_cache, v_cache, call.k, call.v, plan.slots, func)  # in place, strided too
        out = plan.run(call.q, k_cache, v_cache, **call.extra, **call.scales)
        return out.view(q.shape) if call.seqlen_q is not None else out

    def _versions(self, tensors: tuple) -> tuple | None:
        """The metadata's version counters (None for tensors made under torch.inference_mode(): never reused)."""
        try:
            return tuple(t._version for t in tensors if t is not None)
        except RuntimeError:
            if not self._no_versions_logged:
                self._no_versions_logged = True
                log.warning("attnsel: metadata tensors made under torch.inference_mode() have no version counter, "
                            "so attnsel plans every call; allocate cu_seqlens / cache_seqlens / page_table outside "
                            "inference mode to share one plan across the layers of a step")
            return None

    def _cached(self, slot: tuple, tensors: tuple, host: tuple, capturing: bool) -> ExtendPlan | None:
        """The plan stored for slot if made outside capture from these very tensors at their current versions with
        these host sizes, and still current; else None."""
        e = self._plans.get(slot)
        if e is None or capturing or e.versions is None or e.host != host:
            return None
        if any(a is not b for a, b in zip(e.tensors, tensors)):
            return None
        if e.versions != tuple(t._version for t in tensors if t is not None):
            return None
        return e.plan if e.current is None or e.current() else None

    def _store(self, slot, tensors, versions, host, capturing, plan: ExtendPlan) -> None:
        current = getattr(plan.run, "current", None)
        self._plans[slot] = _Entry(tensors, None if capturing else versions, host,
                                   (lambda: bool(current())) if current is not None else None, plan)
        if capturing:
            self._captured.append(plan)


def _plan(sel, call: ExtendCall, cu_seqlens_q, page_table: torch.Tensor, page_size: int, capturing: bool,
          func: str, lens_name: str) -> ExtendPlan:
    """Plan an extend call: the context lengths (new tokens included), a batched q's offsets, the slots of the new
    tokens, and outside capture one host read of the lengths for the dispatch and the checks."""
    batch, device = call.batch, page_table.device
    cu_q = cu_seqlens_q
    if cu_q is None:
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * call.seqlen_q
    cached = call.cache_seqlens
    append = call.k is not None
    cu_new = seq_lens = cached
    if append:
        cu_new = call.cu_new
        if cu_new is None:
            cu_new = torch.arange(batch + 1, dtype=torch.int32, device=device) * call.new_len
        seq_lens = cached + (cu_new[1:] - cu_new[:-1])
    max_len, context = page_table.shape[1] * page_size, None  # during capture: the table's capacity
    slots = (kv_append.plan_new_slots(page_table, cached, cu_new, call.k.shape[0], page_size) if append else None)
    if not capturing and batch:
        max_len, context, pages = _read_and_check(call, cu_q, cached, seq_lens, cu_new if append else None,
                                                  slots, page_table, page_size, func, lens_name)
        slots = slots._replace(pages=pages) if pages else slots
    run = sel.plan_extend(cu_q, page_table, seq_lens, call.max_q, max_seq_len=max_len, total_q=call.q.shape[0],
                          context_tokens=context, longest=None if context is None else max_len, checked=False)
    return ExtendPlan(run, slots, (cu_q, seq_lens))


def _read_and_check(call: ExtendCall, cu_q, cached, seq_lens, cu_new, slots, page_table, page_size: int, func: str,
                    lens_name: str) -> tuple[int, int, tuple | None]:
    """One host read of the lengths, offsets and the new tokens' page ids; raises where a kernel would read, or the
    append write, outside a sequence's pages or q's rows. Returns (the longest context, the batch's context tokens)
    for the dispatch, and the new tokens' page extremes for kv_append.write (None without new tokens)."""
    q_lens = cu_q[1:] - cu_q[:-1]
    parts = [cached.min(), seq_lens.max(), seq_lens.long().sum(), q_lens.min(), q_lens.max(), cu_q[-1], cu_q[0]]
    if cu_new is not None:
        parts += [(cu_new[1:] - cu_new[:-1]).min(), cu_new[0], cu_new[-1]]
    extremes = kv_append.page_extremes(slots) if slots is not None and slots.page.numel() else []
    got = torch.stack([p.long() for p in parts + extremes]).tolist()
    got, pages = got[:len(parts)], tuple(got[len(parts):]) or None
    low, high, total, q_min, q_max, q_end, q_start = got[:7]
    capacity = page_table.shape[1] * page_size
    plus = " + new tokens" if cu_new is not None else ""
    if low < 0:
        raise ValueError(f"attnsel.{func}: {lens_name} holds a negative length {low}; allowed: 0 <= {lens_name}")
    if high > capacity:
        raise ValueError(f"attnsel.{func}: page_table {tuple(page_table.shape)} holds {capacity} tokens per sequence "
                         f"({page_table.shape[1]} pages of {page_size}), too few for {high} (the longest "
                         f"{lens_name}{plus}); allowed: {lens_name}{plus} <= page_table.shape[1] * page_size")
    if q_min < 0 or q_max > call.max_q:
        raise ValueError(f"attnsel.{func}: cu_seqlens_q gives a sequence {q_min if q_min < 0 else q_max} queries "
                         f"(max_seqlen_q={call.max_q}); allowed: non-decreasing offsets, each sequence's queries "
                         "<= max_seqlen_q")
    if q_start < 0:  # a kernel would read q and write out before their first row
        raise ValueError(f"attnsel.{func}: cu_seqlens_q[0] is {q_start} (q's rows start at 0); allowed: "
                         "non-negative, non-decreasing offsets (0 first)")
    if q_end > call.q.shape[0]:
        raise ValueError(f"attnsel.{func}: cu_seqlens_q[-1] is {q_end} but q holds {call.q.shape[0]} rows; "
                         "allowed: cu_seqlens_q[-1] <= q.shape[0] (rows after it are padding)")
    if cu_new is not None:
        new_min, new_start, new_end = got[7:]
        if new_min < 0 or new_start != 0 or new_end != call.k.shape[0]:
            raise ValueError(f"attnsel.{func}: cu_seqlens_k_new must start at 0, not decrease and end at k's "
                             f"{call.k.shape[0]} rows; got start {new_start}, end {new_end}, smallest step "
                             f"{new_min}")
    return high, total, pages
