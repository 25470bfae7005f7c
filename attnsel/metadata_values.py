"""Opt-in checks of plan metadata *values* (``ATTNSEL_CHECK_METADATA=1``): a debugging mode for engine developers.

By default attnsel trusts the values in ``cu_seqlens``, ``seq_lens`` and ``page_table`` (checking them needs a
device-to-host copy per plan, and an engine's step loop must not sync). A wrong value is not harmless, though:
offsets that run backwards or past q, a length past the page table or a page id past the cache make a kernel read
another sequence's memory (silently wrong output) or fault (a CUDA context that is dead for the whole process). With
the variable set, every ``Selection.plan_prefill`` / ``plan_decode`` / ``plan_extend`` (and the FA-compatible calls,
which plan through them) copies the metadata to the host once per plan and raises ValueError naming the argument,
the row and what is allowed; the run function then compares the tensors it gets with what the plan read (host ints,
no sync per run). Plans made during CUDA-graph capture are not checked (a copy to the host cannot be captured).
"""
from __future__ import annotations

import torch

from . import settings

ENV = settings.ENV["check_metadata"]  # named in the errors these checks raise


def enabled() -> bool:
    """Whether ``ATTNSEL_CHECK_METADATA`` asks for value checks (settings.Settings.check_metadata; a bad value is a
    SettingsError naming the variable)."""
    return settings.read("check_metadata")


