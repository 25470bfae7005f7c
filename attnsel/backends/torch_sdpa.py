"""torch: scaled_dot_product_attention per sequence. Runs on CPU and GPU; the universal fallback (every feature).

Plain attention (and sliding windows, as a mask) runs through SDPA in the activation dtype; softcap and sinks, which
SDPA does not take, run through a plain float32 softmax, chunked over queries to bound memory. Decode gathers per
sequence only the slots it owns (only the window's with a sliding window): positions past a sequence's end are
pointed at plan time at the sequence's own first token and masked, so garbage, NaN or out-of-range page-table
entries past a sequence are never read; zero-length rows give zeros. Extend (ragged queries over the paged cache) is
decode with several queries per row: the same slot gather and attention (``_slots``, ``attend_paged``), one row at a
time, each row's keys only those its queries can see, its queries aligned bottom-right.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import AttentionSpec
from . import Phase, RunFn
from .support import capturing

_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
MATH_CHUNK_ELEMS = 1 << 26  # float32 scores per chunk of the softcap/sinks path (256 MiB)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, is_causal: bool = False,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on ``[B, H, S, D]`` tensors with GQA (k/v may have fewer heads)."""
    if k.shape[1] != q.shape[1]:
        if _HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, mask: torch.Tensor | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap(q k^T * scale)) v in float32 with sink logits in the denominator; result in q's dtype.

    q ``[B, H, Lq, D]``, k/v ``[B, KVH, Lk, D]`` (GQA), mask bool broadcastable to ``[B, 1, Lq, Lk]`` (True: the key
    is seen) or None, sinks float32 ``[H]`` or None. Every query row must see at least one key.
    """
    b, heads, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    group = heads // kvh
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # [B, KVH, 1, Lk, D]
    sink = sinks.float().reshape(1, kvh, group, 1, 1) if sinks is not None else None
    step = max(1, MATH_CHUNK_ELEMS // max(1, b * heads * lk))
    out = torch.empty_like(q)
    for s0 in range(0, lq, step):
        chunk = q[:, :, s0:s0 + step]
        qf = chunk.float().reshape(b, kvh, group, chunk.shape[2], d)  # explicit rows: -1 is ambiguous at batch 0
        scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, KVH, G, chunk, Lk]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask[..., s0:s0 + step, :][:, :, None], float("-inf"))
        top = scores.amax(-1, keepdim=True)
        if sink is not None:
            top = torch.maximum(top, sink)
        weights = torch.exp(scores - top)
        denom = weights.sum(-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - top)
        o = (weights @ vf) / denom  # [B, KVH, G, chunk, D]
        out[:, :, s0:s0 + step] = o.view(b, heads, chunk.shape[2], d).to(q.dtype)
    return out


def visible(spec: AttentionSpec, len_q: int, len_k: int, device: torch.device) -> torch.Tensor | None:
    """``[len_q, len_k]`` bool, True where a query (the last len_q of len_k positions: bottom-right) sees a key:
    causal, and with a sliding window w the w keys ending at the query itself. None when every key is seen."""
    if not spec.causal and spec.sliding_window is None:
        return None
    i = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    keep = j <= i
    if spec.sliding_window is not None:
        keep &= j > i - spec.sliding_window
    return keep


def seq_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) per sequence. A sequence may have more queries than keys (non-causal:
    cross-attention; causal: its first queries see no key and, as in FlashAttention, give zeros)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries but cu_seqlens_k has {len(ck)}")
    bounds = []
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq < 0 or lk < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing (sequence {i})")
        bounds.append((cq[i], cq[i + 1], ck[i], ck[i + 1]))
    return bounds


def check_sinks(spec: AttentionSpec, sinks: torch.Tensor | None) -> None:
    if spec.sinks and sinks is None:
        raise ValueError(f"the spec has attention sinks: run needs sinks=, a float32 tensor [{spec.num_q_heads}]")
    if not spec.sinks and sinks is not None:
        raise ValueError("sinks were passed but the spec has sinks=False")
    if sinks is not None and tuple(sinks.shape) != (spec.num_q_heads,):
        raise ValueError(f"sinks must have shape [{spec.num_q_heads}] (one per query head), got {tuple(sinks.shape)}")


def dequantised(cache_rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in ``dtype``; fp8 rows are multiplied by their per-tensor scale (a device tensor, no sync)."""
    if scale is None:
        return cache_rows.to(dtype)
    return (cache_rows.float() * scale.float()).to(dtype)


