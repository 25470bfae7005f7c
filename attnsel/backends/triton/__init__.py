"""triton: our own kernels (kernels.py; the extend phase's plan: extend.py). Always there when FA3 and FlashInfer
are not, so it has to be fast.

Runs compiled on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, for tests).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
from pathlib import Path

import torch

from ...device import package_version
from ...spec import AttentionSpec
from .. import Phase, RunFn
from .. import support
from ..support import capability_reason, dtype_reason, feature_reasons, joined

MAX_HEAD_DIM = 256
INT32_OFFSETS = 2**31  # offsets inside one sequence at or past this need the kernels' LONG (64-bit) variant


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # decode: unused
    block_n: int
    num_warps: int
    num_stages: int


@functools.cache
def sources_hash() -> str:
    """sha256 (12 hex digits) of this package's Python sources: the kernels and how they are launched."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def prefill_config(head_dim: int) -> TileConfig:
    if interpreted():
        return TileConfig(32, 32, 4, 1)
    if head_dim <= 64:
        return TileConfig(128, 64, 4, 3)
    if head_dim <= 128:
        return TileConfig(128, 128, 8, 3)  # the tile sweep's best (see the results file)
    return TileConfig(64, 32, 4, 2)


def decode_config(head_dim: int) -> TileConfig:
    if interpreted():
        return TileConfig(0, 32, 4, 1)
    if head_dim <= 128:  # the tile sweep's best, bf16 and fp8 KV alike (see the results file)
        return TileConfig(0, 64, 4, 4)
    return TileConfig(0, 32, 4, 2)


SPLIT_PROGRAMS_PER_SM = 3  # the split plan aims at this many decode programs per SM
ROOM_BYTES = 16 << 20  # the most partial outputs the room may hold per plan
RAGGED_ROOM, ROOM_PROGRAMS = 8, 8  # decode_splits' room for a ragged replay of a uniform plan (see the results file)
# An eager run of a split plan merges in the decode kernel (the last program of each row and KV head to arrive)
# instead of a second reduce kernel: one launch instead of two, which saves about a third of an eager call at
# host-bound shapes; under CUDA graphs, where launches cost nothing extra, the in-kernel merge is slower (the last
# program merges its group's heads one after another, where the reduce kernel merges every head in parallel), so a
# run captured into a graph takes the reduce kernel (see the results file). Its ordering across SMs (barrier,
# acquire-release count, partials read past L1) is tested by real concurrency
# (tests/test_gpu.py::test_triton_split_decode_merges_under_concurrency). A plan run eagerly and then captured (an
# engine's warm-up, then its graphs) builds the second decode variant and the reduce kernel during capture: Triton
# compiles and loads them there without a device call that capture refuses
# (tests/test_gpu.py::test_decode_plan_reused_many_times_eager_and_graph).
MERGE_IN_DECODE_KERNEL = True
MERGE_TILE_MAX = 8192  # splits (rounded up to a power of 2) x head_dim (rounded up) the in-kernel merge takes
# A decode plan may launch its programs longest row first (kernels.paged_kernel's ORDERED: each run sorts the live
# lengths on the device, one more small kernel) where the batch has at least ORDER_MIN_PROGRAMS_PER_SM (row, KV head)
# pairs per SM: there a ragged batch's long row, one program per KV head, bounds the time when its programs start
# late (Triton runs ragged batches of 64-512 rows 1.12-1.54x behind FA3, which orders its varlen batches so, and
# leads it on uniform ones: results file, seed 3434); smaller batches run in one round anyway, and their host-bound
# eager calls keep the single launch.
# ORDER_ROWS: None (decode_ordered's rule), True (every decode plan of 2 rows or more, the interpreter's included:
# for tests and benchmarks) or False (never). False until timed on a GPU (scripts/triton_order_bench.py): the
# selection validates decode on a small batch, which the rule leaves unordered, so an ordered launch would serve
# large batches that only the CPU tests and the compile check have run.
ORDER_MIN_PROGRAMS_PER_SM = 2
# The split plan sums the batch's lengths in every program, LENS_BLOCK rows at a time (a runtime loop, so one compile
# serves every batch size; a block of the batch's size would compile once per power of two).
LENS_BLOCK = 128
ORDER_ROWS: bool | None = False
# The fewest splits an ordered plan keeps for a ragged replay of a plan made on rows of one length (decode_splits'
# ragged_room): 1 adds none to decode_splits' room, which is 1 split from 256 rows of 8 KV heads up on 132 SMs (a
# replay's long row is then one program per KV head however long it is). Larger values are for benchmarks
# (scripts/triton_order_bench.py) until measured.
ORDER_ROOM_SPLITS = 1