def _unreadable(t: torch.Tensor) -> bool:
    """No values to check: a meta tensor, or a CUDA stream being captured (a copy to the host cannot be captured)."""
    return t.is_meta or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _offsets(arg: str, cu: torch.Tensor, longest: int, longest_arg: str) -> int:
    """Checks one cu_seqlens tensor (host copy given): starts at 0, never decreases, no sequence longer than
    ``longest``; returns its last offset (the token count)."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{arg}[0] is {values[0]}; allowed: 0 (offsets of packed sequences start at 0)")
    for i in range(len(values) - 1):
        n = values[i + 1] - values[i]
        if n < 0:
            raise ValueError(f"{arg} decreases at sequence {i} ({values[i]} -> {values[i + 1]}); allowed: "
                             "non-decreasing offsets")
        if n > longest:
            raise ValueError(f"sequence {i} has {n} tokens by {arg} ({values[i]} -> {values[i + 1]}), more than "
                             f"{longest_arg}={longest}; allowed: {longest_arg} >= every sequence's length")
    return values[-1]


def check_prefill(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  total_q: int | None, total_k: int | None) -> tuple[int, int] | None:
    """The values of a prefill plan's metadata (int32 ``[batch + 1]`` offsets; shapes and dtypes already checked).
    Returns the last offsets (q's and k's tokens in sequences: the run's q and k must hold at least that many rows,
    exactly ``total_q``/``total_k`` when given), or None when nothing was read (meta tensors, capture). ValueError
    naming the first wrong value."""
    if _unreadable(cu_seqlens_q) or _unreadable(cu_seqlens_k):
        return None
    tq = _offsets("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    tk = _offsets("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, "max_seqlen_k")
    for arg, given, seen, cu, t in (("total_q", total_q, tq, "cu_seqlens_q", "q"),
                                    ("total_k", total_k, tk, "cu_seqlens_k", "k")):
        if given is not None and given < seen:  # more tokens than the offsets cover: padding, as FlashAttention
            raise ValueError(f"{cu}[-1] is {seen}, past {t}'s {given} tokens ({arg}); allowed: offsets within "
                             f"{t}'s tokens")
    return tq, tk


def check_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None,
                 page_size: int, window: int | None = None, longest: int | None = None,
                 q_lens: list[int] | None = None) -> int | None:
    """The values of a decode plan's metadata (page_table int32 ``[batch, max_pages]``, seq_lens int32 ``[batch]``,
    tokens in each cache, the new one included); None during capture. ``window``: the spec's sliding window, whose
    rows read only the pages from the one holding token ``len - q_len + 1 - window``, the first key the row's first
    query sees (engines free the pages before it, -1); ``q_lens``: extend's queries per row (decode: one each).
    Returns the pages the caches must hold (one more than the largest page id a row reads), or None when nothing
    was read (meta tensors, capture). ``longest``: the plan's exact longest row (the dispatch's ragged route reads
    it), checked against seq_lens. ValueError naming the first wrong value."""
    if _unreadable(seq_lens) or _unreadable(page_table):
        return None
    lens = seq_lens.tolist()
    width = page_table.shape[1]
    pages_needed = 0
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"seq_lens[{b}] is {n}; allowed: 0 (a padding row) or more")
        if n > width * page_size:
            raise ValueError(f"seq_lens[{b}] is {n}, more than page_table's {width} pages x page size {page_size} "
                             f"= {width * page_size} tokens; allowed: seq_lens <= page_table.shape[1] * page_size")
        if max_seq_len is not None and n > max_seq_len:
            raise ValueError(f"seq_lens[{b}] is {n}, more than max_seq_len={max_seq_len}; allowed: max_seq_len >= "
                             "every length (or None)")
    if longest is not None and lens and longest != max(lens):
        raise ValueError(f"longest={longest} but the longest of seq_lens is {max(lens)} (row {lens.index(max(lens))}); "
                         "allowed: longest = max(seq_lens), the exact longest row (or None)")
    used = [-(-n // page_size) for n in lens]
    if any(used):
        rows = page_table[:, :max(used)].tolist()
        for b, (row, k) in enumerate(zip(rows, used)):
            lq = max(q_lens[b], 1) if q_lens else 1  # the row's first query sees keys from lens - lq + 1 - window
            first = max(0, lens[b] - lq + 1 - window) // page_size if window else 0
            for j, page in enumerate(row[first:k], start=first):
                if page < 0:
                    raise ValueError(f"page_table[{b}, {j}] is {page} (read by seq_lens[{b}]={lens[b]}); allowed: "
                                     "page ids >= 0")
                pages_needed = max(pages_needed, page + 1)
    return pages_needed


def check_decode_run(pages_needed: int, k_cache: torch.Tensor) -> None:
    """A checked decode plan's run: the caches hold every page the plan's rows read (host ints only)."""
    if k_cache.shape[0] < pages_needed:
        raise ValueError(f"page_table reads page {pages_needed - 1} but k_cache/v_cache hold {k_cache.shape[0]} "
                         f"pages; allowed: page ids < k_cache.shape[0] (${ENV} found this)")


def check_extend(cu_seqlens_q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int,
                 max_seq_len: int, page_size: int, total_q: int | None, window: int | None = None,
                 longest: int | None = None) -> int | None:
    """The values of an extend plan's metadata: the query offsets (each row at most ``max_seqlen_q`` queries, no
    more than its context unless the context is 0, a padding row), the contexts, page ids and ``longest`` as
    decode's (with a sliding ``window``, from the page its first query's window starts in). Returns the pages the
    caches must hold, as check_decode; None when nothing was read (meta tensors, capture). ValueError naming the
    first wrong value."""
    if _unreadable(cu_seqlens_q):
        return None
    tq = _offsets("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    if total_q is not None and total_q < tq:
        raise ValueError(f"cu_seqlens_q[-1] is {tq}, past q's {total_q} tokens (total_q); allowed: offsets within "
                         "q's tokens")
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        lq = cu[b + 1] - cu[b]
        if n and lq > n:
            raise ValueError(f"row {b} has {lq} queries (cu_seqlens_q) but seq_lens[{b}] is {n}; allowed: seq_lens "
                             "counts the whole context, the row's new tokens included (>= its queries), or 0 for a "
                             "padding row")
    return check_decode(page_table, seq_lens, max_seq_len, page_size, window, longest,
                        q_lens=[cu[b + 1] - cu[b] for b in range(len(lens))])
