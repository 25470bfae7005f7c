"""The inputs of validation cases: random sequences with the spec's features and traps, paged caches with garbage
where no sequence lives, and each sequence's float32 reference and careful low-precision yardstick.

Traps in paged caches (a backend must not read past a sequence): NaN and inf in the unused slots of each sequence's
last page, page-table columns past a sequence's pages holding -1, ``num_pages`` (out of range) or a page full of NaN
or of large garbage, spare pages of garbage, pages shuffled.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from ..spec import AttentionSpec
from .yardstick import careful_attention, reference_attention

GARBAGE_SCALE = 1e3  # unused cache pages hold values this large: reading them shows in the output
FP8_GARBAGE = 448.0  # the largest finite e4m3 value (e4m3fn has no inf)
# fp8 KV case: stored value = real value / scale (real values ~ N(0, 1), stored ~ N(0, 1 / scale)); two different
# scales, not 1, so a backend that ignores or swaps them is caught.
K_SCALE, V_SCALE = 0.35, 0.6
# Sink logits per head (cycled), in units of the logits' spread (softcap / 10 with a softcap): large ones dominate the
# denominator, small ones barely matter, so a backend that ignores or misplaces sinks is caught on some heads.
SINK_VALUES = (6.0, -4.0, 1.5, 0.0, 9.0, -9.0, 3.0)
# With a softcap the queries are scaled so that logits reach about SOFTCAP_LOGITS x softcap: capping matters.
SOFTCAP_LOGITS = 1.0
# Sliding window: in the boundary sequences, the keys at each query's window edge get a logit log(w) + EDGE_MARGIN
# (far above the rest) and values moved by EDGE_VALUE, so an off-by-one window shows whatever w is.
EDGE_MARGIN = 8.0
EDGE_VALUE = 4.0


def _attention(spec: AttentionSpec, q, k, v, sinks, cache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 reference, yardstick) of one sequence whose queries are its last tokens; ``cache``: k/v come from
    the paged cache (decode, extend: causal whatever the spec says), in fp8 when the spec's kv_dtype is."""
    features = dict(window=spec.sliding_window, softcap=spec.softcap, sinks=sinks)
    fp8 = cache and spec.kv_dtype is not None
    causal = spec.causal or cache
    return (reference_attention(q, k, v, spec.scale, causal, **features),
            careful_attention(q, k, v, spec.scale, causal, dtype=spec.torch_dtype, fp8=fp8, **features))


