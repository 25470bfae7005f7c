"""How far from the float32 reference a right output may be: the reference, the yardstick, the tolerance of each row.

Reference: ``reference_attention`` in float32 on the case's inputs, with every feature of the spec.

Yardstick: ``careful_attention``, what a careful kernel computes in the spec's dtype, no backend involved: inputs in
the dtype; scores, softcap, mask and the softmax statistics (row max, row sum) in float32; the unnormalised
probabilities exp(s - max) rounded to the dtype before P @ V, accumulated in float32 (FlashAttention 2/3, FlashInfer's
tensor-core prefill and our Triton kernels feed P to the P @ V MMA in the activation dtype); the output divided by the
float32 row sum and rounded to the dtype. A plain computation in the dtype (scores rounded to bf16, softmax in bf16)
is no yardstick: with a softcap the scores reach the cap (~50), bf16 rounds them by ~0.1 and the tolerance came out
larger than the outputs, letting a backend that ignores softmax_scale through.

Rows: a row is one query token with all its heads (decode: one sequence). Each row is judged against the
yardstick's error on that row: ``TOL_FACTOR x row error + TOL_FLOOR[dtype]``. One number for the whole case lets its
loosest row (a short one, whose output is a value of V, rounded at its magnitude) set the tolerance of a long one
(an average near zero), where dropping keys stays under it. Per token, not per token and head: the heads of a token
see the same keys and positions, so their errors come from one distribution, and the maximum over H x D elements is a
stable measure of it; the D elements of one head can round luckily and give a tolerance at the floor that a right
kernel rounding in another order exceeds.

Across candidates, ``outlier_reason`` rejects an error far above the best valid candidate's (applied by the selection
layer). Its limit (OUTLIER_FACTOR x the best's case-wide error + the floor) is above every row's tolerance unless the
best candidate beats the yardstick by more than 2x on a row: a backstop, the rows' check decides.
"""
from __future__ import annotations

import torch

from ..spec import AttentionSpec

