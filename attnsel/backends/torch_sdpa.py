"""torch: scaled_dot_product_attention per sequence. Runs on CPU and GPU; the universal fallback (every feature).

Plain attention (and sliding windows, as a mask) runs through SDPA in the activation dtype; softcap and sinks, which
SDPA does not take, run through a plain float32 softmax, chunked over queries to bound memory. Decode gathers per
sequence only the slots it owns (only the window's with a sliding window): positions past a sequence's end are
pointed at plan time at the sequence's own first token and masked, so garbage, NaN or out-of-range page-table
entries past a sequence are never read; zero-length rows give zeros.
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


class TorchBackend:
    name = "torch"
    version = torch.__version__
    # decode runs being captured read the metadata on the device (_slots); prefill splits the batch into sequences on
    # the host at plan time
    graph_stale = {"prefill": "its prefill plan splits the batch into sequences on the host: a replay after the engine "
                              "updates cu_seqlens in place would keep the old split"}

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None:
        return None  # every feature: sliding window, softcap, sinks, fp8 KV cache, non-causal

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
        ps, window = spec.page_size, spec.sliding_window
        capacity = page_table.shape[1] * ps
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
            if max_len > capacity:
                raise ValueError(f"page_table has {page_table.shape[1]} pages per sequence, too few for {max_len} "
                                 f"tokens at page_size {ps}")
            planned = _slots(spec, page_table, seq_lens, min(max_len, window) if window is not None else max_len)
        scale = spec.scale
        use_math = spec.softcap is not None or spec.sinks
        fp8 = spec.kv_dtype is not None

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            check_sinks(spec, sinks)
            if fp8 and (k_scale is None or v_scale is None):
                raise ValueError(f"the spec has a {spec.kv_dtype} KV cache: run needs k_scale= and v_scale= "
                                 "(float32 tensors of one element)")
            if not fp8 and (k_scale is not None or v_scale is not None):
                raise ValueError("k_scale/v_scale were passed but the spec has no fp8 KV cache (kv_dtype=None)")
            slots, mask, live = (_slots(spec, page_table, seq_lens, captured_width)
                                 if planned is None or capturing(q) else planned)
            kvh, d = k_cache.shape[-2:]
            dtype = torch.float32 if use_math else q.dtype  # the math path computes in float32 anyway
            k = dequantised(k_cache.reshape(-1, kvh, d)[slots], k_scale, dtype).transpose(1, 2)  # [B, KVH, W, D]
            v = dequantised(v_cache.reshape(-1, kvh, d)[slots], v_scale, dtype).transpose(1, 2)
            if use_math:
                out = attend_math(q[:, :, None], k, v, scale, mask=mask, softcap=spec.softcap, sinks=sinks)
            else:
                out = sdpa(q[:, :, None], k, v, scale, mask=mask)
            return torch.where(live, out[:, :, 0], torch.zeros((), dtype=out.dtype, device=out.device))

        return run


def _slots(spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor, width: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat cache slots [B, W], key mask [B, 1, 1, W], live rows [B, 1, 1]) of each row's last ``width`` tokens (its
    window), computed on the device from the metadata (no host read). Positions past a sequence's end repeat its
    first token (its own, finite data, masked out), so neither a page-table entry past the sequence nor an unused slot
    is ever read; zero-length rows read slot 0 and their output is replaced by zeros."""
    ps, window = spec.page_size, spec.sliding_window
    lens = seq_lens.long()[:, None]
    start = (lens - window).clamp(min=0) if window is not None else torch.zeros_like(lens)
    count = lens - start
    t = torch.arange(max(width, 1), device=seq_lens.device)
    owned = t < count  # [B, W]: the slots of the sequence (of its window)
    live = count > 0
    pos = torch.where(owned, start + t, start)
    if page_table.shape[1]:
        page = page_table.long().gather(1, torch.where(live, pos // ps, 0))
    else:  # no pages at all: every row has length 0
        page = torch.zeros_like(pos)
    slots = torch.where(live, page * ps + pos % ps, 0)
    return slots, (owned | ~live)[:, None, None, :], live[:, :, None]


BACKEND = TorchBackend()