def cumulative(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _sinks(spec: AttentionSpec) -> torch.Tensor | None:
    """Sink logits per head, in the range of the case's logits (unit spread; with a softcap, within +-softcap)."""
    if not spec.sinks:
        return None
    unit = spec.softcap / 10 if spec.softcap is not None else 1.0
    values = [SINK_VALUES[h % len(SINK_VALUES)] * unit for h in range(spec.num_q_heads)]
    return torch.tensor(values, dtype=torch.float32)


def _query_boost(spec: AttentionSpec) -> float:
    """Factor on unit-variance queries so that logits spread about SOFTCAP_LOGITS x softcap (1 without softcap)."""
    if spec.softcap is None:
        return 1.0
    return SOFTCAP_LOGITS * spec.softcap / (spec.scale * spec.head_dim ** 0.5)


def _edge_logit(spec: AttentionSpec) -> float:
    """Logit (before the softcap) of window-edge keys: far above the sum of w unit-spread logits once capped."""
    target = math.log(spec.sliding_window) + EDGE_MARGIN
    if spec.softcap is None:
        return target
    return spec.softcap * math.atanh(min(target / spec.softcap, 0.995))


def _sequence(spec: AttentionSpec, gen: torch.Generator, lq: int, lk: int, boundary: bool,
              kv_dtype: torch.dtype, scales: tuple[float, float] | None):
    """One sequence: q ``[lq, H, D]`` in the spec's dtype, k/v ``[lk, KVH, D]`` as stored (kv_dtype; fp8: divided by
    their scale) and as the reference sees them (dequantised). Queries are the last lq of lk positions.

    boundary (sliding window w): each query whose window starts inside the sequence gets a logit far above the rest
    (_edge_logit) on the first key inside its window and on the last key outside it, and those keys' values move by
    +-EDGE_VALUE (alternating): a window one key too wide or too narrow moves the output by about EDGE_VALUE, however
    long the window. Other sequences are random, their queries boosted so that a softcap matters."""
    heads, kvh, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(lq, heads, d, generator=gen) * (1.0 if boundary else _query_boost(spec))
    k = torch.randn(lk, kvh, d, generator=gen)
    v = torch.randn(lk, kvh, d, generator=gen)
    edges = []  # (query row, key position)
    if boundary:
        for row in range(lq):
            first = lk - lq + row - spec.sliding_window + 1  # first key inside the window of this query
            edges += [(row, p) for p in (first, first - 1) if p >= 0]
        for p in sorted({p for _, p in edges}):
            v[p] += EDGE_VALUE * (-1) ** p
    if scales is None:
        k_stored, v_stored = k.to(kv_dtype), v.to(kv_dtype)
        k_real, v_real = k_stored, v_stored
    else:
        k_stored, v_stored = (k / scales[0]).to(kv_dtype), (v / scales[1]).to(kv_dtype)
        k_real, v_real = k_stored.float() * scales[0], v_stored.float() * scales[1]
    if edges:
        logit = _edge_logit(spec)
        for row, p in edges:
            kp = k_real[p].float().repeat_interleave(heads // kvh, 0)  # [H, D]: each query head's key
            q[row] += logit / spec.scale * kp / kp.square().sum(-1, keepdim=True)
    return q.to(spec.torch_dtype), k_stored, v_stored, k_real, v_real


def _garbage(shape, gen, kv_dtype: torch.dtype) -> torch.Tensor:
    if kv_dtype == torch.float8_e4m3fn:
        return (torch.randn(*shape, generator=gen) * 100).clamp(-FP8_GARBAGE, FP8_GARBAGE).to(kv_dtype)
    return (torch.randn(*shape, generator=gen) * GARBAGE_SCALE).to(kv_dtype)


def _poison(page: torch.Tensor, first_slot: int) -> None:
    """NaN, +inf, -inf (fp8: NaN, +-448) in slots first_slot.. of one cache page ``[page_size, kvh, d]``."""
    if page.dtype == torch.float8_e4m3fn:
        values = (float("nan"), FP8_GARBAGE, -FP8_GARBAGE)
    else:
        values = (float("nan"), float("inf"), float("-inf"))
    for slot in range(first_slot, page.shape[0]):
        page[slot] = values[(slot - first_slot) % 3]


@dataclasses.dataclass
class Paged:
    """Sequences in a shuffled paged cache with their queries (the last ``q_lens[b]`` tokens of sequence b), as
    stored (kv dtype; fp8: divided by the scales), with each query row's reference and yardstick (float32)."""
    page_table: torch.Tensor  # int32 [batch, max_pages]
    q: torch.Tensor  # [sum(q_lens), H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ref: torch.Tensor
    low: torch.Tensor
    sinks: torch.Tensor | None


def paged(spec: AttentionSpec, gen: torch.Generator, lens: list[int], q_lens: list[int], boundary: int) -> Paged:
    """Sequences of ``lens`` tokens whose last ``q_lens`` are the queries, on the CPU; the last ``boundary`` are
    window-boundary sequences (_sequence)."""
    ps, kvh, d, dt, kv_dt = spec.page_size, spec.num_kv_heads, spec.head_dim, spec.torch_dtype, spec.kv_torch_dtype
    scales = (K_SCALE, V_SCALE) if spec.kv_dtype is not None else None
    pages_per_seq = [math.ceil(n / ps) for n in lens]
    spare = 8  # pages nobody uses: half NaN, half large garbage
    num_pages = sum(pages_per_seq) + spare
    # Every row has unused columns, many of them as in an engine's table sized for the longest possible sequence (a
    # backend that sizes its work by the table's width, like FA3's scheduler, must get the same answer).
    max_pages = 2 * max(pages_per_seq, default=0) + 3
    k_cache = _garbage((num_pages, ps, kvh, d), gen, kv_dt)
    v_cache = _garbage((num_pages, ps, kvh, d), gen, kv_dt)
    order = torch.randperm(num_pages, generator=gen).tolist()
    nan_pages, garbage_pages = order[-spare:][: spare // 2], order[-spare:][spare // 2:]
    for page in nan_pages:
        k_cache[page] = float("nan")
        v_cache[page] = float("nan")
    # Unused page-table columns: out-of-range sentinels (-1, num_pages) and pages of NaN or garbage, varied by row.
    fillers = [-1, num_pages, nan_pages[0], garbage_pages[0]]
    page_table = torch.tensor([[fillers[(b + c) % len(fillers)] for c in range(max_pages)]
                               for b in range(len(lens))], dtype=torch.int32)
    sinks = _sinks(spec)
    total = sum(q_lens)
    q = torch.empty(total, spec.num_q_heads, d, dtype=dt)
    ref = torch.empty(q.shape, dtype=torch.float32)
    low = torch.empty(q.shape, dtype=torch.float32)
    next_page, row = 0, 0
    for b, (n, lq) in enumerate(zip(lens, q_lens)):
        qb, k, v, k_real, v_real = _sequence(spec, gen, lq, n, b >= len(lens) - boundary, kv_dt, scales)
        q[row:row + lq] = qb
        for p in range(pages_per_seq[b]):
            page = order[next_page]
            next_page += 1
            page_table[b, p] = page
            used = min(ps, n - p * ps)
            k_cache[page, :used] = k[p * ps: p * ps + used]
            v_cache[page, :used] = v[p * ps: p * ps + used]
            if used < ps:  # the last page's unused slots
                _poison(k_cache[page], used)
                _poison(v_cache[page], used)
        ref[row:row + lq], low[row:row + lq] = _attention(spec, qb, k_real, v_real, sinks, cache=True)
        row += lq
    return Paged(page_table, q, k_cache, v_cache, ref, low, sinks)


def scale_tensors(spec: AttentionSpec, device) -> list[torch.Tensor | None]:
    """[k_scale, v_scale] as float32 one-element tensors for an fp8 cache, else [None, None]."""
    if spec.kv_dtype is None:
        return [None, None]
    return [torch.tensor([s], dtype=torch.float32, device=device) for s in (K_SCALE, V_SCALE)]