def check_scales(spec: AttentionSpec, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """The run-time k_scale/v_scale: both given exactly when the spec has an fp8 KV cache."""
    fp8 = spec.kv_dtype is not None
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError(f"the spec has a {spec.kv_dtype} KV cache: run needs k_scale= and v_scale= "
                         "(float32 tensors of one element)")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale/v_scale were passed but the spec has no fp8 KV cache (kv_dtype=None)")


class TorchBackend:
    name = "torch"
    version = torch.__version__
    # decode runs being captured read the metadata on the device (_slots); prefill and extend split the batch into
    # sequences on the host at plan time
    graph_stale = {"prefill": "its prefill plan splits the batch into sequences on the host: a replay after the engine "
                              "updates cu_seqlens in place would keep the old split",
                   "extend": "its extend plan splits the batch into rows on the host and gathers each row's slots at "
                             "plan time: a replay after the engine updates cu_seqlens_q, seq_lens or page_table in "
                             "place would keep the old rows"}

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None:
        return None  # every feature in every phase: sliding window, softcap, sinks, fp8 KV cache, non-causal

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        bounds = seq_bounds(cu_seqlens_q, cu_seqlens_k)
        device = cu_seqlens_q.device
        scale = spec.scale
        use_math = spec.softcap is not None or spec.sinks
        plans = []  # (bounds, mask, is_causal, rows that see a key or None for all) per sequence
        for qs, qe, ks, ke in bounds:
            lq, lk = qe - qs, ke - ks
            if not use_math and spec.sliding_window is None and (not spec.causal or lq == lk):
                plans.append(((qs, qe, ks, ke), None, spec.causal, None))  # SDPA's own (top-left = bottom-right)
            else:
                mask = visible(spec, lq, lk, device)
                seen = None if mask is None or lq <= lk else mask.any(-1)[:, None, None]  # [lq, 1, 1]
                plans.append(((qs, qe, ks, ke), None if mask is None else mask[None, None], False, seen))

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
            check_sinks(spec, sinks)
            out = torch.empty_like(q)
            for (qs, qe, ks, ke), mask, is_causal, seen in plans:
                if qe == qs:
                    continue
                if ke == ks:  # no keys at all: zeros (FlashAttention's output for a row that sees nothing)
                    out[qs:qe] = 0
                    continue
                qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
                if use_math:
                    o = attend_math(qb, kb, vb, scale, mask=mask, softcap=spec.softcap, sinks=sinks)
                else:
                    o = sdpa(qb, kb, vb, scale, is_causal=is_causal, mask=mask)
                o = o[0].transpose(0, 1)
                out[qs:qe] = o if seen is None else torch.where(seen, o, torch.zeros((), dtype=o.dtype,
                                                                                     device=o.device))
            return out

        return run

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        window = spec.sliding_window
        capacity = page_table.shape[1] * spec.page_size
        captured_width = min(capacity, window) if window is not None else capacity
        # eager runs read the slots of this plan's lengths; a run being captured computes them from the lengths and
        # page table of each replay (the CUDA-graph contract), over the table's whole capacity. A plan made during
        # capture reads nothing on the host: every run of it is captured.
        planned = None
        if not capturing(seq_lens):
            lens = seq_lens.tolist()
            if min(lens, default=0) < 0:
                raise ValueError(f"seq_lens must be >= 0 (0: a padding row with zero output), got {min(lens)}")
            max_len = max(lens, default=0)
            _check_capacity(max_len, page_table, spec.page_size)
            planned = _slots(spec.page_size, page_table, seq_lens, min(max_len, window) if window else max_len,
                             window)

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            check_sinks(spec, sinks)
            check_scales(spec, k_scale, v_scale)
            page, off, mask, live = (_slots(spec.page_size, page_table, seq_lens, captured_width, window)
                                     if planned is None or capturing(q) else planned)
            out = attend_paged(spec, q[:, :, None], k_cache, v_cache, page, off, mask, sinks, k_scale, v_scale)
            return torch.where(live, out[:, :, 0], torch.zeros((), dtype=out.dtype, device=out.device))

        return run

    def plan_extend(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor, max_seqlen_q: int, max_seq_len: int) -> RunFn:
        """Per row, the keys its queries can see (its last q_len + window - 1 tokens, or all), gathered from its own
        pages at plan time; its queries (the row's last tokens) attend bottom-right. Rows without queries or keys
        give zeros, as do queries before the row's first key."""
        rows = extend_rows(cu_seqlens_q, page_table, seq_lens, spec.page_size, max_seqlen_q, max_seq_len)
        window = spec.sliding_window
        plans = []  # (q_start, q_end, pages, offsets, mask, queries that see a key or None for all) per row
        for b, (qs, qe, n) in enumerate(rows):
            lq = qe - qs
            if lq == 0 or n == 0:
                continue  # no queries, or no keys: zeros
            count = min(n, lq + window - 1) if window is not None else n
            page, off, _, _ = _slots(spec.page_size, page_table[b:b + 1], seq_lens[b:b + 1], count, count)
            mask = visible(spec, lq, count, page.device)
            seen = None if mask is None or lq <= n else mask.any(-1)[:, None, None]  # [lq, 1, 1]
            plans.append((qs, qe, page, off, None if mask is None else mask[None, None], seen))

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            check_sinks(spec, sinks)
            check_scales(spec, k_scale, v_scale)
            out = torch.zeros_like(q)
            for qs, qe, page, off, mask, seen in plans:
                o = attend_paged(spec, q[qs:qe].transpose(0, 1)[None], k_cache, v_cache, page, off, mask, sinks,
                                 k_scale, v_scale)[0].transpose(0, 1)
                out[qs:qe] = o if seen is None else torch.where(seen, o, torch.zeros((), dtype=o.dtype,
                                                                                     device=o.device))
            return out

        return run


def attend_paged(spec: AttentionSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page: torch.Tensor, off: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
    """Attention of q ``[B, H, Lq, D]`` over the cache slots (page, offset) ``[B, W]`` of each row, dequantised
    (fp8) and masked with ``mask`` (bool, broadcastable to ``[B, 1, Lq, W]``, True: seen; None: all); ``[B, H, Lq,
    D]``. Every query row must see at least one key (the caller replaces those that do not)."""
    use_math = spec.softcap is not None or spec.sinks
    dtype = torch.float32 if use_math else q.dtype  # the math path computes in float32 anyway
    # indexed by (page, offset), not through a flat view: a cache that is a strided view is not copied whole
    k = dequantised(k_cache[page, off], k_scale, dtype).transpose(1, 2)  # [B, KVH, W, D]
    v = dequantised(v_cache[page, off], v_scale, dtype).transpose(1, 2)
    if use_math:
        return attend_math(q, k, v, spec.scale, mask=mask, softcap=spec.softcap, sinks=sinks)
    return sdpa(q, k, v, spec.scale, mask=mask)


def extend_rows(cu_seqlens_q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                max_seqlen_q: int, max_seq_len: int) -> list[tuple[int, int, int]]:
    """(q_start, q_end, seq_len) per row of an extend batch, read on the host, with every bound checked."""
    batch = seq_lens.numel()
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    if cu_seqlens_q.dim() != 1 or len(cq) != batch + 1:
        raise ValueError(f"cu_seqlens_q must have batch + 1 = {batch + 1} entries (seq_lens has {batch}), got "
                         f"shape {tuple(cu_seqlens_q.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be [batch={batch}, max_pages], got {tuple(page_table.shape)}")
    rows = []
    for b in range(batch):
        lq, n = cq[b + 1] - cq[b], lens[b]
        if lq < 0:
            raise ValueError(f"cu_seqlens_q must be non-decreasing (row {b}: {cq[b]} then {cq[b + 1]})")
        if n < 0:
            raise ValueError(f"seq_lens must be >= 0 (0: a padding row with zero output), got {n} in row {b}")
        if lq > max_seqlen_q:
            raise ValueError(f"row {b} has {lq} queries, more than max_seqlen_q={max_seqlen_q}")
        if n > max_seq_len:
            raise ValueError(f"row {b} has seq_len {n}, more than max_seq_len={max_seq_len}")
        rows.append((cq[b], cq[b + 1], n))
    _check_capacity(max(lens, default=0), page_table, page_size)
    return rows


def _check_capacity(max_len: int, page_table: torch.Tensor, page_size: int) -> None:
    if max_len > page_table.shape[1] * page_size:
        raise ValueError(f"page_table has {page_table.shape[1]} pages per sequence, too few for {max_len} tokens "
                         f"at page_size {page_size}")


def _slots(page_size: int, page_table: torch.Tensor, seq_lens: torch.Tensor, width: int, back: int | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pages [B, W], offsets in the page [B, W], key mask [B, 1, 1, W], live rows [B, 1, 1]) of each row's last
    ``back`` tokens (None: all; decode: its window), computed on the device from the metadata (no host read).
    Positions past a sequence's end repeat its first token (its own, finite data, masked out), so neither a
    page-table entry past the sequence nor an unused slot is ever read; zero-length rows read slot 0 of page 0 and
    their output is replaced by zeros."""
    lens = seq_lens.long()[:, None]
    start = (lens - back).clamp(min=0) if back is not None else torch.zeros_like(lens)
    count = lens - start
    t = torch.arange(max(width, 1), device=seq_lens.device)
    owned = t < count  # [B, W]: the slots of the sequence (of its last `back` tokens)
    live = count > 0
    pos = torch.where(owned, start + t, start)
    if page_table.shape[1]:
        page = page_table.long().gather(1, torch.where(live, pos // page_size, 0))
    else:  # no pages at all: every row has length 0
        page = torch.zeros_like(pos)
    page = torch.where(live, page, 0)
    off = torch.where(live, pos % page_size, 0)
    return page, off, (owned | ~live)[:, None, None, :], live[:, :, None]


BACKEND = TorchBackend()
