"""The cells of `attnsel bench --heldout SEED`: shapes drawn at random with that seed from serving-like
distributions, none of them a shape that the selection times, so that the dispatch table is judged where it was
neither measured nor tuned.

Prefill: sequences per batch log-uniform over 1..64; prompt lengths log-uniform over 16..min(32768, 65536 /
sequences), so that a batch holds at most ``PREFILL_TOKEN_CAP`` (65536) tokens, an engine's prefill token budget;
a batch of 2+ sequences is uniform (one length drawn for all) or ragged (each length drawn alone), half and half.

Decode: batch sizes log-uniform over 1..512; under CUDA graphs rounded up to the next batch size that vLLM captures
by default (1, 2, 4, 8..248 in steps of 8, 256..512 in steps of 16: an engine pads a batch to its graph's size).
Contexts are lognormal, truncated (values outside redrawn) to 16..min(32768, ``DECODE_TOKEN_CAP`` / batch): at most
2^20 KV tokens in a batch (4 GiB of bf16 KV at 8 KV heads x head_dim 128, the selection's own cap; lower where a
spec's KV would pass bench.MAX_KV_BYTES, ``decode_token_cap``). A uniform batch draws one context (median 1024,
sigma 1.5: heavy on both sides); a ragged one draws its median that way and each row's context around it (sigma 1.0:
the longest of 64 rows is typically ~7x the mean, so most ragged batches reach the ragged sub-table's skew), half
and half.

Off the grid: a cell whose dispatch point is a timed bucket's (prefill: (sequences, total tokens, longest); decode:
(batch, mean context), uniform or ragged grid) or that repeats an earlier cell is drawn again. Under CUDA graphs the
table keys decode by batch size alone, so a cell at a timed batch size sits on that bucket's key (not on any of its
four timed contexts): such cells are kept, marked ``timed_batch``, and the summary also reports the cells at untimed
batch sizes alone.

Extend (ragged queries over the paged cache), one of three kinds at random (under CUDA graphs multi-token decode
only, batch sizes padded as decode's): chunked prefill (1-8 requests, a chunk of 128-2048 new tokens each, prefixes
log-uniform 1k-32k), prompt-cache hits (1-16 requests, 50-500 new tokens each over a prefix around 8k, lognormal
sigma 0.5), multi-token decode and speculative verify (1-256 requests, 2-4 queries each, contexts drawn as decode's
ragged rows). Off the grid: its point (requests, mean queries, mean context) is no timed bucket's.

Each (seed, phase) has its own random stream (decode: per launch mode too), independent of the spec: specs see the
same cells except where one spec's grid rejects a draw (the wave-edge batch sizes depend on KV heads and SMs).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .spec import AttentionSpec
from .validate import grid, timing
from .validate.extend_grid import extend_grid, extend_key

PREFILL_SEQS_MAX = 64
PREFILL_LEN_MIN, PREFILL_LEN_MAX = 16, 32768
PREFILL_TOKEN_CAP = 65536
DECODE_BATCH_MAX = 512
DECODE_CTX_MIN, DECODE_CTX_MAX = 16, 32768
DECODE_TOKEN_CAP = 1 << 20
CTX_MEDIAN, CTX_SIGMA = 1024.0, 1.5  # a batch's (median) context
ROW_SIGMA = grid.RAGGED_ROW_SIGMA  # a ragged batch's rows around its median: one traffic model, timed and drawn
RAGGED_SHARE = 0.5
# vLLM's default CUDA-graph batch sizes (up to its largest default capture size)
CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, DECODE_BATCH_MAX + 1, 16))
MAX_TRIES = 1000  # draws per cell before giving up (the grid rejects a small share of draws)
_STREAMS = {("prefill", "eager"): (0, 0), ("prefill", "graph"): (0, 0),  # prefill: one stream for both modes
            ("decode", "eager"): (1, 0), ("decode", "graph"): (1, 1),
            ("extend", "eager"): (2, 0), ("extend", "graph"): (2, 1)}
EXTEND_KINDS = ("chunk", "cache_hit", "mtp")
CHUNK_REQUESTS, CHUNK_NEW, CHUNK_PREFIX = 8, (128, 2048), (1024, 32768)
HIT_REQUESTS, HIT_NEW, HIT_PREFIX_MEDIAN, HIT_PREFIX_SIGMA = 16, (50, 500), 8192.0, 0.5
MTP_REQUESTS, MTP_QUERIES = 256, (2, 4)


@dataclasses.dataclass(frozen=True)
class HeldoutCell:
    """One drawn batch: prompt lengths (prefill) or per-row contexts (decode, extend: queries included)."""
    phase: str
    lens: tuple[int, ...]
    ragged: bool
    q_lens: tuple[int, ...] = ()  # extend: each row's queries
    kind: str = ""  # extend: chunk, cache_hit or mtp

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def shape(self):
        """What timing.time_bucket takes: prompt lengths; (batch, context) for a uniform decode batch, the contexts
        for a ragged one."""
        if self.phase == "extend":
            return (list(self.q_lens), list(self.lens))
        if self.phase == "prefill" or self.ragged:
            return list(self.lens)
        return (self.batch, self.lens[0])

    @property
    def key(self) -> tuple[int, ...]:
        """What bench.compare dispatches with (Selection.prefill_backend_for / decode_backend_for /
        extend_backend_for): a ragged decode batch and an extend batch by their means and longest row, as an engine
        plans them."""
        if self.phase == "prefill":
            return grid.prefill_key(list(self.lens))
        if self.phase == "extend":  # its means, and its longest context (plan_extend's longest=)
            return (*extend_key(self.batch, sum(self.q_lens), sum(self.lens)), max(self.lens))
        if self.ragged:
            return (*grid.ragged_key(list(self.lens)), max(self.lens))
        return (self.batch, self.lens[0])

    def point(self) -> tuple[int, ...]:
        """The cell's place on the table's axes: prefill (sequences, total, longest), decode (batch, mean), extend
        (requests, mean queries, mean context)."""
        return self.key if self.phase == "prefill" else self.key[:-1] if self.phase == "extend" else self.key[:2]

    def label(self, index: int) -> str:
        if self.phase == "extend":
            _, q, c, _ = self.key
            return f"#{index} {self.kind} {self.batch}x{q} over {c}{' (ragged)' if self.ragged else ''}"
        if self.phase == "prefill":
            return f"#{index} {grid.prefill_label(list(self.lens))}"
        if not self.ragged:
            return f"#{index} {self.batch}x{self.lens[0]}"
        return f"#{index} ragged {self.batch} (mean {self.key[1]}, max {max(self.lens)})"


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int, size=None):
    """Integers in lo..hi, log-uniform (each octave as likely)."""
    x = np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), size))).astype(np.int64)
    return np.clip(x, lo, hi)


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int, size: int) -> np.ndarray:
    """Integers from a lognormal truncated to lo..hi (a value outside is drawn again)."""
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        x = np.rint(rng.lognormal(math.log(median), sigma, todo.size)).astype(np.int64)
        ok = (x >= lo) & (x <= hi)
        out[todo[ok]] = x[ok]
        todo = todo[~ok]
    return out


def draw_prefill(rng: np.random.Generator) -> HeldoutCell:
    n = int(_log_uniform_int(rng, 1, PREFILL_SEQS_MAX))
    hi = min(PREFILL_LEN_MAX, PREFILL_TOKEN_CAP // n)
    ragged = n > 1 and rng.random() < RAGGED_SHARE
    lens = _log_uniform_int(rng, PREFILL_LEN_MIN, hi, n if ragged else 1)
    lens = [int(x) for x in lens] * (1 if ragged else n)
    return HeldoutCell("prefill", tuple(lens), len(set(lens)) > 1)


def capture_size(batch: int) -> int:
    """The CUDA-graph batch size an engine pads ``batch`` to (the smallest CAPTURE_SIZES value at least it)."""
    return next(s for s in CAPTURE_SIZES if s >= batch)


def draw_decode(rng: np.random.Generator, mode: str, token_cap: int = DECODE_TOKEN_CAP) -> HeldoutCell:
    batch = int(_log_uniform_int(rng, 1, DECODE_BATCH_MAX))
    if mode == "graph":
        batch = capture_size(batch)
    hi = min(DECODE_CTX_MAX, token_cap // batch)
    if hi < DECODE_CTX_MIN:
        raise ValueError(f"a decode batch of {batch} rows cannot hold {DECODE_CTX_MIN} tokens each within "
                         f"{token_cap} tokens")
    ragged = batch > 1 and rng.random() < RAGGED_SHARE
    median = int(_lognormal_int(rng, CTX_MEDIAN, CTX_SIGMA, DECODE_CTX_MIN, hi, 1)[0])
    if ragged:
        lens = [int(x) for x in _lognormal_int(rng, median, ROW_SIGMA, DECODE_CTX_MIN, hi, batch)]
    else:
        lens = [median] * batch
    return HeldoutCell("decode", tuple(lens), len(set(lens)) > 1)


def draw_extend(rng: np.random.Generator, mode: str, token_cap: int = DECODE_TOKEN_CAP) -> HeldoutCell:
    kind = "mtp" if mode == "graph" else EXTEND_KINDS[int(rng.integers(len(EXTEND_KINDS)))]
    if kind == "chunk":
        n = int(_log_uniform_int(rng, 1, CHUNK_REQUESTS))
        new = [int(_log_uniform_int(rng, *CHUNK_NEW))] * n
        prefix = [int(x) for x in _log_uniform_int(rng, *CHUNK_PREFIX, n)]
    elif kind == "cache_hit":
        n = int(_log_uniform_int(rng, 1, HIT_REQUESTS))
        new = [int(x) for x in _log_uniform_int(rng, *HIT_NEW, n)]
        prefix = [int(x) for x in _lognormal_int(rng, HIT_PREFIX_MEDIAN, HIT_PREFIX_SIGMA, 256, 32768, n)]
    else:
        n = int(_log_uniform_int(rng, 1, MTP_REQUESTS))
        if mode == "graph":
            n = capture_size(n)
        new = [int(rng.integers(MTP_QUERIES[0], MTP_QUERIES[1] + 1))] * n
        hi = max(DECODE_CTX_MIN, min(DECODE_CTX_MAX, token_cap // n))
        median = int(_lognormal_int(rng, CTX_MEDIAN, CTX_SIGMA, DECODE_CTX_MIN, hi, 1)[0])
        prefix = [int(x) for x in _lognormal_int(rng, median, ROW_SIGMA, DECODE_CTX_MIN, hi, n)]
    lens = tuple(p + q for p, q in zip(prefix, new))
    return HeldoutCell("extend", lens, len(set(lens)) > 1 or len(set(new)) > 1, tuple(new), kind)


def timed_points(spec: AttentionSpec, phase: str, mode: str, sms: int | None) -> set[tuple[int, ...]]:
    """The table points the selection times for ``spec`` on a GPU of ``sms`` multiprocessors (no memory limit: a
    superset of any device's grid): prefill (sequences, total, longest); decode (batch, context), the ragged buckets'
    (batch, mean) included."""
    cuda = torch.device("cuda")  # the GPU grids (the CPU ones are tiny); no device is touched
    if phase == "prefill":
        return {grid.prefill_key(lens) for _, lens in grid.prefill_grid(spec, cuda)}
    if phase == "extend":
        return {shape if mode == "eager" else shape[:1] for _, shape in extend_grid(spec, cuda, mode=mode)}
    points = {(b, c) for _, b, c in grid.decode_grid(spec, cuda, mode=mode, sms=sms)}
    return points | {grid.ragged_key(lens) for _, lens in grid.ragged_decode_grid(spec, cuda, mode=mode, sms=sms)}


def timed_batches(spec: AttentionSpec, mode: str, sms: int | None) -> set[int]:
    """The decode batch sizes of the timed grid (under CUDA graphs each one a bucket of its own)."""
    return {b for b, _ in timed_points(spec, "decode", mode, sms)}


def rng_for(seed: int, phase: str, mode: str) -> np.random.Generator:
    """The random stream of (seed, phase[, mode]): numpy's PCG64 seeded from a SeedSequence of the three."""
    return np.random.default_rng([seed, *_STREAMS[(phase, mode)]])


def sample_cells(spec: AttentionSpec, phase: str, mode: str, seed: int, count: int, sms: int | None,
                 token_cap: int = DECODE_TOKEN_CAP) -> list[HeldoutCell]:
    """``count`` cells of ``phase`` for ``mode``, drawn with ``seed``; a draw on a timed point of ``spec``'s grid (on
    a GPU of ``sms`` multiprocessors) or equal to an earlier cell is drawn again."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"the held-out seed must be a non-negative integer, got {seed!r}")
    if (phase, mode) not in _STREAMS:
        raise ValueError(f"phase must be prefill, decode or extend and mode eager or graph, got {phase!r}, {mode!r}")
    rng = rng_for(seed, phase, mode)
    timed = timed_points(spec, phase, mode, sms)
    cells: list[HeldoutCell] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(count):
        for _ in range(MAX_TRIES):
            if phase == "extend":
                cell = draw_extend(rng, mode, token_cap)
            else:
                cell = draw_prefill(rng) if phase == "prefill" else draw_decode(rng, mode, token_cap)
            # under CUDA graphs the extend table keys by batch size alone: every cell sits on a timed batch size's
            # key (never on a timed shape: its contexts are drawn), as decode's timed_batch cells
            point = () if phase == "extend" and mode == "graph" else cell.point()
            if point not in timed and cell.lens not in seen:
                break
        else:
            raise RuntimeError(f"no {phase} cell off the timed grid in {MAX_TRIES} draws")
        seen.add(cell.lens)
        cells.append(cell)
    return cells


def decode_token_cap(spec: AttentionSpec, max_kv_bytes: int) -> int:
    """KV tokens a decode cell may hold: DECODE_TOKEN_CAP, less where the spec's KV would pass ``max_kv_bytes``."""
    per_token = 2 * spec.num_kv_heads * spec.head_dim * torch.finfo(spec.kv_torch_dtype).bits // 8
    return min(DECODE_TOKEN_CAP, max_kv_bytes // per_token)
