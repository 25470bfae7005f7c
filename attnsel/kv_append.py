"""flash_attn_with_kvcache's new tokens written into the caller's paged caches, in place (as FA3 does).

A cache is ``[num_pages, page_size, kv_heads, head_dim]`` with a contiguous last dimension and any other strides:
the k and v halves of one ``[num_pages, 2, page_size, kv_heads, head_dim]`` tensor (``kv[:, 0]``, ``kv[:, 1]``) are
views whose pages and slots cannot be flattened into one dimension. Writes go through the cache's own strides; no
copy of a cache is made.

Outside CUDA-graph capture a plan reads the page ids its new tokens go to once, with its lengths (``page_extremes``
in the caller's one host read); ``write`` refuses a page outside the caches before writing anything (a padding row's
sentinel page id, -1 or num_pages: indexed into a strided cache, -1 wraps to the last page, another sequence's).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Slots(NamedTuple):
    """Where each new token goes: its page id and offset in the page, and both as one index into the cache viewed as
    ``[num_pages * page_size, kv_heads, head_dim]`` (int64, one per new token, on the device)."""
    flat: torch.Tensor
    page: torch.Tensor
    offset: torch.Tensor
    row: torch.Tensor | None = None  # the sequence each new token belongs to (None: token i is sequence i's)
    # (lowest page id, its sequence, highest page id, its sequence) read on the host when the plan was made; None:
    # not read (a plan made during CUDA-graph capture, which reads nothing)
    pages: tuple[int, int, int, int] | None = None


def plan_slots(page_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int) -> Slots:
    """The slots of tokens at positions cache_seqlens (made once per plan; no host sync). A position past the table
    is clamped to its last page (the caller refuses such lengths before writing, outside CUDA-graph capture)."""
    no_pages(page_table, cache_seqlens.shape[0])
    pos = cache_seqlens.long()
    page = page_table.gather(1, (pos // page_size)[:, None].clamp(max=page_table.shape[1] - 1))[:, 0].long()
    offset = pos % page_size
    return Slots(page * page_size + offset, page, offset)


def plan_new_slots(page_table: torch.Tensor, cache_seqlens: torch.Tensor, cu_new: torch.Tensor, total: int,
                   page_size: int) -> Slots:
    """The slots of ragged new tokens: rows ``cu_new[b]`` to ``cu_new[b + 1]`` of the ``total`` new ones belong to
    sequence b and go to its positions ``cache_seqlens[b]``, ``+ 1``, ... (made once per plan; no host sync). Rows
    past ``cu_new[batch]`` and positions past the table are clamped into it (the caller refuses both before writing,
    outside CUDA-graph capture)."""
    batch, width = page_table.shape
    no_pages(page_table, total)
    token = torch.arange(total, device=page_table.device)
    cu = cu_new.long()
    row = torch.searchsorted(cu[1:], token, right=True).clamp_(max=max(batch - 1, 0))
    pos = (cache_seqlens.long()[row] + token - cu[row]).clamp_(min=0)
    page = page_table[row, (pos // page_size).clamp(max=width - 1)].long()
    offset = pos % page_size
    return Slots(page * page_size + offset, page, offset, row)


def no_pages(page_table: torch.Tensor, tokens: int) -> None:
    """ValueError for new tokens and a page table without columns (a host check: the caller's read of the lengths,
    which would say the same, comes after the slots are planned)."""
    if tokens and not page_table.shape[1]:
        raise ValueError(f"attnsel: page_table {tuple(page_table.shape)} has no pages for the {tokens} new tokens "
                         "(k/v); allowed: page_table.shape[1] * page_size >= cache_seqlens + new tokens per sequence")


def page_extremes(slots: Slots) -> list[torch.Tensor]:
    """Device scalars for the caller's host read of a plan (at least one new token): the lowest and highest page id
    the new tokens go to, each with its sequence; the values read back go to ``Slots.pages``."""
    page, row = slots.page, slots.row
    low, high = page.argmin(), page.argmax()
    return [page[low], low if row is None else row[low], page[high], high if row is None else row[high]]


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: Slots,
          func: str = "flash_attn_with_kvcache") -> None:
    """k/v ``[batch, 1, kv_heads, head_dim]`` (one token per sequence) or ``[tokens, kv_heads, head_dim]`` (the
    slots of plan_new_slots) into the caches at their slots, in place. ValueError, before anything is written, when
    the page ids read at plan time (``slots.pages``) fall outside the caches' pages."""
    if slots.pages is not None:
        check_pages(slots.pages, k_cache.shape[0], func)
    batch = slots.flat.shape[0]
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = new.reshape(batch, cache.shape[2], cache.shape[3])
        if cache.is_contiguous():  # the common layout: one index_copy_ over the flat slots
            cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots.flat, rows)
        else:  # a strided view: indexed by page and offset through its strides
            cache.index_put_((slots.page, slots.offset), rows)


def check_pages(pages: tuple[int, int, int, int], num_pages: int, func: str) -> None:
    """ValueError naming a page id outside ``[0, num_pages)`` that a new token would be written to, and its sequence."""
    low, low_row, high, high_row = pages
    if low >= 0 and high < num_pages:
        return
    bad, row = (low, low_row) if low < 0 else (high, high_row)
    raise ValueError(f"attnsel.{func}: page_table gives page {bad} to a new token of sequence {row} (new k/v are "
                     f"written at each sequence's cache_seqlens), but k_cache/v_cache hold {num_pages} pages; allowed: "
                     f"page ids 0 <= id < {num_pages} wherever a new token goes (a padding row's too: point it at "
                     "a real page)")