TOL_FACTOR = 4.0
TOL_FLOOR = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}
FP8_MAX = 448.0  # the largest finite e4m3 value
OUTLIER_FACTOR = 8.0  # an error this many times the best valid candidate's (plus the floor) is rejected


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, window: int | None,
            softcap: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Scores ``[H, Lq, Lk]`` in ``dtype``: scaled, softcapped, masked with -inf (bottom-right)."""
    lq, heads, d = q.shape
    lk, kvh = k.shape[0], k.shape[1]
    q, k = q.to(dtype).transpose(0, 1), k.to(dtype).transpose(0, 1)  # [H, Lq, D], [KVH, Lk, D]
    # query head h reads KV head h // group: the heads of one group as rows of one matmul (no copy of K per head)
    scores = (q.reshape(kvh, (heads // kvh) * lq, d) @ k.transpose(1, 2)).view(heads, lq, lk) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal or window is not None:
        i = torch.arange(lk - lq, lk, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        keep = j <= i
        if window is not None:
            keep &= j > i - window
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _times_v(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs ``[H, Lq, Lk]`` @ v ``[Lk, KVH, Dv]`` (v already in the matmul's dtype) -> ``[Lq, H, Dv]``."""
    heads, lq, lk = probs.shape
    kvh = v.shape[1]
    out = probs.reshape(kvh, (heads // kvh) * lq, lk) @ v.transpose(0, 1)  # [KVH, G * Lq, Dv]
    return out.view(heads, lq, v.shape[-1]).transpose(0, 1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, *,
                        window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain softmax(q k^T) v for one sequence computed in ``dtype`` (float32: the reference); returns ``[Lq, H, D]``.

    q ``[Lq, H, D]``, k/v ``[Lk, KVH, D]`` (GQA). The queries are the last Lq of the Lk positions (bottom-right).
    Query at absolute position i sees key j when j <= i (causal or window) and i - window < j (window: exactly
    ``window`` keys, itself included). softcap: scores (after the scale) become ``softcap * tanh(scores / softcap)``.
    sinks ``[H]``: one extra logit per head in the softmax denominator, with no value. Lk == 0 gives zeros.
    """
    lq, heads, lk = q.shape[0], q.shape[1], k.shape[0]
    if lk == 0:
        return torch.zeros(lq, heads, v.shape[-1], dtype=dtype, device=q.device)
    scores = _scores(q, k, scale, causal, window, softcap, dtype)
    if sinks is not None:
        sink_col = sinks.to(device=q.device, dtype=dtype)[:, None, None].expand(heads, lq, 1)
        probs = torch.cat([scores, sink_col], -1).softmax(-1)[..., :lk]
    else:
        probs = scores.softmax(-1)
    # a query that sees no key (the first queries of a row with fewer keys than queries) and no sink: zeros, as the
    # backends give (softmax over nothing but -inf is NaN)
    return _times_v(probs.nan_to_num(nan=0.0), v.to(dtype))


def careful_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, *,
                      window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                      dtype: torch.dtype, fp8: bool = False) -> torch.Tensor:
    """The yardstick: attention of one sequence as a careful kernel computes it in ``dtype`` (module docstring);
    float32 ``[Lq, H, D]`` holding values of ``dtype``. Arguments as ``reference_attention``'s; k/v are rounded to
    ``dtype`` (fp8 caches: their dequantised values). ``fp8`` (an fp8 KV cache): both products in fp8 e4m3, as a
    kernel that runs its tensor cores on the fp8 cache does (FA3): q quantised with one scale per token and KV-head
    group (amax / 448) and P rounded to e4m3. A row that sees no key and no sink gives zeros."""
    lq, heads, lk = q.shape[0], q.shape[1], k.shape[0]
    if lk == 0:
        return torch.zeros(lq, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    q, k, v = (t.to(dtype).float() for t in (q, k, v))
    p_dtype = torch.float8_e4m3fn if fp8 else dtype
    if fp8:
        grouped = q.view(lq, k.shape[1], heads // k.shape[1], q.shape[-1])
        q_scale = (grouped.abs().amax(dim=(2, 3), keepdim=True) / FP8_MAX).clamp_min(1e-12)
        q = ((grouped / q_scale).to(torch.float8_e4m3fn).float() * q_scale).view(lq, heads, q.shape[-1])
    scores = _scores(q, k, scale, causal, window, softcap, torch.float32)
    top = scores.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(device=q.device, dtype=torch.float32)[:, None, None]
        top = torch.maximum(top, sink)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a row that sees nothing: every weight exp(-inf) = 0
    weights = torch.exp(scores - top)
    denom = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - top)
    probs = weights.to(p_dtype).float() / torch.where(denom > 0, denom, 1.0)  # P rounded, 1 / row sum in float32
    return _times_v(probs, v).to(dtype).float()


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Max abs error of each row (the first dim) over the others, float32 ``[rows]``; NaN or inf in a row: inf."""
    if not out.shape[0]:
        return torch.zeros(0, device=ref.device)
    err = (out.float() - ref).abs().flatten(1)
    err = err.nan_to_num(nan=float("inf"))
    return err.amax(1) if err.shape[1] else torch.zeros(err.shape[0], device=err.device)


def row_tolerance(spec: AttentionSpec, yard_err: torch.Tensor) -> torch.Tensor:
    """Each row's tolerance from the yardstick's error on that row."""
    return TOL_FACTOR * yard_err + TOL_FLOOR[spec.dtype]


def worst_row(err: torch.Tensor, tol: torch.Tensor) -> int:
    """The row whose error is largest against its tolerance (tolerances are positive: the floor)."""
    return int((err / tol).argmax())


def outlier_reason(err: float, best_err: float, spec: AttentionSpec) -> str | None:
    """Cross-candidate rule: an error far larger than the best valid candidate's on the same case is rejected even
    within tolerance (a real bug hiding under a loose tolerance). None when ``err`` is acceptable."""
    limit = OUTLIER_FACTOR * best_err + TOL_FLOOR[spec.dtype]
    if err > limit:
        return (f"max abs error {err:.3g} is far above the best candidate's {best_err:.3g} (limit "
                f"{OUTLIER_FACTOR:g} x best + {TOL_FLOOR[spec.dtype]:g})")
    return None
