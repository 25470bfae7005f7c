"""A served batch as a validation case: the canary's copy of one layer call's inputs and output, its float32
reference and the validation's check of the output (cases.check_output), so that a served batch is judged by the
same rule as a validation case.

``take`` copies without reading anything on the host (it runs on the serving path, on the canary's side stream on
the GPU); ``reference`` reads the copied metadata on the host and computes the reference per sequence with
``cases.reference_attention`` (float32, and in the spec's dtype for the tolerance, as the validation cases do: over
the paged cache, decode and extend, causal and with fp8 products for an fp8 cache); ``judge`` builds the case of the
phase (prefill, decode, extend) and returns check_output's result, row by row (a query token, all heads).
"""
from __future__ import annotations

import dataclasses

import torch

from ..spec import AttentionSpec
from . import cases, paged_cases, yardstick


@dataclasses.dataclass
class Snapshot:
    """Copies of one layer call. Prefill: meta (cu_q, cu_k), q/k/v as given. Decode: meta (page_table, seq_lens)
    over a compact copy of the caches (only the pages the table's first columns name, row by row: row b's pages
    are b * width ..., the page table renumbered so), q ``[batch, heads, head_dim]``. Extend: meta (cu_q,
    page_table, seq_lens) over the same compact copy, q as given (padding rows included). kwargs: the run's feature
    inputs (sinks, k_scale, v_scale); out: the run's output (decode ``[batch, heads, head_dim]``), or what the run
    returned when it is not a tensor."""

    phase: str
    meta: tuple
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict
    out: object


def take(phase: str, plan_args: tuple, inputs: tuple, kwargs: dict, out, pages: int | None = None) -> Snapshot:
    """Copy one layer call (device work only, no host read). ``plan_args``: prefill (cu_q, cu_k, ...), decode
    (page_table, seq_lens), extend (cu_q, page_table, seq_lens). Decode and extend: ``pages`` (the first page-table
    columns that can hold the batch's tokens, from the plan's host bound; None: every column) are gathered from the
    caches, entries past the cache (sentinels) clamped to a real page (a row never reads past its length)."""
    q = inputs[0]
    copy = {n: t.clone() for n, t in kwargs.items() if isinstance(t, torch.Tensor)}
    if isinstance(out, torch.Tensor):
        out = (out.squeeze(1) if phase == "decode" and out.dim() == 4 else out).clone()
    if phase == "prefill":
        cu_q, cu_k = plan_args[:2]
        return Snapshot(phase, (cu_q.clone(), cu_k.clone()), q.clone(), inputs[1].clone(), inputs[2].clone(),
                        copy, out)
    if phase == "extend":
        cu_q, page_table, seq_lens = plan_args[:3]
        table, k, v = _compact(page_table, inputs[1], inputs[2], pages)
        return Snapshot(phase, (cu_q.clone(), table, seq_lens.clone()), q.clone(), k, v, copy, out)
    page_table, seq_lens = plan_args[:2]
    table, k, v = _compact(page_table, inputs[1], inputs[2], pages)
    q = q.squeeze(1) if q.dim() == 4 else q  # FlashAttention's [batch, 1, heads, head_dim]
    return Snapshot(phase, (table, seq_lens.clone()), q.clone(), k, v, copy, out)


