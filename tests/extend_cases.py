"""Extend batches with traps, and their float32 reference, for the extend tests (CPU and GPU).

A batch is a list of rows (q_len, seq_len): row b's queries are the last q_len of its seq_len tokens, all of them in a
paged cache of shuffled pages. Traps: unused slots hold NaN and inf (fp8: NaN, e4m3 has no inf), unused page-table
columns hold a sentinel (-1 or num_pages), q rows past the batch's last query hold NaN (padding; their output is
unspecified). The reference is built here, independently of any backend: each row's keys straight from the values
written into the cache, dequantised, and ``yardstick.reference_attention`` in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnsel.spec import AttentionSpec
from attnsel.validate import yardstick

Q_PADDING = 3  # q rows past cu_seqlens_q[-1]


@dataclass
class ExtendBatch:
    rows: list[tuple[int, int]]
    q: torch.Tensor  # [total_q + Q_PADDING, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor  # int32 [batch, width]
    seq_lens: torch.Tensor  # int32 [batch]
    cu_seqlens_q: torch.Tensor  # int32 [batch + 1]
    keys: list[torch.Tensor]  # per row, float32 [seq_len, KVH, D]: the real (dequantised) keys
    values: list[torch.Tensor]
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def total_q(self) -> int:
        return int(self.cu_seqlens_q[-1])

    @property
    def max_seqlen_q(self) -> int:
        return max((q for q, _ in self.rows), default=0)

    @property
    def max_seq_len(self) -> int:
        return max((n for _, n in self.rows), default=0)

    def plan_args(self) -> tuple:
        return (self.cu_seqlens_q, self.page_table, self.seq_lens, self.max_seqlen_q, self.max_seq_len)

    def run_kwargs(self) -> dict:
        kwargs = {}
        if self.sinks is not None:
            kwargs["sinks"] = self.sinks
        if self.k_scale is not None:
            kwargs.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return kwargs


def make_batch(spec: AttentionSpec, rows: list[tuple[int, int]], *, seed: int = 0, sentinel: str = "-1",
               device: torch.device | str = "cpu", spare_pages: int = 3) -> ExtendBatch:
    """The batch of ``rows`` (q_len, seq_len) for ``spec`` with the traps of the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    ps, kvh, d, heads = spec.page_size, spec.num_kv_heads, spec.head_dim, spec.num_q_heads
    pages_per_row = [math.ceil(n / ps) for _, n in rows]
    num_pages = sum(pages_per_row) + spare_pages
    width = max(pages_per_row, default=0) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    fp8 = spec.kv_dtype is not None
    store = spec.kv_torch_dtype
    k_cache = torch.empty(num_pages, ps, kvh, d, dtype=torch.float32)
    v_cache = torch.empty_like(k_cache)
    # unused slots: NaN and inf alternating by page (fp8 has no inf: NaN there)
    for p in range(num_pages):
        fill = float("nan") if p % 2 or fp8 else float("inf")
        k_cache[p], v_cache[p] = fill, -fill if fill == float("inf") else fill
    fill = -1 if sentinel == "-1" else num_pages
    table = torch.full((len(rows), width), fill, dtype=torch.int32)
    k_scale = torch.tensor([0.02], dtype=torch.float32) if fp8 else None
    v_scale = torch.tensor([0.03], dtype=torch.float32) if fp8 else None
    keys, values, next_page = [], [], 0
    for b, (lq, n) in enumerate(rows):
        k = torch.randn(n, kvh, d, generator=gen)
        v = torch.randn(n, kvh, d, generator=gen)
        if fp8:  # stored / scale in e4m3; the real keys are the stored values times the scale
            k = (k / k_scale).to(store).float() * k_scale
            v = (v / v_scale).to(store).float() * v_scale
        else:
            k, v = k.to(spec.torch_dtype).float(), v.to(spec.torch_dtype).float()
        keys.append(k)
        values.append(v)
        for i in range(pages_per_row[b]):
            page = order[next_page]
            next_page += 1
            table[b, i] = page
            rows_in = slice(i * ps, min(n, (i + 1) * ps))
            used = rows_in.stop - rows_in.start
            k_cache[page, :used] = k[rows_in] / (k_scale if fp8 else 1.0)
            v_cache[page, :used] = v[rows_in] / (v_scale if fp8 else 1.0)
    total_q = sum(q for q, _ in rows)
    q = torch.randn(total_q + Q_PADDING, heads, d, generator=gen).to(spec.torch_dtype)
    q[total_q:] = float("nan")
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([lq for lq, _ in rows], dtype=torch.int32), 0)
    sinks = (torch.randn(heads, generator=gen) * 2).float() if spec.sinks else None
    dev = torch.device(device)
    return ExtendBatch(
        rows=list(rows), q=q.to(dev), k_cache=k_cache.to(store).to(dev), v_cache=v_cache.to(store).to(dev),
        page_table=table.to(dev), seq_lens=torch.tensor([n for _, n in rows], dtype=torch.int32, device=dev),
        cu_seqlens_q=cu.to(dev), keys=[k.to(dev) for k in keys], values=[v.to(dev) for v in values],
        sinks=None if sinks is None else sinks.to(dev), k_scale=None if k_scale is None else k_scale.to(dev),
        v_scale=None if v_scale is None else v_scale.to(dev))


