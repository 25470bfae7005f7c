"""The timing's spot check: a timed output compared with the float32 reference on sampled rows, each row against its
own tolerance (yardstick.py), so that a candidate fast because it is wrong gets no time in a bucket."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..spec import AttentionSpec
from .extend_grid import extend_spot_rows
from .inputs import _attention
from .yardstick import row_errors, row_tolerance, worst_row

SPOT_SEQS = 4  # timed outputs: sequences checked per prefill batch
SPOT_ROWS = 16  # ... query rows at each end of a checked sequence
SPOT_DECODE_ROWS = 8  # ... decode rows checked per batch


def _spread(n: int, k: int) -> list[int]:
    """Up to k indices spread over range(n), first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


@dataclasses.dataclass
class SpotReference:
    """The float32 reference of sampled rows of one timing workload: rows (index into the output's first dim),
    ref ``[rows, H, D]`` float32, tol ``[rows]`` (each row's tolerance, as for the validation cases), tokens (the
    output's expected first dim)."""

    rows: torch.Tensor
    ref: torch.Tensor
    tol: torch.Tensor
    tokens: int


def spot_reference(spec: AttentionSpec, phase: str, plan_args: tuple, inputs: tuple, kwargs: dict) -> SpotReference:
    """The reference of sampled rows of a timed output (a timing workload, not a validation case).

    The timing runs a plan many times, on shapes the validation case does not have, under CUDA-graph replay: a kernel
    that is fast there because it skips work, or that reuses stale state, must not win a bucket. Sampled: prefill,
    SPOT_SEQS sequences spread over the batch plus the longest, SPOT_ROWS query rows at each end of each; decode,
    SPOT_DECODE_ROWS rows spread over the batch. Computed once per bucket and input set, shared by the candidates.
    plan_args/inputs: prefill ``(cu_q, cu_k, max_q, max_k)`` / ``(q, k, v)``; decode ``(page_table, seq_lens)`` /
    ``(q, k_cache, v_cache)``. kwargs: the run's feature inputs (sinks, k_scale, v_scale).
    """
    sinks = kwargs.get("sinks")
    rows, refs, lows = [], [], []
    if phase == "extend":
        rows, refs, lows = extend_spot_rows(spec, plan_args, inputs, kwargs)
    elif phase == "prefill":
        cq, ck = plan_args[0].tolist(), plan_args[1].tolist()
        q, k, v = inputs
        lens = [cq[i + 1] - cq[i] for i in range(len(cq) - 1)]
        picked_seqs = set(_spread(len(lens), SPOT_SEQS))
        if lens:
            picked_seqs.add(max(range(len(lens)), key=lambda i: lens[i]))
        for b in sorted(picked_seqs):
            lq, lk = lens[b], ck[b + 1] - ck[b]
            picked = sorted(set(range(min(SPOT_ROWS, lq))) | set(range(max(0, lq - SPOT_ROWS), lq)))
            for a, e in _runs(picked):  # contiguous query rows [a, e): keys up to the last of them when causal
                kq = q[cq[b] + a: cq[b] + e]
                masked = spec.causal or spec.sliding_window is not None
                kend = ck[b] + (min(lk, max(0, lk - lq + e)) if masked else lk)
                kk, vv = k[ck[b]:kend], v[ck[b]:kend]
                rows.append(torch.arange(cq[b] + a, cq[b] + e))
                ref, low = _attention(spec, kq, kk, vv, sinks)
                refs.append(ref)
                lows.append(low)
    else:
        page_table, seq_lens = plan_args
        q, k_cache, v_cache = inputs
        ps, lens = spec.page_size, seq_lens.tolist()
        k_scale, v_scale = kwargs.get("k_scale"), kwargs.get("v_scale")
        for b in _spread(len(lens), SPOT_DECODE_ROWS):
            pages = page_table[b, :math.ceil(lens[b] / ps)].long()
            kk = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:lens[b]].float()
            vv = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:lens[b]].float()
            if k_scale is not None:
                kk, vv = kk * k_scale.float(), vv * v_scale.float()
            rows.append(torch.tensor([b]))
            ref, low = _attention(spec, q[b:b + 1], kk, vv, sinks, cache=True)
            refs.append(ref)
            lows.append(low)
    if not rows:
        empty = torch.zeros(0, dtype=torch.long)
        return SpotReference(empty, torch.zeros(0, spec.num_q_heads, spec.head_dim), torch.zeros(0),
                             inputs[0].shape[0])
    ref, low = torch.cat(refs), torch.cat(lows)
    return SpotReference(torch.cat(rows).to(ref.device), ref, row_tolerance(spec, row_errors(low, ref)),
                         inputs[0].shape[0])


def spot_compare(reference: SpotReference, out) -> str | None:
    """Why a timed output is wrong on the reference's rows (shape, NaN/inf, error above the tolerance), or None."""
    expected = (reference.tokens, *reference.ref.shape[1:])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"output shape {got}, expected {expected}"
    if not reference.rows.numel():
        return None
    got = out[reference.rows].float()
    if not torch.isfinite(got).all():
        bad = reference.rows[~torch.isfinite(got).flatten(1).all(1)].tolist()[:4]
        return f"NaN or inf in the output (rows {bad})"
    err = row_errors(got, reference.ref)
    if not (err <= reference.tol).all():
        i = worst_row(err, reference.tol)
        return (f"max abs error {float(err[i]):.3g} exceeds tolerance {float(reference.tol[i]):.3g} in row "
                f"{int(reference.rows[i])} (that row's tolerance; {int((~(err <= reference.tol)).sum())} of "
                f"{err.numel()} sampled rows beyond theirs)")
    return None


def spot_check(spec: AttentionSpec, phase: str, plan_args: tuple, inputs: tuple, out: torch.Tensor,
               kwargs: dict) -> str | None:
    """``spot_compare(spot_reference(...), out)``: why a timed output is wrong on sampled rows, or None."""
    return spot_compare(spot_reference(spec, phase, plan_args, inputs, kwargs), out)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as half-open runs of consecutive values: [0, 1, 2, 7, 8] -> [(0, 3), (7, 9)]."""
    runs = []
    for x in values:
        if runs and runs[-1][1] == x:
            runs[-1] = (runs[-1][0], x + 1)
        else:
            runs.append((x, x + 1))
    return runs
