"""How fast: the bucket grids that the measure policy times, the interleaved timing of a phase's candidates (eager
launches or CUDA-graph replays, inputs read from HBM), the graph-capture check, and the bandwidth probes that decode
speeds are compared with. Used by the worker (policy "measure"), `attnsel bench` and scripts/gpu_tune.py.

Timing rules (what a number in a report means):
- Every timed call reads its inputs from HBM, not L2: each bucket allocates several input sets whose total is at
  least ``ROTATE_L2`` times the device's L2 size and the calls go round-robin over them (one shared cursor for all
  candidates, so a candidate never reads what the previous one just pulled into L2).
- Candidates are interleaved: repetition r times every candidate once (in an order rotated each repetition) before
  repetition r + 1 starts; a bucket's number per candidate is the median over ``reps_for(mode)`` samples of the time
  per call (``REPS_EAGER`` in eager mode, ``REPS`` under CUDA graphs), and its spread is (max - min) / median of
  those samples. A sample lasts at least ``SAMPLE_S``: after one untrusted call, its number of calls grows (at least
  doubling) until a measured sample is that long (one cold call, the rule before, can be several times slower than a
  warm one and gave samples of a few calls).
- Eager host-bound calls are noisy: on the H200 (2026-12-04, scripts/gpu_eager_noise.py) a candidate's ratio to the
  fastest moved by up to 1.9x between repeats of the old rule and stayed within 1.00-1.05x with 21 samples (that
  run did not separate sample count from calibration and warm-up), so eager buckets take 21 samples; CUDA-graph
  replays vary by 1-3% and take 7.
- Eager: the host's speed moves. Before each repetition a host probe (``host_probe``: launches of a one-element
  add) times the host; a bucket's ``host_us`` is the median of its probes, its ``host`` that over the phase's
  reference probe (the lower decile of its buckets' ``host_us``: one lucky bucket does not make the rest look slow),
  shown by the report. H100 2026-12-06 (bench/results/2026-12-06-round19): the probes of a phase spread from 1.0 to
  ~1.5x its fastest, in one phase (32/8 decode) in two clusters, 1.00-1.06x and 1.32-1.47x, with every host-bound
  candidate slowed alike in the slow one (Triton's decode at 4 x 256 46 -> 80 us, FlashInfer's 27 -> 44), so the
  winner rarely changed. Timing slow-host buckets again (tried in that round: up to 20% of the budget on close
  calls) showed no gain and, with slow hosts common, took budget from the grid.
- Pruning: once the coarse grid (level 0) is timed, a candidate at least ``PRUNE`` times slower than the fastest in
  every coarse bucket is not timed on the finer levels (listed in "pruned" with its best ratio): it is unlikely to
  win there (an extrapolation from the coarse grid, not a check), and the finer grid then costs less. A finer
  bucket where a timed candidate fails is timed again with every candidate, so that a pruned one can serve it.
- Checked: after the timing, what the timed plan computes (eager: two more calls, the first one's output NaN-filled
  and held during the second; graph: outputs NaN-filled, one more replay, the first and last input set) is compared
  with the float32 reference on sampled rows (cases.spot_reference, once per bucket and set); a wrong candidate gets
  no time in that bucket, with the reason.
- Eager: a sample is m consecutive ``run`` calls (host launch cost included: an engine in eager mode pays it).
  Graph: one CUDA graph per candidate and bucket holds one call per input set; a sample is m replays. A candidate
  whose capture fails gets no time in that bucket, with the reason.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from typing import Callable

import torch

from ..spec import AttentionSpec
from . import TIMING_TASK  # noqa: F401 (timing.TIMING_TASK: the worker's and the selector's name for it)
from .cases import clear_output, cumulative, spot_compare, spot_reference

log = logging.getLogger(__name__)

GRID_VERSION = 8  # part of the dispatch-table cache key: bump when the grids or the timing rules change (4: ragged
# decode buckets in eager mode; 5: their batches 4-128, pruning on the uniform coarse grid only; 6: slow-host buckets
# timed again (commit 348b8aa only); 7: the eager host probe per bucket without re-timing, the plan allowance capped
# by the task timeout; 8: decode batch sizes at the GPU's first three wave edges, eager decode contexts a power of two
# plus half a 64-token tile)
REPS = 7  # samples per candidate and bucket under CUDA graphs
REPS_EAGER = 21  # eager (host-bound calls are noisier): see the module doc
HOST_SLOW = 1.2  # eager: a bucket whose host probe ran this much slower than the phase's reference was timed on a
# slow host (the report counts them)
HOST_PROBE_CALLS = 32  # launches per run of the host probe, which takes the faster of two runs (~0.4 ms in all on
# the H100 of round 19, 5.8 us per launch)
PRUNE = 1.3  # a candidate this much slower than the fastest in every coarse bucket skips the finer levels
SAMPLE_S = 1e-3  # a sample lasts at least this long (CUDA event resolution is ~0.5 us)
MAX_REPEAT = 10000  # units per sample at most
ROTATE_L2 = 2.0  # input sets of a bucket total at least this many times the L2 size
MAX_SETS = 1024
DEFAULT_L2_BYTES = 50 << 20  # H200; used when the device does not report its L2 size
PLAN_ALLOWANCE_S = 30.0  # per phase: this much of the plans-and-first-calls step (at most
# PLAN_ALLOWANCE_SHARE of the most a phase's budget may be) is not counted against the budget. H100, 2026-12-05
# (bench/results/2026-12-05-round14): on an empty Triton kernel cache that step took 15.4 s in decode (Triton
# compiling; 1.4 s with the cache warm) and the eager table got 75 of 106 decode buckets. H200, 2026-12-06 (round
# 18): with the ragged decode buckets (more split counts: more Triton variants) the step took 18-29 s, the allowance
# was then 20 s capped at half the phase's budget (~14 s), and the 28/4 and 8/1 tables lost 12 and 20 buckets to
# compiles. Compiles are a cost of the machine's first selections, not of timing (the 60 s exclude JIT
# builds). The cap keeps a phase (budget at most half the task timeout, plus the allowance) inside the timeout.
# Under CUDA graphs the step also holds the captures, and Triton compiles its graph variant inside the capture, so
# the two cannot be told apart: until grid version 8 graph mode had no allowance, and on an H100 whose Triton cache
# lacked the graph variants (2026-12-06, bench/results/2026-12-06-round20/4-graph-again) decode's step took
# 29.6-33.2 s (6.9-9.2 s with the cache warm, run 2 there) and the graph tables lost 2, 26 and 35 of their 76, 78 and
# 68 decode buckets (32/8, 28/4, 8/1). Now the allowance covers it in both modes: captures on a warm cache (7-9 s
# a phase) go uncounted too.
PLAN_ALLOWANCE_SHARE = 0.8
# H100 2026-12-06 (round 19): capped at 0.8 x the phase's budget (18 s of 22.5) the allowance let Triton's decode
# compiles (23-33 s) cost 31-36 of ~115 decode buckets; the cap is now 0.8 x the most a phase's budget may be (half
# the worker's task timeout, 300 s by default), which keeps a phase within 0.9 of the timeout.

# Timed representatives (bucket centres). Buckets are the cells between the geometric midpoints of neighbouring
# values on each axis; a shape outside the grid is clamped to the nearest end. Prompt lengths are 9/8 of powers of
# two: real prompts end inside a kernel's tile, and a grid of whole tiles flattered the backends whose tiles fit it
# (H200 2026-12-03: FA3 led at 64 sequences x 64 tokens, FlashInfer was 1.38x faster at 40 x 100).
# Prompt lengths and decode batch sizes go in steps of sqrt(2): the kernels' speed is not monotone between powers of
# two (tiles, waves over 132 SMs, split heuristics). H200 2026-12-04: FlashInfer led FA3 by 1.32x at 40 x 100 tokens
# and tied or lost at 72 and 144; at 48 x 3000 decode FlashInfer led FA3 by 1.24x while FA3 led at batch 32 and 64.
# The values between powers of two form the finest level (2).
PREFILL_SEQS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_LENS = (72, 102, 144, 204, 288, 407, 576, 815, 1152, 1629, 2304, 3258, 4608, 6516, 9216, 13033, 18432)
PREFILL_RAGGED = ([2048] + [64] * 15, [4096] + [256] * 7)  # one long prompt among short ones (chunked prefill)
MAX_PREFILL_TOKENS = 32768
DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256)
# Eager decode contexts end half-way into a 64-token tile (a power of two plus 32), as a context drawn at random does
# on average: contexts of whole tiles flattered the kernels that work in whole tiles. H100 2026-12-06 (round 19 and
# bench/results/2026-12-06-round20): at 32/8 heads Triton (64-token blocks) led the CUDA-core FlashInfer (16-token
# pages) by 2-5% at 181 rows x 256 tokens (at 256 rows the two were within 1-6% either way), and at 200 x 200 (four
# blocks for 12.5 pages' worth) it served 1.11x slower than that FlashInfer; the shortest context was the grid's
# clamp for every shorter one. Levels and the memory cap go by the powers of two (DECODE_CTX_POW2). Graph mode's
# contexts (GRAPH_DECODE_CTX) stay whole powers of two: not measured with the half tiles.
DECODE_CTX_POW2 = (256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_TILE_TAIL = 32
DECODE_CTX = tuple(c + DECODE_TILE_TAIL for c in DECODE_CTX_POW2)
# Ragged decode buckets (eager mode): batches whose rows' contexts spread from 1/16 to 4 times their mean (longest
# row 3.0-4.2x the mean), timed as a sub-table keyed like the uniform one (batch, mean context) and used for batches
# of similar skew (longest row at least RAGGED_SKEW times the mean) near the timed ones (selection.DispatchTable.
# covers). H200 2026-12-06 (bench/results/2026-12-06-round18): on such batches of 32 and 128 rows the uniform table's
# choice for their (batch, mean) was 1.17-1.65x slower than the fastest (FA3 won there); up to 8 rows they agreed.
RAGGED_DECODE_BATCHES = (4, 8, 32, 128)
RAGGED_DECODE_MEANS = (1024, 4096)
RAGGED_SKEW = 2.5  # below it a batch is served as uniform: milder skews were not timed
# Wave edges (eager and graph decode): a kernel that runs one thread block per (row, KV head) and does not split
# the context (FA3 once the blocks fill 0.8 of the SMs) takes ceil(batch x kv_heads / SMs) rounds, so its time steps
# up right past batch = k x SMs / kv_heads, and the sqrt(2) grid above brackets such an edge with two values on its
# sides: the lookup's interpolation between them then credits the kernel with the lower round count. H100 2026-12-06
# (bench/results/2026-12-06-round19, 28/4 heads, 132 SMs): FA3 with GQA packing led FlashInfer by 2.5% at 91 rows
# (3 rounds) and trailed by 0.5% at 128 (4 rounds); at 100 rows (4 rounds) it served 1.11x slower than FlashInfer
# (rounds 16 and 19 alike). So for the first WAVE_EDGES edges, where a round is at least a third of the time, the
# grid holds the batch sizes on both sides of the edge (``wave_batches``): the last one with k rounds, unless a
# grid value within 5% below it already has k rounds, and the first one with k + 1.
WAVE_EDGES = 3
GRAPH_DECODE_CTX = (256, 1024, 4096, 16384)  # graph mode scores a batch size over contexts: 4x steps suffice
# (there a bucket's level is its batch size's: every batch size is timed at all four contexts together)
MAX_DECODE_KV_BYTES = 4 << 30
CPU_PREFILL = ([16], [24, 8])  # the interpreter and CPU torch: tiny workloads only
CPU_DECODE = ((1, 32), (4, 32))
CPU_REPS = 3

PREFILL_AXES = ("num_seqs", "total_tokens", "longest")
DECODE_AXES = ("batch", "context")


@dataclasses.dataclass
class Workload:
    label: str
    plan_args: tuple
    inputs: tuple


def prefill_key(lens: list[int]) -> tuple[int, int, int]:
    """The bucket coordinates of a prefill batch: (number of sequences, total tokens, longest sequence)."""
    return (len(lens), sum(lens), max(lens))


def prefill_label(lens: list[int]) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)}x{lens[0]}"
    return f"{len(lens)} seqs, {sum(lens)} tok, max {max(lens)}"


def _level(value: int, values: tuple[int, ...]) -> int:
    """2 for a value that is not a power of two times the first (the sqrt(2) steps); among the others 0 for every
    other one and both ends (the coarse grid), 1 for those in between."""
    ratio = value / values[0]
    if ratio != 2 ** round(math.log2(ratio)):
        return 2
    doubles = [v for v in values if (v / values[0]) == 2 ** round(math.log2(v / values[0]))]
    i = doubles.index(value)
    return 0 if i % 2 == 0 or i == len(doubles) - 1 else 1


def _coarse_first(grid: list[tuple], group=lambda item: item[1]) -> list[tuple]:
    """The grid by level, coarse first; within a level the groups (``group``: the batch size or the number of
    prompts) in bit-reversed order and each group's buckets together, so that a time budget that stops part-way
    through a level leaves whole batch sizes out, spread over the range (a graph-mode table scores a batch size
    over its contexts: half of them would bias it) rather than the largest ones all missing."""
    def bit_reversed(i: int, n: int) -> int:
        bits = max(1, (n - 1).bit_length())
        return int(format(i, f"0{bits}b")[::-1], 2)

    out = []
    for level in sorted({item[0] for item in grid}):
        groups: dict = {}
        for item in grid:
            if item[0] == level:
                groups.setdefault(group(item), []).append(item)
        keys = list(groups)
        for i in sorted(range(len(keys)), key=lambda i: bit_reversed(i, len(keys))):
            out += groups[keys[i]]
    return out


def prefill_grid(spec: AttentionSpec, device: torch.device) -> list[tuple[int, list[int]]]:
    """(level, sequence lengths) of the timed prefill buckets, coarse grid (level 0) first."""
    if device.type != "cuda":
        return [(0, list(lens)) for lens in CPU_PREFILL]
    grid = []
    for n in PREFILL_SEQS:
        for length in PREFILL_LENS:
            if n * length <= MAX_PREFILL_TOKENS:
                grid.append((max(_level(n, PREFILL_SEQS), _level(length, PREFILL_LENS)), [length] * n))
    grid += [(1, list(lens)) for lens in PREFILL_RAGGED]
    return _coarse_first(grid, group=lambda item: len(item[1]))


def wave_batches(spec: AttentionSpec, sms: int | None) -> list[int]:
    """The decode batch sizes that the grid adds at the first WAVE_EDGES wave edges of a GPU with ``sms``
    multiprocessors (see WAVE_EDGES): per edge k x sms / kv_heads the largest batch with k rounds (unless a grid
    value within 5% below it has k rounds too) and the smallest with k + 1, within the grid's range, none of them a
    DECODE_BATCHES value. ``sms`` None (no GPU, or unknown): none."""
    if not sms:
        return []
    out = []
    for k in range(1, WAVE_EDGES + 1):
        edge = k * sms / spec.num_kv_heads
        below = math.floor(edge)
        above = below + 1
        if above > DECODE_BATCHES[-1]:
            break
        if below >= 1 and not any(0.95 * below <= b <= below for b in DECODE_BATCHES):
            out.append(below)
        if above not in DECODE_BATCHES:
            out.append(above)
    return sorted(set(out))


def device_sms(device: torch.device) -> int | None:
    """The multiprocessor count of a CUDA device; None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_grid(spec: AttentionSpec, device: torch.device, free_bytes: int | None = None,
                mode: str = "eager", sms: int | None = None) -> list[tuple[int, int, int]]:
    """(level, batch, context length) of the timed decode buckets, coarse grid first (graph mode: the contexts of
    GRAPH_DECODE_CTX, a bucket's level that of its batch size). A bucket's KV cache (eager: at the power of two
    below its context) is at most MAX_DECODE_KV_BYTES and, given the device's free memory, a sixth of it (the torch
    backend gathers a copy, and a server may select after loading its weights); the cells left out are served by
    their nearest neighbour. ``sms``: the GPU's
    multiprocessor count, which adds the batch sizes at its wave edges (``wave_batches``, finest level)."""
    if device.type != "cuda":
        return [(0, b, c) for b, c in CPU_DECODE]
    cap = MAX_DECODE_KV_BYTES if free_bytes is None else min(MAX_DECODE_KV_BYTES, free_bytes // 6)
    # each context with its power of two (eager: 32 tokens below it), which the levels and the cap go by: the half
    # tile (under 1%) would push every bucket that sits exactly at the 4 GiB cap out of the grid (64 x 16384, ...)
    contexts, bases = (GRAPH_DECODE_CTX, GRAPH_DECODE_CTX) if mode == "graph" else (DECODE_CTX, DECODE_CTX_POW2)
    waves = wave_batches(spec, sms)
    grid = []
    for b in sorted(DECODE_BATCHES + tuple(waves)):
        for c, base in zip(contexts, bases):
            if decode_bytes(spec, b, base) <= cap:
                # graph mode: a batch size's level only (its table scores each batch size over all its contexts)
                batch_level = 2 if b in waves else _level(b, DECODE_BATCHES)
                level = batch_level if mode == "graph" else max(batch_level, _level(base, bases))
                grid.append((level, b, c))
    return _coarse_first(grid)


def ragged_decode_lens(batch: int, mean: int) -> list[int]:
    """The context lengths of a ragged timing batch: log-uniform from 1/16 to 4 (relative), scaled to ``mean`` on
    average exactly (each at least 1), in a fixed shuffled order (rows sorted by length would favour one kernel's
    scheduling)."""
    if batch == 1:
        return [mean]
    weights = [2.0 ** (-4 + 6 * i / (batch - 1)) for i in range(batch)]
    scale = mean * batch / sum(weights)
    lens = [max(1, round(w * scale)) for w in weights]
    lens[-1] += mean * batch - sum(lens)  # the longest row takes the rounding: the mean is exact
    order = sorted(range(batch), key=lambda i: (i * 0.6180339887) % 1.0)  # golden-ratio shuffle
    return [lens[i] for i in order]


def ragged_decode_grid(spec: AttentionSpec, device: torch.device, free_bytes: int | None = None,
                       mode: str = "eager") -> list[tuple[int, list[int]]]:
    """(level 0, context lengths) of the ragged decode buckets: eager mode on a GPU only (a CUDA graph is captured
    per batch size and keyed by it alone); capped like decode_grid."""
    if device.type != "cuda" or mode != "eager":
        return []
    cap = MAX_DECODE_KV_BYTES if free_bytes is None else min(MAX_DECODE_KV_BYTES, free_bytes // 6)
    grid = []
    for b in RAGGED_DECODE_BATCHES:
        for m in RAGGED_DECODE_MEANS:
            lens = ragged_decode_lens(b, m)
            if decode_bytes(spec, 1, sum(lens)) <= cap:
                grid.append((0, lens))
    return grid


def ragged_key(lens: list[int]) -> tuple[int, int]:
    """The bucket coordinates of a ragged decode batch: (batch, mean context rounded up), as Selection.plan_decode
    computes them from ``context_tokens``."""
    return (len(lens), -(-sum(lens) // len(lens)))


def reps_for(mode: str, device: torch.device) -> int:
    """Samples per candidate and bucket (module doc)."""
    if device.type != "cuda":
        return CPU_REPS
    return REPS_EAGER if mode == "eager" else REPS


def prefill_workloads(spec: AttentionSpec, device: torch.device) -> list[tuple[str, list[int]]]:
    """(label, sequence lengths) of the prefill grid, for tools that time shapes one by one."""
    return [(prefill_label(lens), lens) for _, lens in prefill_grid(spec, device)]


def decode_workloads(spec: AttentionSpec, device: torch.device) -> list[tuple[str, int, int]]:
    """(label, batch, context length) of the (eager) decode grid."""
    return [(f"{b}x{c}", b, c) for _, b, c in decode_grid(spec, device, sms=device_sms(device))]


def make_prefill_workload(spec: AttentionSpec, device: torch.device, label: str, lens: list[int]) -> Workload:
    cu = cumulative(lens, device)
    total, dt = sum(lens), spec.torch_dtype
    q = torch.randn(total, spec.num_q_heads, spec.head_dim, device=device, dtype=dt)
    k = torch.randn(total, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    v = torch.randn_like(k)
    return Workload(label, (cu, cu, max(lens), max(lens)), (q, k, v))


def make_decode_workload(spec: AttentionSpec, device: torch.device, label: str, batch: int, ctx: int) -> Workload:
    ps, dt = spec.page_size, spec.torch_dtype
    pages = math.ceil(ctx / ps)
    k_cache = torch.randn(batch * pages, ps, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    k_cache = k_cache.to(spec.kv_torch_dtype)
    v_cache = _random_like(k_cache)
    page_table = torch.randperm(batch * pages, device=device).to(torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device=device, dtype=dt)
    return Workload(label, (page_table, seq_lens), (q, k_cache, v_cache))


def make_ragged_decode_workload(spec: AttentionSpec, device: torch.device, label: str, lens: list[int]) -> Workload:
    """A decode batch whose sequences have the given context lengths (shuffled pages; unused table columns 0)."""
    ps, dt = spec.page_size, spec.torch_dtype
    pages = [math.ceil(n / ps) for n in lens]
    k_cache = torch.randn(sum(pages), ps, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    k_cache = k_cache.to(spec.kv_torch_dtype)
    v_cache = _random_like(k_cache)
    order = torch.randperm(sum(pages), device=device).to(torch.int32)
    page_table = torch.zeros((len(lens), max(pages)), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = order[start:start + n]
        start += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), spec.num_q_heads, spec.head_dim, device=device, dtype=dt)
    return Workload(label, (page_table, seq_lens), (q, k_cache, v_cache))


def prefill_flops(spec: AttentionSpec, lens: list[int]) -> float:
    """FLOPs of causal attention (half the square per sequence), 4 per multiply-add pair of the two matmuls."""
    return sum(4 * spec.num_q_heads * spec.head_dim * n * n / (2 if spec.causal else 1) for n in lens)


def decode_bytes(spec: AttentionSpec, batch: int, ctx: int) -> float:
    item = torch.finfo(spec.torch_dtype).bits // 8
    return 2 * batch * ctx * spec.num_kv_heads * spec.head_dim * item


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def num_sets(set_bytes: int, device: torch.device) -> int:
    """How many input sets a bucket rotates over so that their total exceeds ROTATE_L2 x the L2 size."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SETS, math.ceil(ROTATE_L2 * l2_bytes(device) / max(set_bytes, 1))))


def _random_like(t: torch.Tensor) -> torch.Tensor:
    """Standard-normal values in t's shape and dtype (fp8 included, which randn cannot make directly)."""
    return torch.randn(t.shape, device=t.device).to(t.dtype)


def feature_inputs(spec: AttentionSpec, phase: str, device: torch.device) -> dict:
    """The run-time feature inputs of a timing workload (sinks; fp8 k/v scales in decode), as the spec needs them."""
    kwargs = {}
    if spec.sinks:
        kwargs["sinks"] = torch.zeros(spec.num_q_heads, dtype=torch.float32, device=device)
    if spec.kv_dtype is not None and phase == "decode":
        kwargs.update(k_scale=torch.ones(1, device=device), v_scale=torch.ones(1, device=device))
    return kwargs


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rotated_workloads(spec: AttentionSpec, phase: str, shape, device: torch.device) -> tuple[tuple, list[tuple]]:
    """(plan_args, input sets) of one bucket: one plan, several input sets of the same shapes (HBM rotation)."""
    if phase == "prefill":
        first = make_prefill_workload(spec, device, "", shape)
    elif isinstance(shape, list):
        first = make_ragged_decode_workload(spec, device, "", shape)
    else:
        first = make_decode_workload(spec, device, "", *shape)
    count = num_sets(_nbytes(first.inputs), device)
    sets = [first.inputs] + [tuple(_random_like(t) for t in first.inputs) for _ in range(count - 1)]
    return first.plan_args, sets


def bench(fn, device: torch.device, target_s: float = 0.02, reps: int = 5) -> float:
    """Median seconds per call of fn, timed with CUDA events (host clock on CPU), after a warm-up. fn's inputs are
    the caller's: for HBM-resident numbers use ``measure`` (it rotates input sets)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    n = max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def capture(run, sets: list[tuple], device: torch.device) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """One CUDA graph holding run(*s) for every input set s (after a warm-up call outside capture); returns the
    graph and the outputs it writes. Raises what the capture raises. The caller keeps ``run`` (and so the buffers
    its plan allocated) alive as long as the graph: the graph holds device pointers only."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(*sets[0])  # warm-up outside capture (lazy init, autotuning)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [run(*s) for s in sets]
    return graph, outs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


@dataclasses.dataclass
class _Timed:
    """One candidate prepared for one bucket: unit() runs `calls` calls (eager: from the shared cursor); outputs()
    gives (input set index, output) pairs to check once the timing is done. plan: the run function, kept alive as
    long as its graph (a CUDA graph holds device pointers, not Python references: a plan freed while its graph is
    replayed lets the graph write into memory the allocator has handed to someone else)."""

    unit: Callable[[int], None]
    calls: int
    outputs: Callable[[], list[tuple[int, torch.Tensor]]]
    plan: Callable
    repeat: int = 1


def _prepare(backend, spec: AttentionSpec, phase: str, plan_args: tuple, sets: list[tuple], mode: str,
             device: torch.device) -> _Timed:
    plan = backend.plan_prefill if phase == "prefill" else backend.plan_decode
    run = functools.partial(plan(spec, *plan_args), **feature_inputs(spec, phase, device))
    if mode == "graph":
        graph, outs = capture(run, sets, device)

        def replayed() -> list[tuple[int, torch.Tensor]]:
            """After the timed replays: NaN into the outputs, one more replay; the first and last set's outputs (the
            last only when the plan writes every call into one buffer)."""
            for out in outs:
                out.fill_(float("nan"))
            graph.replay()
            last = len(outs) - 1
            return [(last, outs[last])] if outs[0].data_ptr() == outs[last].data_ptr() else [(0, outs[0]),
                                                                                             (last, outs[last])]

        return _Timed(lambda cursor: graph.replay(), len(sets), replayed, run)
    count = len(sets)

    def unit(cursor: int) -> None:
        run(*sets[cursor % count])

    def called_again() -> list[tuple[int, torch.Tensor]]:
        """After the timing: one call, its output NaN-filled and held, then the call that is checked (a run that skips
        its work would hand back the first call's memory)."""
        held = run(*sets[-1])
        clear_output(held, sets[-1])
        out = run(*sets[-1])  # computed while `held` is alive: it cannot reuse held's memory
        return [(count - 1, out)]

    unit(0)  # warm-up (lazy initialisation, first-call autotuning)
    return _Timed(unit, 1, called_again, run)


def _sample(item: _Timed, cursor: int, device: torch.device) -> float:
    """Seconds per call of item.repeat units starting at cursor."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(item.repeat):
            item.unit(cursor + i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / (item.repeat * item.calls)
    t0 = time.perf_counter()
    for i in range(item.repeat):
        item.unit(cursor + i)
    return (time.perf_counter() - t0) / (item.repeat * item.calls)


def _calibrate(item: _Timed, cursor: int, device: torch.device) -> int:
    """Set item.repeat so that a sample lasts at least SAMPLE_S (CUDA), growing it until a measured sample does;
    returns the cursor after the calibration samples. The first sample (one call, possibly cold after the other
    candidates ran) is not trusted. On CPU one sample only checks that the candidate runs."""
    item.repeat = 1
    _sample(item, cursor, device)
    cursor += 1
    if device.type != "cuda":
        return cursor
    while True:
        seconds = _sample(item, cursor, device) * item.repeat * item.calls
        cursor += item.repeat
        if seconds >= SAMPLE_S or item.repeat >= MAX_REPEAT:
            return cursor
        item.repeat = min(MAX_REPEAT, max(2 * item.repeat, math.ceil(item.repeat * SAMPLE_S / max(seconds, 1e-9))))


def host_probe(device: torch.device) -> float | None:
    """How fast the host launches work right now: seconds per launch of a one-element add on ``device``, the least
    of two runs of HOST_PROBE_CALLS launches after a sync (the queue empty: launches do not wait on the GPU), and a
    sync after (the next timed sample starts on an empty queue). None off CUDA. Eager calls of small batches are
    bound by this host time (module doc)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    x = _probe_tensor(index)
    torch.cuda.synchronize(index)
    best = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(HOST_PROBE_CALLS):
            x.add_(0)
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize(index)
    return best / HOST_PROBE_CALLS


@functools.lru_cache(maxsize=None)
def _probe_tensor(index: int) -> torch.Tensor:
    """The probe's one-element tensor on CUDA device ``index`` (kept: the probe must not allocate)."""
    return torch.zeros(1, device=torch.device("cuda", index))


def time_bucket(backends_: dict, spec: AttentionSpec, phase: str, shape, device: torch.device, mode: str,
                reps: int) -> dict:
    """Time every candidate on one bucket, interleaved. Returns {"us": {name: median us per call},
    "spread": {name: (max - min) / median}, "errors": {name: reason}, "host_us": the median host probe (eager on
    CUDA; else None), "wall_s": {step: seconds}}: where the bucket's time went (inputs, plans and first runs,
    calibration, samples, output checks; summed per phase by measure, so that a report can say what a selection's
    timing cost)."""
    wall = {}
    t_step = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal t_step
        now = time.perf_counter()
        wall[step] = wall.get(step, 0.0) + now - t_step
        t_step = now

    plan_args, sets = rotated_workloads(spec, phase, shape, device)
    lap("inputs")
    prepared: dict[str, _Timed] = {}
    errors: dict[str, str] = {}
    for name, backend in backends_.items():
        try:
            prepared[name] = _prepare(backend, spec, phase, plan_args, sets, mode, device)
            _sync(device)
        except Exception as exc:
            what = "CUDA graph capture" if mode == "graph" else "plan or first run"
            errors[name] = f"{what} failed: {type(exc).__name__}: {_first_line(exc)}"
    lap("plans")
    cursor = 0
    for name, item in list(prepared.items()):  # calibrate: a sample lasts at least SAMPLE_S
        try:
            cursor = _calibrate(item, cursor, device)
        except Exception as exc:
            errors[name] = f"raised {type(exc).__name__}: {_first_line(exc)}"
            del prepared[name]
    lap("calibration")
    samples: dict[str, list[float]] = {name: [] for name in prepared}
    order = list(prepared)
    probes_us: list[float] = []
    for r in range(reps):
        probe = host_probe(device) if mode == "eager" and order else None
        if probe is not None:
            probes_us.append(probe * 1e6)
        shift = r % len(order) if order else 0
        for name in order[shift:] + order[:shift]:
            if name not in prepared:
                continue
            item = prepared[name]
            try:
                samples[name].append(_sample(item, cursor, device))
            except Exception as exc:
                errors[name] = f"raised {type(exc).__name__}: {_first_line(exc)}"
                del prepared[name]
            cursor += item.repeat
    lap("samples")
    references: dict = {}  # input set index -> cases.SpotReference, shared by the candidates
    for name, item in list(prepared.items()):  # a fast wrong answer must not win: check what the timed plan computed
        reason = _timed_output_reason(item, spec, phase, plan_args, sets, device, references)
        if reason:
            errors[name] = f"wrong output after the timed {mode} runs: {reason}"
            del prepared[name]
    us, spread = {}, {}
    for name, values in samples.items():
        if name in prepared and values:
            med = statistics.median(values)
            us[name] = med * 1e6
            spread[name] = (max(values) - min(values)) / med if med > 0 else 0.0
    lap("checks")
    del prepared, sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    lap("freeing")
    return {"us": us, "spread": spread, "errors": errors,
            "host_us": statistics.median(probes_us) if probes_us else None, "wall_s": wall}


def _timed_output_reason(item: _Timed, spec: AttentionSpec, phase: str, plan_args: tuple, sets: list[tuple],
                         device: torch.device, references: dict) -> str | None:
    """Why the candidate's timed plan computed a wrong output, or None. A reference that cannot be computed (out of
    memory, say) skips the check with a warning: the checker's failure is not the candidate's."""
    try:
        outputs = item.outputs()
        _sync(device)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {_first_line(exc)}"
    for index, out in outputs:
        if index not in references:
            try:
                references[index] = spot_reference(spec, phase, plan_args, sets[index], feature_inputs(spec, phase,
                                                                                                     device))
            except Exception as exc:
                log.warning("timed outputs of %s %s not checked: the reference failed: %s: %s", phase,
                            spec.describe(), type(exc).__name__, _first_line(exc))
                references[index] = None
        if references[index] is None:
            continue
        reason = spot_compare(references[index], out)
        if reason:
            return f"input set {index + 1} of {len(sets)}: {reason}"
    return None


def _free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def measure(spec: AttentionSpec, phase: str, names: list[str], device: torch.device, mode: str,
            budget_s: float | None = None, reps: int | None = None, grid: list | None = None,
            max_budget_s: float | None = None) -> dict:
    """Time the candidates ``names`` of one phase on every bucket of the phase's grid, interleaved (module doc).

    Buckets go coarse grid first; once ``budget_s`` seconds are spent the remaining buckets are skipped (listed in
    "skipped"), so a tight budget gives a coarser table, never a missing range. Up to ``plan_allowance`` of the
    candidates' plans and first calls (first-use compiles; under CUDA graphs also the captures) is not counted
    (``max_budget_s``: the most a phase's budget may be, half the worker's task timeout). ``grid``: (level, shape)
    items instead of the phase's grid (prefill: sequence lengths; decode: (batch, context), or a list of context
    lengths for a ragged bucket: eager decode times ragged_decode_grid's after the coarse grid). Returns a JSON-able
    dict:
    ``{"phase", "mode", "grid_version", "axes", "reps", "buckets": [{"key", "label", "us", "spread", "errors",
    "host_us", "host" (eager on CUDA: the bucket's median probe and its ratio to host_reference), "ragged": true on a
    ragged decode bucket only}],
    "skipped": [labels], "pruned", "wall_s", "counted_s": what the budget counted of it, "steps_s": {step:
    seconds over the buckets}}``.
    """
    from .. import backends

    reps = reps or reps_for(mode, device)
    t0 = time.perf_counter()
    cands = {name: backends.get(name) for name in names}
    if grid is None:
        if phase == "prefill":
            grid = [(lvl, lens) for lvl, lens in prefill_grid(spec, device)]
        else:
            free = _free_bytes(device)
            grid = [(lvl, (b, c)) for lvl, b, c in decode_grid(spec, device, free, mode, device_sms(device))]
            coarse_end = sum(1 for lvl, _ in grid if lvl == 0)  # ragged buckets right after the coarse grid
            grid[coarse_end:coarse_end] = ragged_decode_grid(spec, device, free, mode)
    buckets, skipped, pruned = [], [], {}
    steps: dict[str, float] = {}  # seconds per time_bucket step, over the buckets
    allowance = plan_allowance(budget_s, max_budget_s)
    coarse: list[dict] = []
    for level, shape in grid:
        ragged = phase == "decode" and isinstance(shape, list)  # a decode batch's context lengths
        if phase == "prefill":
            key, label = prefill_key(shape), prefill_label(shape)
        elif ragged:
            key = ragged_key(shape)
            label = f"ragged {key[0]} (mean {key[1]}, max {max(shape)})"
        else:
            key, label = tuple(shape), f"{shape[0]}x{shape[1]}"
        if budget_s is not None and buckets and _counted(time.perf_counter() - t0, steps, allowance) > budget_s:
            skipped.append(label)
            continue
        if level > 0 and coarse is not None:  # the coarse grid is done: prune once
            pruned = prune(coarse, list(cands))
            for name, ratio in pruned.items():
                log.info("%s %s: %s is not timed on the finer grid (at least %.2fx the fastest in every coarse "
                         "bucket)", phase, spec.describe(), name, ratio)
            cands = {n: b for n, b in cands.items() if n not in pruned}
            coarse = None
        timed = time_bucket(cands, spec, phase, shape, device, mode, reps)
        if pruned and timed["errors"]:  # a timed candidate failed here: the pruned ones may have to serve it
            log.info("%s %s %s: %s failed; timed again with the pruned candidates", phase, spec.describe(), label,
                     ", ".join(timed["errors"]))
            _add_steps(steps, timed)
            timed = time_bucket({**cands, **{n: backends.get(n) for n in pruned}}, spec, phase, shape, device,
                                mode, reps)
        _add_steps(steps, timed)
        buckets.append({"key": list(key), "label": label, **({"ragged": True} if ragged else {}), **timed})
        if level == 0 and coarse is not None and not ragged:  # pruning reads the uniform coarse grid only
            coarse.append(timed)
    reference = host_reference([b["host_us"] for b in buckets if b.get("host_us")])
    for b in buckets:  # the host's speed while a bucket was timed, over the phase's reference
        if b.get("host_us"):
            b["host"] = b["host_us"] / reference
    wall = time.perf_counter() - t0
    return {"phase": phase, "mode": mode, "grid_version": GRID_VERSION,
            "axes": list(PREFILL_AXES if phase == "prefill" else DECODE_AXES), "reps": reps, "buckets": buckets,
            "skipped": skipped, "pruned": pruned, "wall_s": wall,
            "counted_s": _counted(wall, steps, allowance), "steps_s": steps}


def host_reference(probes_us: list[float]) -> float | None:
    """A phase's reference host probe: the lower decile of its buckets' probes (the least with fewer than 10), so
    that one bucket timed in a lucky moment does not make every other look slow. None without probes."""
    if not probes_us:
        return None
    ordered = sorted(probes_us)
    return ordered[(len(ordered) - 1) // 10] if len(ordered) >= 10 else ordered[0]


def plan_allowance(budget_s: float | None, max_budget_s: float | None = None) -> float:
    """Seconds of a phase's plans and first calls that its budget does not count: PLAN_ALLOWANCE_S, at most
    PLAN_ALLOWANCE_SHARE of the most a phase's budget may be (``max_budget_s``, half the task timeout; else the
    budget itself), so that a phase ends within its task's timeout. Both launch modes (module doc:
    PLAN_ALLOWANCE_S)."""
    cap = max_budget_s if max_budget_s else budget_s
    return min(PLAN_ALLOWANCE_S, PLAN_ALLOWANCE_SHARE * cap) if budget_s else 0.0


def _counted(elapsed: float, steps: dict[str, float], allowance: float) -> float:
    """The part of a phase's elapsed seconds that its time budget counts: all but up to ``allowance`` of the
    candidates' plans and first calls (where first-use compiles happen)."""
    return elapsed - min(steps.get("plans", 0.0), allowance)


def _add_steps(steps: dict[str, float], timed: dict) -> None:
    """Move a time_bucket result's per-step seconds into the phase's sums."""
    for step, seconds in timed.pop("wall_s", {}).items():
        steps[step] = steps.get(step, 0.0) + seconds


def prune(coarse: list[dict], names: list[str], factor: float = PRUNE) -> dict[str, float]:
    """The candidates at least ``factor`` times slower than the fastest in every one of the ``coarse`` buckets
    (time_bucket results) where they have a time, each with its least ratio there. A bucket where a candidate has
    no time (it failed there; the bucket reports why) does not keep it, but a candidate needs a time in at least
    one coarse bucket to be pruned. At least one candidate always stays."""
    ratios: dict[str, float] = {}
    for name in names:
        per_bucket = [timed["us"][name] / min(timed["us"].values()) for timed in coarse if name in timed["us"]]
        if per_bucket and min(per_bucket) >= factor:
            ratios[name] = min(per_bucket)
    if len(ratios) >= len(names):
        return {}
    return ratios


def probes(device: torch.device) -> dict:
    """Copy (bytes read + written) and read-only bandwidth in TB/s on 2 GiB."""
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.nbytes / bench(lambda: y.copy_(x), device) / 1e12
    read = x.nbytes / bench(lambda: x.sum(dtype=torch.float32), device) / 1e12
    return {"copy_tbps": copy, "read_tbps": read}  # x and y are freed on return
