"""The timed shapes: the bucket grids of each phase (levels, wave-edge batch sizes, ragged decode batches), their
keys and labels, and the workloads built for a bucket (input sets rotated so that timed reads come from HBM)."""
from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from ..spec import AttentionSpec
from .inputs import cumulative

ROTATE_L2 = 2.0  # input sets of a bucket total at least this many times the L2 size
MAX_SETS = 4096  # enough for one 18-token prompt of 8/1 heads (46 KB a set); the shortest decode buckets of one
# KV head (48 tokens, fp8 or head_dim 64: ~14 KB a set) rotate through less than 2x L2, where calls are launch-bound
DEFAULT_L2_BYTES = 50 << 20  # an H200's L2; used when the device does not report its L2 size

# Timed representatives (bucket centres). Buckets are the cells between the geometric midpoints of neighbouring
# values on each axis; a shape outside the grid is clamped to the nearest end. Prompt lengths are 9/8 of powers of
# two: real prompts end inside a kernel's tile, and a grid of whole tiles flatters the backends whose tiles fit it.
# Prompt lengths and decode batch sizes go in steps of sqrt(2): the kernels' speed is not monotone between powers of
# two (tiles, waves over the SMs, split heuristics; see the results file). The values between powers of two form the
# finest level (2).
# The ranges cover what a server sends: prompts from 16 tokens (short prompts are not the 72-token bucket's regime:
# FlashInfer ran a 40 x 25 batch 2.5x slower than 13 x 26, FA3 did not) and decode batches to 512 rows
# (CUDA-graph capture sizes go that far): beyond the grid's ends a shape is served by its edge bucket, which
# held-out cells found up to 1.15-1.7x off the fastest (see the results file).
PREFILL_SEQS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_LENS = (18, 25, 36, 51, 72, 102, 144, 204, 288, 407, 576, 815, 1152, 1629, 2304, 3258, 4608, 6516, 9216, 13033,
                18432)
