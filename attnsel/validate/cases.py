"""Is it right: validation cases derived from the spec, the float32 reference, the tolerance, the pass/fail check.

Tolerance rule: a backend passes when its max abs error against the float32 reference is at most
``TOL_FACTOR * sdpa_err + TOL_FLOOR[dtype]``, where sdpa_err is the max abs error that torch SDPA itself makes on the
same inputs in the low dtype. NaN or inf in the output rejects outright.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from ..backends.torch_sdpa import BACKEND as TORCH
from ..spec import AttentionSpec

TOL_FACTOR = 4.0
TOL_FLOOR = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}
GARBAGE_SCALE = 1e3  # unused cache slots hold values this large: reading them shows in the output


@dataclasses.dataclass
class PrefillCase:
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor  # float32
    sdpa_err: float

    def describe(self) -> str:
        lq = (self.cu_q[1:] - self.cu_q[:-1]).tolist()
        lk = (self.cu_k[1:] - self.cu_k[:-1]).tolist()
        return f"prefill q_lens={lq} k_lens={lk}"


@dataclasses.dataclass
class DecodeCase:
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ref: torch.Tensor  # float32
    sdpa_err: float

    def describe(self) -> str:
        return f"decode seq_lens={self.seq_lens.tolist()} pages={self.k_cache.shape[0]} (shuffled)"


def tolerance(spec: AttentionSpec, sdpa_err: float) -> float:
    return TOL_FACTOR * sdpa_err + TOL_FLOOR[spec.dtype]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Plain float32 softmax(q k^T) v for one sequence, ``[S, H, D]`` layout, GQA, bottom-right causal."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, S, D]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(1, 2)) * scale
    if causal:
        lq, lk = q.shape[1], k.shape[1]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def cumulative(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def prefill_lengths(device: torch.device) -> tuple[list[int], list[int]]:
    """Ragged lengths with 1, a prime, non-multiples of every block size, one long sequence, and one sequence whose
    queries are the last tokens of a longer key range (chunked prefill / prefix cache)."""
    if device.type == "cuda":
        q = [1, 13, 97, 1031, 61]
        return q, [1, 13, 97, 1031, 263]
    q = [1, 7, 37, 83, 5]
    return q, [1, 7, 37, 83, 40]


def decode_lengths(spec: AttentionSpec, device: torch.device) -> list[int]:
    ps = spec.page_size
    long = 1531 if device.type == "cuda" else 157
    return [1, ps + 1, max(2, 3 * ps - 5), long, 2 * ps]


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item()


def prefill_case(spec: AttentionSpec, device: torch.device, seed: int = 0) -> PrefillCase:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lq, lk = prefill_lengths(device)
    cu_q, cu_k = cumulative(lq, device), cumulative(lk, device)
    dt = spec.torch_dtype
    q = torch.randn(sum(lq), spec.num_q_heads, spec.head_dim, generator=gen).to(device, dt)
    k = torch.randn(sum(lk), spec.num_kv_heads, spec.head_dim, generator=gen).to(device, dt)
    v = torch.randn(sum(lk), spec.num_kv_heads, spec.head_dim, generator=gen).to(device, dt)
    ref = torch.empty(q.shape, dtype=torch.float32, device=device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lq)):
        ref[cq[i]:cq[i + 1]] = reference_attention(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]],
                                                   spec.scale, spec.causal)
    low = TORCH.plan_prefill(spec, cu_q, cu_k, max(lq), max(lk))(q, k, v)
    return PrefillCase(cu_q, cu_k, max(lq), max(lk), q, k, v, ref, max_abs_err(low, ref))


def decode_case(spec: AttentionSpec, device: torch.device, seed: int = 1) -> DecodeCase:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens = decode_lengths(spec, device)
    ps, kvh, d, dt = spec.page_size, spec.num_kv_heads, spec.head_dim, spec.torch_dtype
    pages_per_seq = [math.ceil(n / ps) for n in lens]
    spare = 7  # pages nobody uses, full of garbage
    num_pages = sum(pages_per_seq) + spare
    max_pages = max(pages_per_seq) + 1
    k_cache = (torch.randn(num_pages, ps, kvh, d, generator=gen) * GARBAGE_SCALE).to(dt)
    v_cache = (torch.randn(num_pages, ps, kvh, d, generator=gen) * GARBAGE_SCALE).to(dt)
    order = torch.randperm(num_pages, generator=gen)
    garbage_page = int(order[-1])
    page_table = torch.full((len(lens), max_pages), garbage_page, dtype=torch.int32)
    q = torch.randn(len(lens), spec.num_q_heads, d, generator=gen).to(dt)
    ref = torch.empty(q.shape, dtype=torch.float32)
    next_page = 0
    for b, n in enumerate(lens):
        k = torch.randn(n, kvh, d, generator=gen).to(dt)
        v = torch.randn(n, kvh, d, generator=gen).to(dt)
        for p in range(pages_per_seq[b]):
            page = int(order[next_page])
            next_page += 1
            page_table[b, p] = page
            rows = slice(p * ps, min((p + 1) * ps, n))
            k_cache[page, : rows.stop - rows.start] = k[rows]
            v_cache[page, : rows.stop - rows.start] = v[rows]
        ref[b] = reference_attention(q[b:b + 1], k, v, spec.scale, causal=False)[0]
    to = dict(device=device)
    case = DecodeCase(page_table.to(**to), torch.tensor(lens, dtype=torch.int32, device=device), q.to(**to),
                      k_cache.to(**to), v_cache.to(**to), ref.to(**to), 0.0)
    low = TORCH.plan_decode(spec, case.page_table, case.seq_lens)(case.q, case.k_cache, case.v_cache)
    case.sdpa_err = max_abs_err(low, case.ref)
    return case


def make_case(spec: AttentionSpec, phase: str, device: torch.device) -> PrefillCase | DecodeCase:
    return prefill_case(spec, device) if phase == "prefill" else decode_case(spec, device)


def run_case(backend, spec: AttentionSpec, case: PrefillCase | DecodeCase) -> torch.Tensor:
    """Plan and run one backend on a validation case."""
    if isinstance(case, PrefillCase):
        return backend.plan_prefill(spec, case.cu_q, case.cu_k, case.max_q, case.max_k)(case.q, case.k, case.v)
    return backend.plan_decode(spec, case.page_table, case.seq_lens)(case.q, case.k_cache, case.v_cache)

def check_output(spec: AttentionSpec, out, case) -> dict:
    """Compare one output with the case's reference; the fields of a result."""
    if not isinstance(out, torch.Tensor) or out.shape != case.ref.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"status": "rejected", "reason": f"output shape {got}, expected {tuple(case.ref.shape)}"}
    tol = tolerance(spec, case.sdpa_err)
    result = {"tolerance": tol, "sdpa_err": case.sdpa_err}
    bad = (~torch.isfinite(out.float())).sum().item()
    if bad:
        return {**result, "status": "rejected", "max_abs_err": None,
                "reason": f"{bad} of {out.numel()} output values are NaN or inf ({case.describe()})"}
    err = max_abs_err(out, case.ref)
    result["max_abs_err"] = err
    if not err <= tol:
        return {**result, "status": "rejected",
                "reason": f"max abs error {err:.3g} exceeds tolerance {tol:.3g} (torch SDPA in {spec.dtype} errs "
                          f"{case.sdpa_err:.3g}; {case.describe()})"}
    return {**result, "status": "valid", "reason": ""}
