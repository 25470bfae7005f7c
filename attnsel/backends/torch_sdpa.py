"""torch: scaled_dot_product_attention per sequence. Runs on CPU and GPU; the reference and universal fallback."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import AttentionSpec
from . import Phase, RunFn

_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


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


def causal_mask(len_q: int, len_k: int, device: torch.device) -> torch.Tensor | None:
    """Bottom-right aligned causal mask (queries are the last len_q of len_k tokens); None when SDPA's own works."""
    if len_q == len_k:
        return None
    return torch.ones(len_q, len_k, dtype=torch.bool, device=device).tril(diagonal=len_k - len_q)


def seq_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) per sequence; ValueError where a sequence has more queries than keys."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries but cu_seqlens_k has {len(ck)}")
    bounds = []
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq < 0 or lk < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing (sequence {i})")
        if lq > lk:
            raise ValueError(f"sequence {i} has {lq} query tokens but only {lk} key tokens")
        bounds.append((cq[i], cq[i + 1], ck[i], ck[i + 1]))
    return bounds


class TorchBackend:
    name = "torch"
    version = torch.__version__

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None:
        return None

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        bounds = seq_bounds(cu_seqlens_q, cu_seqlens_k)
        device = cu_seqlens_q.device
        masks = [causal_mask(qe - qs, ke - ks, device) if spec.causal else None for qs, qe, ks, ke in bounds]
        scale = spec.scale

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(q)
            for (qs, qe, ks, ke), mask in zip(bounds, masks):
                if qe == qs:
                    continue
                o = sdpa(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                         v[ks:ke].transpose(0, 1)[None], scale, is_causal=spec.causal and mask is None, mask=mask)
                out[qs:qe] = o[0].transpose(0, 1)
            return out

        return run

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        lens = seq_lens.tolist()
        if min(lens, default=1) < 1:
            raise ValueError("seq_lens must be >= 1 for decode (the cache holds the new token)")
        max_len = max(lens, default=1)
        ps = spec.page_size
        if max_len > page_table.shape[1] * ps:
            raise ValueError(f"page_table has {page_table.shape[1]} pages per sequence, too few for {max_len} "
                             f"tokens at page_size {ps}")
        t = torch.arange(max_len, device=page_table.device)
        slots = page_table[:, t // ps].long() * ps + t % ps  # [B, L] flat slot of each token
        mask = (t[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        scale = spec.scale

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            kvh, d = k_cache.shape[-2:]
            k = k_cache.reshape(-1, kvh, d)[slots].transpose(1, 2)  # [B, KVH, L, D]
            v = v_cache.reshape(-1, kvh, d)[slots].transpose(1, 2)
            return sdpa(q[:, :, None], k, v, scale, mask=mask)[:, :, 0]

        return run


BACKEND = TorchBackend()