def reference(spec: AttentionSpec, batch: ExtendBatch, b: int) -> torch.Tensor:
    """Float32 ``[q_len, H, D]`` of row b: its queries, the last q_len of its seq_len positions, over its keys."""
    lq, n = batch.rows[b]
    qs = int(batch.cu_seqlens_q[b])
    q = batch.q[qs:qs + lq].float()
    return yardstick.reference_attention(q, batch.keys[b], batch.values[b], spec.scale, spec.causal,
                                         window=spec.sliding_window, softcap=spec.softcap, sinks=batch.sinks)


def careful(spec: AttentionSpec, batch: ExtendBatch, b: int) -> torch.Tensor:
    """The yardstick of row b (``yardstick.careful_attention``): what a careful kernel computes in the dtype."""
    lq, n = batch.rows[b]
    qs = int(batch.cu_seqlens_q[b])
    return yardstick.careful_attention(batch.q[qs:qs + lq], batch.keys[b], batch.values[b], spec.scale, spec.causal,
                                       window=spec.sliding_window, softcap=spec.softcap, sinks=batch.sinks,
                                       dtype=spec.torch_dtype, fp8=spec.kv_dtype is not None)


def row_failures(spec: AttentionSpec, batch: ExtendBatch, out: torch.Tensor, *, atol: float | None = None
                 ) -> list[str]:
    """One line per row whose output is off: against the float32 reference, within ``atol`` (when given) or within
    the project's per-token tolerance (4 x the yardstick's error + the dtype's floor). Empty when every row is right.
    Rows without queries are checked for nothing; rows without keys must be exact zeros."""
    failures = []
    for b, (lq, n) in enumerate(batch.rows):
        if lq == 0:
            continue
        qs = int(batch.cu_seqlens_q[b])
        got = out[qs:qs + lq].float()
        ref = reference(spec, batch, b)
        err = yardstick.row_errors(got, ref)
        if atol is not None:
            tol = torch.full_like(err, atol)
        else:
            tol = yardstick.row_tolerance(spec, yardstick.row_errors(careful(spec, batch, b), ref))
        if n == 0:
            tol = torch.zeros_like(err)  # no key at all: exact zeros
        bad = ~(err <= tol)
        if bool(bad.any()):
            i = int((err / tol.clamp_min(1e-30)).argmax())
            failures.append(f"row {b} (q_len {lq}, seq_len {n}): query {i} error {float(err[i]):.3g} > tolerance "
                            f"{float(tol[i]):.3g} ({int(bad.sum())} of {lq} queries off)")
    return failures