def _compact(page_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: int | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(renumbered page table, k pages, v pages): row b's first ``pages`` columns copied to pages b * width ..."""
    width = page_table.shape[1] if pages is None else min(pages, page_table.shape[1])
    ids = page_table[:, :width].long().clamp(0, max(k_cache.shape[0] - 1, 0)).flatten()
    batch = page_table.shape[0]
    table = torch.arange(batch * width, dtype=torch.int32, device=page_table.device).view(batch, width)
    return table, k_cache[ids], v_cache[ids]


@dataclasses.dataclass
class Reference:
    """The float32 reference of a snapshot's batch and the same computation in the spec's dtype (the tolerance's
    basis), with the metadata read on the host. ``problem``: why the batch cannot be judged (None: it can)."""

    ref: torch.Tensor | None
    low: torch.Tensor | None
    lengths: tuple[list[int], ...]
    problem: str | None = None


def reference(spec: AttentionSpec, snap: Snapshot) -> Reference:
    """Launch the reference of a snapshot (reads its metadata on the host: call it once the copies are done)."""
    dt = spec.torch_dtype
    sinks = snap.kwargs.get("sinks")

    def both(q, k, v):  # the float32 reference and the validation's yardstick, as for a validation case
        args = dict(window=spec.sliding_window, softcap=spec.softcap, sinks=sinks)
        cached = snap.phase != "prefill"  # over the paged cache: causal, fp8 products for an fp8 cache (inputs.py)
        fp8, causal = cached and spec.kv_dtype is not None, spec.causal or cached
        return (yardstick.reference_attention(q, k, v, spec.scale, causal, **args),
                yardstick.careful_attention(q, k, v, spec.scale, causal, dtype=dt, fp8=fp8, **args))

    ref = torch.zeros(snap.q.shape, dtype=torch.float32, device=snap.q.device)
    low = torch.zeros(snap.q.shape, dtype=dt, device=snap.q.device)
    if snap.phase == "prefill":
        cq, ck = (t.tolist() for t in snap.meta)
        if cq[-1] > snap.q.shape[0] or ck[-1] > snap.k.shape[0]:
            return Reference(None, None, (cq, ck), f"cu_seqlens ({cq[-1]} query and {ck[-1]} key tokens) past q "
                                                   f"({snap.q.shape[0]} rows) or k ({snap.k.shape[0]} rows)")
        # rows past the batch's tokens (padding) stay 0 and are not judged (judge)
        for i in range(len(cq) - 1):
            r, lo = both(snap.q[cq[i]:cq[i + 1]], snap.k[ck[i]:ck[i + 1]], snap.v[ck[i]:ck[i + 1]])
            ref[cq[i]:cq[i + 1]], low[cq[i]:cq[i + 1]] = r, lo
        return Reference(ref, low, (cq, ck))
    extend = snap.phase == "extend"
    table, seq_lens = snap.meta[1:] if extend else snap.meta
    lens, ps = seq_lens.tolist(), spec.page_size
    if max(lens, default=0) > table.shape[1] * ps:
        return Reference(None, None, (lens,), f"a row of {max(lens)} tokens, past the plan's bound of "
                                              f"{table.shape[1] * ps} (max_seq_len or longest)")
    # extend: row b's queries are rows cq[b]:cq[b + 1] of q; decode: row b of q
    cq = snap.meta[0].tolist() if extend else list(range(len(lens) + 1))
    if extend and (problem := _extend_problem(cq, lens, snap.q.shape[0])):
        return Reference(None, None, (cq, lens), problem)
    k_scale, v_scale = snap.kwargs.get("k_scale"), snap.kwargs.get("v_scale")
    # take() lays each row's pages out in order (row b: pages b * width ..): a row's tokens are a view
    rows_k, rows_v = (t.view(len(lens), table.shape[1] * ps, *t.shape[2:]) for t in (snap.k, snap.v))
    for b, n in enumerate(lens):  # rows past the batch's queries (extend padding) stay 0 and are not judged
        if cq[b + 1] == cq[b]:
            continue
        k, v = rows_k[b, :n], rows_v[b, :n]
        if k_scale is not None:  # fp8 cache: real value = stored value * scale
            k, v = k.float() * k_scale.float(), v.float() * v_scale.float()
        ref[cq[b]:cq[b + 1]], low[cq[b]:cq[b + 1]] = both(snap.q[cq[b]:cq[b + 1]], k, v)
    return Reference(ref, low, (cq, lens) if extend else (lens,))


def _extend_problem(cq: list[int], lens: list[int], q_rows: int) -> str | None:
    """Why an extend batch's metadata cannot be judged (values check_extend refuses under ATTNSEL_CHECK_METADATA),
    or None."""
    if cq[0] != 0:
        return f"cu_seqlens_q[0] is {cq[0]}, not 0"
    if cq[-1] > q_rows:
        return f"cu_seqlens_q[-1] is {cq[-1]}, past q's {q_rows} rows"
    for b, n in enumerate(lens):
        lq = cq[b + 1] - cq[b]
        if lq < 0 or n < 0:
            return f"row {b} has {lq} queries and a context of {n} tokens"
        if n and lq > n:
            return f"row {b} has {lq} queries but a context of {n} tokens (seq_lens counts the row's queries too)"
    return None


class _ServedPrefill(cases.PrefillCase):
    def describe(self) -> str:
        return f"served prefill batch of {self.cu_q.shape[0] - 1} sequences"


class _ServedDecode(cases.DecodeCase):
    def describe(self) -> str:
        return f"served decode batch of {self.seq_lens.shape[0]} rows"


class _ServedExtend(paged_cases.ExtendCase):
    def describe(self) -> str:
        return f"served extend batch of {self.seq_lens.shape[0]} requests, {int(self.cu_q[-1])} query tokens"


def judge(spec: AttentionSpec, snap: Snapshot, refs: Reference) -> dict:
    """check_output's result for the snapshot's output (status "valid" or "rejected", reason, max_abs_err, ...);
    status "skipped" with a reason where the batch cannot be judged: metadata past the copies, or inputs whose
    float32 reference is not finite (NaN or inf from the model, not from the backend)."""
    if refs.problem:
        return {"status": "skipped", "reason": refs.problem}
    if not bool(torch.isfinite(refs.ref).all()):
        return {"status": "skipped", "reason": "the inputs give a reference with NaN or inf"}
    yard_err = yardstick.row_errors(refs.low, refs.ref)
    if snap.phase == "prefill":
        cq, ck = (torch.tensor(x, dtype=torch.int32) for x in refs.lengths)
        case = _ServedPrefill(cu_q=cq, cu_k=ck, max_q=0, max_k=0, q=snap.q, k=snap.k, v=snap.v, ref=refs.ref,
                              yard_err=yard_err, sinks=snap.kwargs.get("sinks"))
    elif snap.phase == "extend":
        cq, lens = (torch.tensor(x, dtype=torch.int32) for x in refs.lengths)
        case = _ServedExtend(cu_q=cq, page_table=snap.meta[1], seq_lens=lens, max_q=0, max_len=0, q=snap.q,
                             k_cache=snap.k, v_cache=snap.v, ref=refs.ref, yard_err=yard_err,
                             sinks=snap.kwargs.get("sinks"), k_scale=snap.kwargs.get("k_scale"),
                             v_scale=snap.kwargs.get("v_scale"))
    else:
        case = _ServedDecode(page_table=snap.meta[0], seq_lens=torch.tensor(refs.lengths[0], dtype=torch.int32),
                             q=snap.q, k_cache=snap.k, v_cache=snap.v, ref=refs.ref, yard_err=yard_err,
                             sinks=snap.kwargs.get("sinks"), k_scale=snap.kwargs.get("k_scale"),
                             v_scale=snap.kwargs.get("v_scale"))
    out = snap.out
    if snap.phase != "decode" and isinstance(out, torch.Tensor) and out.shape == refs.ref.shape:
        out = out.clone()
        out[refs.lengths[0][-1]:] = 0  # rows past the batch's tokens (padding) hold anything
    return cases.check_output(spec, out, case)