def decode_ordered(batch: int, kv_heads: int, sms: int | None) -> bool:
    """Whether a decode plan of ``batch`` rows launches its rows longest first (see ORDER_MIN_PROGRAMS_PER_SM);
    ``sms``: the GPU's multiprocessor count, None under the interpreter (ordered only when ORDER_ROWS is True)."""
    if batch < 2 or ORDER_ROWS is False:
        return False
    if ORDER_ROWS:
        return True
    return sms is not None and batch * kv_heads >= ORDER_MIN_PROGRAMS_PER_SM * sms


def decode_splits(batch: int, kv_heads: int, max_len: int, total_len: int, block_n: int,
                  sms: int | None, *, ragged_room: bool = False, split_bytes: int = 0) -> tuple[int, int, int]:
    """(num_splits, target, min_chunk) of a decode plan: the grid's split axis, the programs the kernel aims at, and
    the fewest tokens a split reads (kernels.paged_kernel computes each row's splits from these and the lengths
    it reads at run time).

    The batch's tokens (``total_len``, summed over rows, each at most the window) are cut into chunks of
    max(min_chunk, total_len x kv_heads / target) so that the programs that read come to about
    SPLIT_PROGRAMS_PER_SM per SM; a row of n tokens uses round(n / chunk) splits (at least 1, at most num_splits:
    what the longest row needs now or what rows of equal length need at any length, whichever is more, at most
    64). ``sms``: the GPU's multiprocessor count, None under the interpreter. About 3 programs per SM run close to
    the best split count, while more leave a partly filled last round of programs; one split count for every row
    (the longest's) makes a ragged batch of one long and several short rows run far slower than splits per row (see
    the results file).

    ``ragged_room``: the plan saw rows of one length (a CUDA graph's dummy lengths, or none during capture) and may be
    replayed on ragged ones: up to RAGGED_ROOM times the uniform count, so that a replay's long row gets splits, at
    most ROOM_PROGRAMS x target programs in all (the extra programs of a uniform replay exit at once) and at most
    ROOM_BYTES of partial outputs (``split_bytes``: the plan's partial outputs per split; a captured plan keeps them
    as long as its graph).
    """
    if sms is None:  # the interpreter (no GPU): still exercise the split path on long contexts
        min_chunk = 4 * block_n
        return (1 if max_len <= min_chunk else 2), 2**30, min_chunk
    target, min_chunk = SPLIT_PROGRAMS_PER_SM * sms, 2 * block_n
    chunk = max(min_chunk, total_len * kv_heads // target)
    uniform = round(target / (batch * kv_heads))  # what rows of equal length use at any length: a plan made at a
    # short context (a CUDA graph captured on small dummy lengths) keeps room for the splits its replays need
    splits = max(round(max_len / chunk), uniform)
    if ragged_room and batch > 1:
        room = min(RAGGED_ROOM * max(uniform, 1), ROOM_PROGRAMS * target // (batch * kv_heads))
        splits = max(splits, min(room, ROOM_BYTES // split_bytes) if split_bytes else room)
    return max(1, min(splits, 64)), target, min_chunk


def _scale_args(spec: AttentionSpec) -> tuple[float, float]:
    """(scale_in, SOFTCAP) of kernels._scores for this spec: SOFTCAP is c * log2(e), 0.0 without a softcap."""
    from .kernels import LOG2E

    if spec.softcap is None:
        return spec.scale * LOG2E, 0.0
    return 2.0 * spec.scale / spec.softcap, spec.softcap * LOG2E


def _check_sinks(spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor | None:
    if not spec.sinks:
        if sinks is not None:
            raise ValueError("sinks were passed but the spec has sinks=False")
        return None
    if sinks is None or sinks.shape != (spec.num_q_heads,) or sinks.dtype != torch.float32:
        got = None if sinks is None else f"{tuple(sinks.shape)} {sinks.dtype}"
        raise ValueError(f"spec.sinks needs sinks: a float32 tensor [num_q_heads={spec.num_q_heads}], got {got}")
    return sinks.contiguous()  # the kernels read SINKS + head (no copy when it already is)


class TritonBackend:
    name = "triton"
    decode_takes_b1hd = True  # the decode kernel reads q and writes out through strides: [B, 1, H, D] needs no view

    def version(self) -> str | None:
        """The triton package's version and a hash of our kernel sources: a changed kernel is validated anew."""
        return f"{package_version('triton')}+kernels.{sources_hash()}"

    def unsupported(self, spec: AttentionSpec, phase: Phase, device: torch.device | None = None) -> str | None:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed (pip install triton)")
        if not interpreted():
            if not torch.cuda.is_available():
                reasons.append("no CUDA device (TRITON_INTERPRET=1 runs the kernels in Triton's interpreter: for "
                               "tests, far slower than torch)")
            else:
                reasons.append(capability_reason(">= 8.0", lambda cap: cap >= (8, 0), device))
        reasons.append(dtype_reason(spec))
        if spec.head_dim > MAX_HEAD_DIM or spec.head_dim % 8:
            reasons.append(f"head_dim {spec.head_dim} is not supported (multiples of 8 up to {MAX_HEAD_DIM})")
        supported = {"sliding_window", "softcap", "sinks", "kv_dtype", "non_causal"}
        why = {}
        if phase == "extend":  # each query sees the keys up to its own position
            supported.discard("non_causal")
            why["non_causal"] = "extend runs causal: a query sees the keys up to its position"
        if spec.sliding_window is not None and not spec.causal:
            reasons.append("a sliding window with non-causal attention is not supported (the window is causal)")
        reasons += feature_reasons(spec, phase, supported, why)
        return joined(reasons)

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        from .kernels import prefill_kernel

        cfg = prefill_config(spec.head_dim)
        batch = cu_seqlens_q.numel() - 1
        grid = (max(1, math.ceil(max_seqlen_q / cfg.block_m)), spec.num_q_heads, batch)
        scale_in, softcap = _scale_args(spec)
        window = spec.sliding_window or 0
        block_d = tile_d(spec.head_dim)
        # the kernels read cu + b: contiguous int32
        (cu_q, refresh_q), (cu_k, refresh_k) = support.live_int32(cu_seqlens_q), support.live_int32(cu_seqlens_k)
        upcast = interpreted()
        rows_q, rows_k = max_seqlen_q + cfg.block_m, max_seqlen_k + cfg.block_n  # masked tiles reach this far

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
            sinks = _check_sinks(spec, sinks)
            out = torch.empty_like(q)
            support.refresh_captured((refresh_q, refresh_k), q)
            # 64-bit offsets inside a sequence only where one sequence's rows x stride can pass 2^31
            long = max(rows_q * q.stride(0), rows_k * k.stride(0), rows_k * v.stride(0)) >= INT32_OFFSETS
            prefill_kernel[grid](q, k, v, out, cu_q, cu_k, sinks, scale_in,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 out.stride(0), out.stride(1),
                                 GROUP=spec.group_size, HEAD_DIM=spec.head_dim, BLOCK_D=block_d,
                                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=spec.causal, WINDOW=window,
                                 SOFTCAP=softcap, HAS_SINKS=sinks is not None, LONG=long, UPCAST=upcast,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            return out

        return run

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        from .kernels import paged_kernel, paged_reduce_kernel

        cfg = decode_config(spec.head_dim)
        batch = seq_lens.numel()
        if support.capturing(seq_lens):
            # no host read during CUDA-graph capture: the longest row the page table holds, every row that long, with
            # room for a ragged replay's long rows (decode_splits)
            max_len = page_table.shape[1] * spec.page_size
            if spec.sliding_window is not None:
                max_len = min(max_len, spec.sliding_window)
            total_len, room = batch * max_len, True
        else:
            # one read (support.read_lengths): the split count, a refusal of lengths the kernel cannot serve, and
            # room for a ragged replay where the rows are of one length, as during capture
            max_len, total_len, room = 1, 1, False
            if batch:
                max_len, total_len, room = support.read_lengths("triton decode", seq_lens, spec.sliding_window,
                                                                page_table.shape[1] * spec.page_size)
        sms = (torch.cuda.get_device_properties(seq_lens.device).multi_processor_count
               if seq_lens.device.type == "cuda" else None)
        split_bytes = batch * spec.num_q_heads * tile_d(spec.head_dim) * 4  # partial outputs per split (float32)
        splits, target, min_chunk = decode_splits(batch, spec.num_kv_heads, max(max_len, 1), max(total_len, 1),
                                                  cfg.block_n, sms, ragged_room=room, split_bytes=split_bytes)
        ordered = decode_ordered(batch, spec.num_kv_heads, sms)
        if ordered and room and splits < ORDER_ROOM_SPLITS:  # at most ROOM_BYTES of partial outputs, as the room
            splits = max(splits, min(ORDER_ROOM_SPLITS, ROOM_BYTES // split_bytes))
        block_d = tile_d(spec.head_dim)
        block_g = max(16, triton_next_pow2(spec.group_size))  # tl.dot needs M >= 16
        block_s = triton_next_pow2(splits)
        device = seq_lens.device
        # the kernels read LENS + b and page-table rows at stride(0)
        (page_table, refresh_table) = support.live_int32(page_table, rows=True)
        lens, refresh_lens = support.live_int32(seq_lens)
        # the merge holds a [BLOCK_S, BLOCK_D] float32 tile: past 8192 elements (head_dim 256 with 64 splits) the
        # whole decode kernel spills registers (sm_90: 255 registers and a stack, against 146 without): reduce kernel
        # eager runs only (see MERGE_IN_DECODE_KERNEL): a run captured into a CUDA graph takes the reduce kernel.
        # Not for a plan made during capture either: its zeroed counts would come from the graph's pool, the zeroing
        # only captured, so an eager run of that plan before the graph's first replay would read garbage counts
        merge_ok = (splits > 1 and MERGE_IN_DECODE_KERNEL and block_s * block_d <= MERGE_TILE_MAX
                    and not support.capturing(seq_lens))
        if splits > 1:
            o_part = torch.empty(batch, spec.num_q_heads, splits, block_d, dtype=torch.float32, device=device)
            lse_part = torch.empty(batch, spec.num_q_heads, splits, dtype=torch.float32, device=device)
        else:
            o_part = lse_part = lens  # unused placeholders
        # the merge's arrival counts: zero now, and the last program of each group takes num_splits off its count
        arrived = torch.zeros(batch, spec.num_kv_heads, dtype=torch.int32, device=device) if merge_ok else lens
        if max(o_part.numel(), page_table.numel()) >= 2**31:
            raise ValueError(f"triton decode: batch {batch} x {spec.num_q_heads} heads x {splits} splits or the page "
                             "table passes 2^31 elements (32-bit offsets); use a smaller batch")
        scale_in, softcap = _scale_args(spec)
        window = spec.sliding_window or 0
        fp8 = spec.kv_dtype is not None
        upcast = interpreted()
        heads, kv_heads = spec.num_q_heads, spec.num_kv_heads
        if ordered:  # each run sorts the lengths it reads into these: the rows longest first, for the kernel
            sorted_lens = torch.empty(batch, dtype=torch.int32, device=device)
            order = torch.empty(batch, dtype=torch.int64, device=device)
            grid = (batch * kv_heads * splits,)
        else:
            order, grid = None, (batch, kv_heads, splits)

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            sinks = _check_sinks(spec, sinks)
            if fp8 and (k_scale is None or v_scale is None):
                raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element tensors)")
            if q.numel() >= 2**31:  # q [B, H, D] or [B, 1, H, D]: heads at stride(-2), out like q
                raise ValueError(f"triton decode: q has {q.numel()} elements, past 2^31 (32-bit offsets)")
            out = torch.empty_like(q)
            support.refresh_captured((refresh_table, refresh_lens), q)
            if ordered:  # the live lengths (a captured run: this replay's), on the device
                torch.sort(lens, descending=True, stable=True, out=(sorted_lens, order))
            merge = merge_ok and not support.capturing(q)
            part_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2)) if splits > 1 else (0, 0, 0)
            paged_kernel[grid](
                q, k_cache, v_cache, page_table, lens, out, o_part, lse_part, arrived, sinks,
                k_scale if fp8 else None, v_scale if fp8 else None, scale_in, splits, target, min_chunk, batch, heads,
                kv_heads, order, q.stride(0), q.stride(-2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
                out.stride(0), out.stride(-2), *part_strides, None, 1,
                GROUP=spec.group_size, BLOCK_G=block_g, HEAD_DIM=spec.head_dim, BLOCK_D=block_d,
                PAGE_SIZE=spec.page_size, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
                BLOCK_B=LENS_BLOCK, BLOCK_S=block_s, MERGE=merge, WINDOW=window, SOFTCAP=softcap,
                HAS_SINKS=sinks is not None, FP8=fp8, UPCAST=upcast, BLOCK_Q=1, ORDERED=ordered,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            if splits > 1 and not merge:
                paged_reduce_kernel[(batch, heads)](
                    out, o_part, lse_part, sinks, splits, heads, out.stride(0), out.stride(-2), *part_strides,
                    None, 1,
                    HEAD_DIM=spec.head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
                    HAS_SINKS=sinks is not None, num_warps=4)
            return out

        run.splits, run.ordered, run.order = splits, ordered, order  # for tests and benchmarks: the path it takes
        return run

    def plan_extend(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor, max_seqlen_q: int, max_seq_len: int) -> RunFn:
        """Ragged queries over the paged cache on decode's kernel (extend.py)."""
        from .extend import plan_extend

        return plan_extend(spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_d(head_dim: int) -> int:
    """BLOCK_D of the kernels for head_dim: the next power of 2, at least 16 (tl.dot needs K >= 16 when compiled:
    head_dim 8 does not compile; the extra columns are masked)."""
    return max(16, triton_next_pow2(head_dim))


BACKEND = TritonBackend()
