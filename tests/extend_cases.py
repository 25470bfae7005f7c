"""Extend batches with traps, and their float32 reference, for the extend tests (CPU and GPU).

A batch is a list of rows (q_len, seq_len): row b's queries are the last q_len of its seq_len tokens, all of them in a
paged cache of shuffled pages. Traps: unused slots hold NaN and inf (fp8: NaN, e4m3 has no inf), unused page-table
columns hold a sentinel (-1 or num_pages), q rows past the batch's last query hold NaN (padding; their output is
unspecified). The reference is built here, independently of any backend: each row's keys straight from the values
written into the cache, dequantised, and ``yardstick.reference_attention`` in float32.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from attnsel.spec import AttentionSpec
from attnsel.validate import yardstick

Q_PADDING = 3  # q rows past cu_seqlens_q[-1]


@dataclass
class ExtendBatch:
    rows: list[tuple[int, int]]
    q: torch.Tensor  # [total_q + padding (Q_PADDING unless given), H, D]
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
               device: torch.device | str = "cpu", spare_pages: int = 3, num_pages: int | None = None,
               width: int | None = None, q_rows: int | None = None) -> ExtendBatch:
    """The batch of ``rows`` (q_len, seq_len) for ``spec`` with the traps of the module docstring, made on
    ``device`` (realistic GPU sizes are made there, vectorised). ``num_pages``, ``width`` (page-table columns) and
    ``q_rows`` fix the shapes, so that batches of other rows can be copied into a captured graph's tensors."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ps, kvh, d, heads = spec.page_size, spec.num_kv_heads, spec.head_dim, spec.num_q_heads
    lens = [n for _, n in rows]
    pages_per_row = [math.ceil(n / ps) for n in lens]
    num_pages = num_pages or sum(pages_per_row) + spare_pages
    width = width or max(pages_per_row, default=0) + 2
    assert num_pages >= sum(pages_per_row) and width >= max(pages_per_row, default=0)
    fp8 = spec.kv_dtype is not None
    # unused slots: NaN on odd pages, inf on even ones (fp8 has no inf: NaN there too)
    k_cache = torch.full((num_pages, ps, kvh, d), float("nan"), dtype=torch.float32, device=dev)
    if not fp8:
        k_cache[0::2] = float("inf")
    v_cache = -k_cache
    table = torch.full((len(rows), width), -1 if sentinel == "-1" else num_pages, dtype=torch.int32, device=dev)
    order = torch.randperm(num_pages, generator=gen, device=dev).to(torch.int32)
    starts = [0] + list(itertools.accumulate(pages_per_row))
    slots = []
    for b, n in enumerate(lens):  # each row's pages: shuffled, its tokens' slots in the flat cache
        table[b, :pages_per_row[b]] = order[starts[b]:starts[b + 1]]
        t = torch.arange(n, device=dev)
        slots.append(table[b, t // ps].long() * ps + t % ps)
    total_k = sum(lens)
    k = torch.randn(total_k, kvh, d, generator=gen, device=dev)
    v = torch.randn(total_k, kvh, d, generator=gen, device=dev)
    k_scale = torch.tensor([0.02], device=dev) if fp8 else None
    v_scale = torch.tensor([0.03], device=dev) if fp8 else None
    if fp8:  # stored = real / scale in e4m3; the real keys are the stored values times the scale
        k_stored, v_stored = (k / k_scale).to(spec.kv_torch_dtype), (v / v_scale).to(spec.kv_torch_dtype)
        k, v = k_stored.float() * k_scale, v_stored.float() * v_scale
    else:
        k_stored, v_stored = k.to(spec.torch_dtype), v.to(spec.torch_dtype)
        k, v = k_stored.float(), v_stored.float()
    k_cache, v_cache = k_cache.to(spec.kv_torch_dtype), v_cache.to(spec.kv_torch_dtype)
    if total_k:
        flat = torch.cat(slots)
        k_cache.view(-1, kvh, d)[flat] = k_stored
        v_cache.view(-1, kvh, d)[flat] = v_stored
    total_q = sum(q for q, _ in rows)
    q_rows = q_rows or total_q + Q_PADDING
    assert q_rows >= total_q
    q = torch.randn(q_rows, heads, d, generator=gen, device=dev).to(spec.torch_dtype)
    q[total_q:] = float("nan")
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(torch.tensor([lq for lq, _ in rows], dtype=torch.int32, device=dev), 0)
    sinks = torch.randn(heads, generator=gen, device=dev) * 2 if spec.sinks else None
    return ExtendBatch(rows=list(rows), q=q, k_cache=k_cache, v_cache=v_cache, page_table=table,
                       seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), cu_seqlens_q=cu,
                       keys=list(k.split(lens)), values=list(v.split(lens)), sinks=sinks, k_scale=k_scale,
                       v_scale=v_scale)


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