MAX_PREFILL_TOKENS = 32768
DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512)
# Eager decode contexts end half-way into a 64-token tile (a power of two plus 32), as a context drawn at random does
# on average: contexts of whole tiles flatter the kernels that work in whole tiles (Triton's 64-token blocks against
# FlashInfer's 16-token pages; see the results file). Levels and the memory cap go by the powers of two
# (DECODE_CTX_POW2). Graph mode's contexts (GRAPH_DECODE_CTX) stay whole powers of two: not measured with half tiles.
DECODE_CTX_POW2 = (256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_TILE_TAIL = 32
DECODE_CTX = tuple(c + DECODE_TILE_TAIL for c in DECODE_CTX_POW2)
# Below the first one, eager decode times one more context at the finest level, DECODE_SHORT_CTX: a few rows of
# short chats (contexts under 64) ran 1.05-1.19x slow on FlashInfer's FA3 template, which the grid's first context
# had pick (see the results file). Graph mode scores a batch size over its contexts and needs none.
DECODE_SHORT_CTX = 48
# Ragged decode buckets (eager mode): batches whose rows' contexts follow a serving batch's spread (log-normal,
# RAGGED_ROW_SIGMA; the longest row 3x the mean at 8 rows, 13x at 512), timed as a sub-table keyed like the uniform
# one (batch, mean context) and used for batches of similar skew (longest row at least RAGGED_SKEW times the mean)
# near the timed ones (dispatch.DispatchTable.covers): on such batches the uniform table's choice for their
# (batch, mean) can be far from the fastest (Triton's split of the context is even over the rows, FA3's and
# FlashInfer's are not; see the results file).
RAGGED_DECODE_BATCHES = (8, 32, 128, 512)
RAGGED_DECODE_MEANS = (256, 512, 1024, 4096)  # 512: FlashInfer's lead at mean 256 turns into FA3's at 1024 on
# 128-512 rows, and interpolating across that 4x step served batches of means 387-614 at up to 1.15x (results file)
RAGGED_ROW_SIGMA = 1.0  # log-normal sigma of a batch's rows around its median (bench_cells draws held-out ones so)
RAGGED_SKEW = 2.5  # below it the ragged buckets do not serve a batch (milder skews were not timed); extend's
# skewed estimate starts here too (eager decode's at DECODE_SKEW)
DECODE_SKEW = 1.5  # an eager decode batch the ragged buckets do not serve, with its longest row at least this many
# times its mean, is estimated as the uniform batch at its mean plus one row of its longest context
# (dispatch.DispatchTable._skewed): few-row batches of 1.5-1.8x skews were served up to 1.7x slow by the mean alone
# (see the results file)
# Wave edges (eager and graph decode): a kernel that runs one thread block per (row, KV head) and does not split
# the context (FA3 once the blocks fill 0.8 of the SMs) takes ceil(batch x kv_heads / SMs) rounds, so its time steps
# up right past batch = k x SMs / kv_heads, and the sqrt(2) grid above brackets such an edge with two values on its
# sides: the lookup's interpolation between them then credits the kernel with the lower round count (at 28/4 heads
# on 132 SMs it would give 100 rows to FA3, from 91 and 128 rows, where FlashInfer is faster; see the results file).
# So for the first WAVE_EDGES edges, where a round is at least a third of the time, the grid holds the batch sizes on
# both sides of the edge (``wave_batches``): the last one with k rounds, unless a grid value within 5% below it
# already has k rounds, and the first one with k + 1.
WAVE_EDGES = 3
GRAPH_DECODE_CTX = (256, 1024, 4096, 16384)  # graph mode scores a batch size over contexts: 4x steps suffice
# (there a bucket's level is its batch size's: every batch size is timed at all four contexts together)
GRAPH_RAGGED_MEANS = (2048,)  # and over a ragged batch of each size (rows spread as served, RAGGED_ROW_SIGMA): a
# graph replays at every batch an engine pads to that size, ragged ones above all, and a plan made at capture
# cannot size its splits for a batch's long rows (engine_capture), so the uniform contexts alone overrate a kernel
# that relies on them
MAX_DECODE_KV_BYTES = 4 << 30
CPU_PREFILL = ([16], [24, 8])  # the interpreter and CPU torch: tiny workloads only
CPU_DECODE = ((1, 32), (4, 32))

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
    GRAPH_DECODE_CTX, a bucket's level that of its batch size; eager: DECODE_CTX and DECODE_SHORT_CTX, the latter at
    the finest level). A bucket's KV cache (eager: at the power of two
    below its context) is at most MAX_DECODE_KV_BYTES and, given the device's free memory, a sixth of it (the torch
    backend gathers a copy, and a server may select after loading its weights); the cells left out are served by
    their nearest neighbour. ``sms``: the GPU's
    multiprocessor count, which adds the batch sizes at its wave edges (``wave_batches``, finest level)."""
    if device.type != "cuda":
        return [(0, b, c) for b, c in CPU_DECODE]
    cap = MAX_DECODE_KV_BYTES if free_bytes is None else min(MAX_DECODE_KV_BYTES, free_bytes // 6)
    # each context with its power of two (eager: 32 tokens below it), which the levels and the cap go by: the half
    # tile (under 1%) would push every bucket that sits exactly at the 4 GiB cap out of the grid (64 x 16384, ...)
    # (context, its base, the context's level): graph mode goes by a batch size's level only (its table scores each
    # batch size over all its contexts); eager's short context is at the finest level
    if mode == "graph":
        columns = [(c, c, 0) for c in GRAPH_DECODE_CTX]
    else:
        columns = [(c, base, _level(base, DECODE_CTX_POW2)) for c, base in zip(DECODE_CTX, DECODE_CTX_POW2)]
        columns.append((DECODE_SHORT_CTX, DECODE_SHORT_CTX, 2))
    waves = wave_batches(spec, sms)
    grid = []
    for b in sorted(DECODE_BATCHES + tuple(waves)):
        batch_level = 2 if b in waves else _level(b, DECODE_BATCHES)
        grid += [(max(batch_level, level), b, c) for c, base, level in columns if decode_bytes(spec, b, base) <= cap]
    return _coarse_first(grid)


def ragged_decode_lens(batch: int, mean: int) -> list[int]:
    """The context lengths of a ragged timing batch: the quantiles (i + 1/2) / batch of a log-normal of sigma
    RAGGED_ROW_SIGMA, scaled to ``mean`` on average exactly (each at least 1), in a fixed shuffled order (rows sorted
    by length would favour one kernel's scheduling)."""
    if batch == 1:
        return [mean]
    normal = statistics.NormalDist()
    weights = [math.exp(RAGGED_ROW_SIGMA * normal.inv_cdf((i + 0.5) / batch)) for i in range(batch)]
    scale = mean * batch / sum(weights)
    lens = [max(1, round(w * scale)) for w in weights]
    lens[-1] += mean * batch - sum(lens)  # the longest row takes the rounding: the mean is exact
    order = sorted(range(batch), key=lambda i: (i * 0.6180339887) % 1.0)  # golden-ratio shuffle
    return [lens[i] for i in order]


def ragged_decode_grid(spec: AttentionSpec, device: torch.device, free_bytes: int | None = None,
                       mode: str = "eager", sms: int | None = None) -> list[tuple[int, list[int]]]:
    """(level, context lengths) of the ragged decode buckets, on a GPU only. Eager: RAGGED_DECODE_BATCHES x
    RAGGED_DECODE_MEANS at level 0, a sub-table of their own. Graph: every batch size of the graph grid
    (``decode_grid``) but 1 at GRAPH_RAGGED_MEANS, at its batch size's level (scored with its uniform contexts). A
    bucket's KV is at most MAX_DECODE_KV_BYTES and, given the device's free memory, a sixth of it under graphs (as a
    uniform bucket's; ``left_out``: torch where its copy does not fit), in eager mode its KV and the torch backend's
    copy (``torch_decode_copy_bytes``) at most half of it: torch gathers every row to the longest row's width, batch x
    longest, 3-13x a ragged bucket's KV (8-512 rows); a third would leave out 512 rows of 1024 on average for 8 KV
    heads of 128 on an idle H100, which the batches of a busy server need."""
    if device.type != "cuda":
        return []
    if mode == "graph":
        levels = {b: lvl for lvl, b, _ in decode_grid(spec, device, free_bytes, mode, sms)}
        shapes = [(lvl, b, m) for b, lvl in sorted(levels.items()) if b > 1 for m in GRAPH_RAGGED_MEANS]
    else:
        shapes = [(0, b, m) for b in RAGGED_DECODE_BATCHES for m in RAGGED_DECODE_MEANS]
    grid = []
    for level, b, m in shapes:
        lens = ragged_decode_lens(b, m)
        kv = decode_bytes(spec, 1, sum(lens))
        if mode == "graph":  # torch is timed where its copy fits too (left_out)
            fits = free_bytes is None or kv <= free_bytes // 6
        else:
            fits = torch_copy_fits(spec, lens, free_bytes)
        if kv <= MAX_DECODE_KV_BYTES and fits:
            grid.append((level, lens))
    return grid


def torch_copy_fits(spec: AttentionSpec, lens: list[int], free_bytes: int | None) -> bool:
    """Whether a ragged batch's KV and the torch backend's copy of every row to the longest
    (``torch_decode_copy_bytes``) stay within half the free memory (unknown free memory: yes)."""
    return free_bytes is None or (decode_bytes(spec, 1, sum(lens))
                                  + torch_decode_copy_bytes(spec, len(lens), max(lens)) <= free_bytes // 2)


def left_out(spec: AttentionSpec, lens: list[int], free_bytes: int | None, mode: str, names) -> dict[str, str]:
    """{candidate: why} for the candidates a ragged bucket is timed without: under CUDA graphs (where the bucket
    stays in the grid for its batch size's score, ``ragged_decode_grid``) torch where its copy of every row to the
    longest (``torch_decode_copy_bytes``) and the KV would pass half the free memory. The batch size is then scored
    without torch (build_table keeps the candidates timed on all its shapes)."""
    if mode != "graph" or "torch" not in names or torch_copy_fits(spec, lens, free_bytes):
        return {}
    kv, copy = decode_bytes(spec, 1, sum(lens)), torch_decode_copy_bytes(spec, len(lens), max(lens))
    return {"torch": f"not timed on this ragged batch: its copy of every row to the longest ({copy / 2**30:.1f} "
                     f"GiB) and the KV ({kv / 2**30:.1f} GiB) would pass half the free memory "
                     f"({free_bytes / 2**30:.1f} GiB)"}


def decode_timing_grid(spec: AttentionSpec, device: torch.device, free_bytes: int | None = None,
                       mode: str = "eager", sms: int | None = None) -> list[tuple[int, tuple | list]]:
    """(level, shape) of every timed decode bucket in timing order: (batch, context) for a uniform one, the context
    lengths for a ragged one. Eager: the ragged buckets right after the uniform coarse grid; graph: each right after
    its batch size's uniform buckets (a budget that stops part-way leaves whole batch sizes out)."""
    grid = [(lvl, (b, c)) for lvl, b, c in decode_grid(spec, device, free_bytes, mode, sms)]
    ragged = ragged_decode_grid(spec, device, free_bytes, mode, sms)
    if mode != "graph":
        coarse_end = sum(1 for lvl, _ in grid if lvl == 0)
        return grid[:coarse_end] + ragged + grid[coarse_end:]
    for item in ragged:
        last = max(i for i, (_, shape) in enumerate(grid) if isinstance(shape, tuple) and shape[0] == len(item[1]))
        grid.insert(last + 1, item)
    return grid


def whole_batch_sizes(buckets: list[dict], skipped: list[str], cut: int | None) -> tuple[list[dict], list[str]]:
    """Graph mode's measured (buckets, skipped) with whole batch sizes only: a table scores a batch size over all its
    shapes (its contexts, its ragged batch), so the timed buckets of ``cut`` (key[0]: the batch size a time budget
    stopped part-way through; None: none) move to ``skipped``, unless they are all there is (a coarser table, never
    none)."""
    kept = [b for b in buckets if b["key"][0] != cut]
    if cut is None or not kept:
        return buckets, skipped
    return kept, [b["label"] for b in buckets if b["key"][0] == cut] + skipped


def ragged_key(lens: list[int]) -> tuple[int, int]:
    """The bucket coordinates of a ragged decode batch: (batch, mean context rounded up), as Selection.plan_decode
    computes them from ``context_tokens``."""
    return (len(lens), -(-sum(lens) // len(lens)))


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


def make_extend_workload(spec: AttentionSpec, device: torch.device, requests: int, q_len: int, ctx: int) -> Workload:
    """``requests`` rows of ``q_len`` queries each over ``ctx`` tokens of context (the queries included), pages
    shuffled: decode's workload with q_len queries per row."""
    work = make_decode_workload(spec, device, "", requests, ctx)
    page_table, seq_lens = work.plan_args
    _, k_cache, v_cache = work.inputs
    q = torch.randn(requests * q_len, spec.num_q_heads, spec.head_dim, device=device, dtype=spec.torch_dtype)
    return Workload(f"{requests}x{q_len} over {ctx}", (cumulative([q_len] * requests, device), page_table, seq_lens,
                                                       q_len, ctx), (q, k_cache, v_cache))


def make_ragged_extend_workload(spec: AttentionSpec, device: torch.device, q_lens: list[int], lens: list[int]
                                ) -> Workload:
    """Rows of ``q_lens`` queries over ``lens`` tokens of context each (the queries included), pages shuffled."""
    work = make_ragged_decode_workload(spec, device, "", lens)
    page_table, seq_lens = work.plan_args
    _, k_cache, v_cache = work.inputs
    q = torch.randn(sum(q_lens), spec.num_q_heads, spec.head_dim, device=device, dtype=spec.torch_dtype)
    return Workload(f"{len(lens)} rows, {sum(q_lens)} queries", (cumulative(q_lens, device), page_table, seq_lens,
                                                                  max(q_lens), max(lens)), (q, k_cache, v_cache))


def prefill_flops(spec: AttentionSpec, lens: list[int]) -> float:
    """FLOPs of causal attention (half the square per sequence), 4 per multiply-add pair of the two matmuls."""
    return sum(4 * spec.num_q_heads * spec.head_dim * n * n / (2 if spec.causal else 1) for n in lens)


def decode_bytes(spec: AttentionSpec, batch: int, ctx: int) -> float:
    item = torch.finfo(spec.torch_dtype).bits // 8
    return 2 * batch * ctx * spec.num_kv_heads * spec.head_dim * item


def torch_decode_copy_bytes(spec: AttentionSpec, batch: int, width: int) -> float:
    """The most the torch backend's decode holds of its gathered K and V, ``batch`` rows ``width`` slots wide
    (torch_sdpa.attend_paged): K in the dtype it computes in (float32 with softcap or sinks, else the query's) while
    V is gathered in the cache's dtype and cast (an fp8 cache through a float32 copy and its scaled product)."""
    elems = batch * width * spec.num_kv_heads * spec.head_dim
    item = torch.finfo(spec.torch_dtype).bits // 8
    out = 4 if spec.softcap is not None or spec.sinks else item
    cache = torch.finfo(spec.kv_torch_dtype).bits // 8
    gathering = cache + 8 if spec.kv_dtype is not None else cache + (out if out != cache else 0)
    return elems * (out + gathering)


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
    if spec.kv_dtype is not None and phase != "prefill":
        kwargs.update(k_scale=torch.ones(1, device=device), v_scale=torch.ones(1, device=device))
    return kwargs


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rotated_workloads(spec: AttentionSpec, phase: str, shape, device: torch.device) -> tuple[tuple, list[tuple]]:
    """(plan_args, input sets) of one bucket: one plan, several input sets of the same shapes (HBM rotation)."""
    if phase == "extend" and isinstance(shape[0], list):  # (queries per row, contexts per row)
        first = make_ragged_extend_workload(spec, device, *shape)
    elif phase == "extend":
        first = make_extend_workload(spec, device, *shape)
    elif phase == "prefill":
        first = make_prefill_workload(spec, device, "", shape)
    elif isinstance(shape, list):
        first = make_ragged_decode_workload(spec, device, "", shape)
    else:
        first = make_decode_workload(spec, device, "", *shape)
    count = num_sets(_nbytes(first.inputs), device)
    sets = [first.inputs] + [tuple(_random_like(t) for t in first.inputs) for _ in range(count - 1)]
    return first.plan_args, sets
