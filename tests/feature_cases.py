"""Feature cases (sliding window, softcap, sinks, fp8 KV) with their own float32 reference, for the CPU and GPU tests.

Written from the AttentionSpec docstring, independently of every backend (and of validate/cases.py, which gains the
same features separately). Decode caches are full of NaN except the used slots; unused page-table columns hold a
sentinel: "nan_page" (a real page full of NaN, so any read of it shows), -1 or "num_pages" (engines' padding).
Tolerance, after issue 9 item 3: TOL_FACTOR x the error of the reference with the probabilities and the output
rounded to the low dtype (what a flash kernel rounds) + the dtype's floor.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from attnsel.spec import AttentionSpec

TOL_FACTOR = 4.0
TOL_FLOOR = {"fp16": 2e-3, "bf16": 1.6e-2}


def reference(q, k, v, scale, *, causal=True, window=None, softcap=None, sinks=None, low=None):
    """float32 attention of one sequence: q [lq, H, D], k/v [lk, KVH, D]; queries are the last lq positions;
    out [lq, H, D] float32. A sequence without keys gives zeros. ``low`` (a dtype) emulates a flash kernel in that
    dtype: the probabilities and the output are rounded to it (scores and sums stay float32)."""
    lq, lk = q.shape[0], k.shape[0]
    if lk == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = (q @ k.transpose(1, 2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    pos_k = torch.arange(lk, device=q.device)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= pos_k <= pos_q
    if window is not None:
        keep &= pos_k > pos_q - window
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(-1, lq, 1)], -1)
    p = s.softmax(-1)[..., :lk]
    if low is not None:
        p = p.to(low).float()
    out = (p @ v).transpose(0, 1)
    return out.to(low).float() if low is not None else out


@dataclasses.dataclass
class Case:
    phase: str
    plan_args: tuple
    inputs: tuple
    kwargs: dict
    ref: torch.Tensor  # float32
    low_err: float  # error of the reference computed in the low dtype

    def tolerance(self, spec: AttentionSpec) -> float:
        return TOL_FACTOR * self.low_err + TOL_FLOOR[spec.dtype]

    def run(self, backend, spec: AttentionSpec) -> torch.Tensor:
        plan = backend.plan_prefill if self.phase == "prefill" else backend.plan_decode
        return plan(spec, *self.plan_args)(*self.inputs, **self.kwargs)

    def error(self, out: torch.Tensor) -> float:
        """Max abs error against the reference; inf when the output holds NaN or inf."""
        if not torch.isfinite(out.float()).all():
            return math.inf
        return (out.float() - self.ref).abs().max().item()


def _sinks(spec: AttentionSpec, gen: torch.Generator) -> torch.Tensor:
    s = torch.randn(spec.num_q_heads, generator=gen) * 2
    s[0], s[1] = 12.0, -12.0  # a sink that takes nearly all the weight, one that takes none
    return s.float()


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def prefill_case(spec: AttentionSpec, device: torch.device, lq: list[int], lk: list[int], *, q_mul: float = 1.0,
                 seed: int = 0) -> Case:
    """Ragged prefill; sequences with fewer queries than keys are prefix-cached chunks. q_mul scales q and k
    (large logits for softcap)."""
    gen = torch.Generator().manual_seed(seed)
    dt = spec.torch_dtype
    q = (torch.randn(sum(lq), spec.num_q_heads, spec.head_dim, generator=gen) * q_mul).to(dt)
    k = (torch.randn(sum(lk), spec.num_kv_heads, spec.head_dim, generator=gen) * q_mul).to(dt)
    v = torch.randn(sum(lk), spec.num_kv_heads, spec.head_dim, generator=gen).to(dt)
    sinks = _sinks(spec, gen) if spec.sinks else None
    cq, ck = [0, *itertools.accumulate(lq)], [0, *itertools.accumulate(lk)]
    feats = dict(causal=spec.causal, window=spec.sliding_window, softcap=spec.softcap, sinks=sinks)
    ref = torch.cat([reference(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], spec.scale, **feats)
                     for i in range(len(lq))])
    low = torch.cat([reference(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], spec.scale, low=dt,
                               **feats) for i in range(len(lq))])
    to = dict(device=device)
    plan_args = (_cumulative(lq, device), _cumulative(lk, device), max(lq), max(lk))
    kwargs = {"sinks": sinks.to(**to)} if spec.sinks else {}
    return Case("prefill", plan_args, (q.to(**to), k.to(**to), v.to(**to)), kwargs, ref.to(**to),
                (low - ref).abs().max().item())


def decode_case(spec: AttentionSpec, device: torch.device, lens: list[int], sentinel="nan_page",
                seed: int = 1) -> Case:
    gen = torch.Generator().manual_seed(seed)
    ps, kvh, d = spec.page_size, spec.num_kv_heads, spec.head_dim
    pages = [math.ceil(n / ps) for n in lens]
    num_pages = sum(pages) + 2
    nan_page = num_pages - 1
    kv_dt = spec.kv_torch_dtype
    k_cache = torch.full((num_pages, ps, kvh, d), float("nan")).to(kv_dt)
    v_cache = torch.full((num_pages, ps, kvh, d), float("nan")).to(kv_dt)
    fill = {"nan_page": nan_page, "num_pages": num_pages, -1: -1}[sentinel]
    page_table = torch.full((len(lens), max(pages) + 2), fill, dtype=torch.int32)
    order = torch.randperm(num_pages - 1, generator=gen)
    q = torch.randn(len(lens), spec.num_q_heads, d, generator=gen).to(spec.torch_dtype)
    k_scale = torch.tensor([0.5 if spec.kv_dtype else 1.0])
    v_scale = torch.tensor([1.7 if spec.kv_dtype else 1.0])
    sinks = _sinks(spec, gen) if spec.sinks else None
    ref = torch.empty(q.shape)
    low = torch.empty(q.shape)
    used = 0
    feats = dict(causal=False, window=spec.sliding_window, softcap=spec.softcap, sinks=sinks)
    for b, n in enumerate(lens):
        k = torch.randn(n, kvh, d, generator=gen).to(kv_dt)
        v = torch.randn(n, kvh, d, generator=gen).to(kv_dt)
        for p in range(pages[b]):
            page = int(order[used])
            used += 1
            page_table[b, p] = page
            rows = slice(p * ps, min((p + 1) * ps, n))
            k_cache[page, : rows.stop - rows.start] = k[rows]
            v_cache[page, : rows.stop - rows.start] = v[rows]
        k_real, v_real = k.float() * k_scale, v.float() * v_scale
        ref[b] = reference(q[b:b + 1], k_real, v_real, spec.scale, **feats)[0]
        low[b] = reference(q[b:b + 1], k_real, v_real, spec.scale, low=spec.torch_dtype, **feats)[0]
    kwargs = {}
    to = dict(device=device)
    if spec.sinks:
        kwargs["sinks"] = sinks.to(**to)
    if spec.kv_dtype:
        kwargs.update(k_scale=k_scale.to(**to), v_scale=v_scale.to(**to))
    plan_args = (page_table.to(**to), torch.tensor(lens, dtype=torch.int32, device=device))
    return Case("decode", plan_args, (q.to(**to), k_cache.to(**to), v_cache.to(**to)), kwargs, ref.to(**to),
                (low - ref).abs().max().item())
