"""The triton backend's extend phase: ragged queries over the paged cache, on decode's kernel (kernels.paged_kernel).

Short query rows (multi-token decode, speculative verify: a row's queries times its KV head's query heads fit one
tile of at most SHORT_TILE_ROWS rows) run as decode does: one tile per row and KV head, the keys split across
programs and merged by log-sum-exp. Long rows (chunked prefill, a prompt-cache hit) are cut into tiles of
prefill's size, split only where the tiles alone leave the GPU short of programs. Tiles come from host sizes
(max_seqlen_q, max_seq_len, batch); the split count from the lengths too in an eager plan (one read of seq_lens, as
plan_decode's), from the bounds alone in one made during CUDA-graph capture (no read). Every run reads cu_seqlens_q,
seq_lens and the page table afresh (the CUDA-graph contract): the kernel spreads each row's keys over the splits.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...spec import AttentionSpec
from .. import RunFn, support

SHORT_TILE_ROWS = 64  # up to this many rows (query tokens x the group's heads, padded) a row's queries are one tile
LONG_SPLITS_MAX = 16  # long tiles split only where programs are few; each split still reads many keys
MERGE_ROWS_MAX = 16  # the in-kernel merge walks a tile's (query, head) rows one after another: at most this many


@dataclasses.dataclass(frozen=True)
class ExtendTiles:
    block_q: int  # query tokens per program (1: decode's code, one query per row)
    block_g: int  # rows per query token: the KV head's query heads, padded to a power of 2
    block_n: int
    num_warps: int
    num_stages: int
    long: bool  # prefill-sized tiles (long query rows)


def extend_tiles(head_dim: int, group: int, max_q: int) -> ExtendTiles:
    """The tile for query rows of at most ``max_q`` tokens. tl.dot needs 16 rows or more: a one-query tile pads its
    heads to 16 (as decode does), a short tile takes enough tokens for 16 rows."""
    from . import TileConfig, decode_config, interpreted, prefill_config, triton_next_pow2

    g = triton_next_pow2(group)
    dec = decode_config(head_dim)
    if max_q <= 1:
        return ExtendTiles(1, max(16, g), dec.block_n, dec.num_warps, dec.num_stages, False)
    if triton_next_pow2(max_q) * g <= SHORT_TILE_ROWS:
        # two stages, not decode's four: the tile sweep's best for 2-4 queries (see the results file)
        stages = 2 if 64 < head_dim <= 128 and not interpreted() else dec.num_stages
        return ExtendTiles(max(triton_next_pow2(max_q), 16 // g), g, dec.block_n, dec.num_warps, stages, False)
    # long rows: prefill's tiles (rows = tokens x heads here; 256-row tiles ran faster but spill registers, see the
    # results file); the interpreter's are small (tests reach every block kind on short rows); at least 2 tokens: a
    # one-token tile is decode's code, for one query per row
    cfg = TileConfig(32, 16, 4, 1) if interpreted() else prefill_config(head_dim)
    return ExtendTiles(max(2, cfg.block_m // g), g, cfg.block_n, cfg.num_warps, cfg.num_stages, True)


def _check_plan_args(cu_seqlens_q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                     max_seqlen_q: int, max_seq_len: int) -> None:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"triton extend: {name} must be a host int >= 0 (a bound on every row), got {value!r}")
    for name, t, dim in (("cu_seqlens_q", cu_seqlens_q, 1), ("seq_lens", seq_lens, 1), ("page_table", page_table, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"triton extend: {name} must be an int32 (or int64) tensor of {dim} dimension(s), "
                             f"got {got}")
    batch = seq_lens.numel()
    if cu_seqlens_q.numel() != batch + 1 or page_table.shape[0] != batch:
        raise ValueError(f"triton extend: cu_seqlens_q [batch + 1] and page_table [batch, max_pages] must match "
                         f"seq_lens [batch = {batch}], got {tuple(cu_seqlens_q.shape)} and {tuple(page_table.shape)}")
    if len({cu_seqlens_q.device, page_table.device, seq_lens.device}) != 1:
        raise ValueError("triton extend: cu_seqlens_q, page_table and seq_lens must be on one device, got "
                         f"{cu_seqlens_q.device}, {page_table.device}, {seq_lens.device}")


def plan_extend(spec: AttentionSpec, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                max_seqlen_q: int, max_seq_len: int) -> RunFn:
    """TritonBackend.plan_extend (the Backend protocol's contract)."""
    from . import (INT32_OFFSETS, LENS_BLOCK, MERGE_IN_DECODE_KERNEL, MERGE_TILE_MAX, _check_sinks, _scale_args,
                   decode_splits, interpreted, tile_d, triton_next_pow2)
    from .kernels import paged_kernel, paged_reduce_kernel

    _check_plan_args(cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)
    batch, device = seq_lens.numel(), seq_lens.device
    tiles = extend_tiles(spec.head_dim, spec.group_size, max_seqlen_q)
    q_tiles = max(1, math.ceil(max_seqlen_q / tiles.block_q))
    # keys one tile reads at most: the longest context, or (a window) the window of its first to its last query
    span = min(max_seq_len, page_table.shape[1] * spec.page_size)
    if spec.sliding_window is not None:
        span = min(span, spec.sliding_window + tiles.block_q - 1)
    span = max(span, 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    programs = batch * q_tiles  # per KV head: the split plan treats each tile as decode treats a row
    # during capture: every row as long as the bound allows, with room for a ragged replay (decode_splits)
    longest, total, room = span, max(programs, 1) * span, True
    if batch and not support.capturing(seq_lens):
        # eager: the batch's own lengths, one read (as plan_decode's). Sized for every row at the longest, a ragged
        # batch of many short rows and a few long ones got one split per tile, and its long rows ran alone in one
        # program each (2.2x behind FA3's split kernel on such a batch, see the results file). The total is what
        # the kernel computes at run time: every row's keys (within the window) once per query tile.
        # The same read (support.read_lengths) refuses lengths the kernel cannot serve, and tells rows of one
        # length, what engines capture graphs on: short tiles (multi-token decode) then keep split room for a
        # ragged replay as decode does; long tiles do not (partials per query token).
        most, summed, room = support.read_lengths("triton extend", seq_lens, spec.sliding_window,
                                                  page_table.shape[1] * spec.page_size)
        longest, total = max(1, min(span, most)), max(1, q_tiles * summed)
    splits, target, min_chunk = decode_splits(
        max(programs, 1), spec.num_kv_heads, longest, total, tiles.block_n, sms, ragged_room=room and not tiles.long,
        split_bytes=programs * tiles.block_q * spec.num_q_heads * tile_d(spec.head_dim) * 4)
    if tiles.long:
        splits = min(splits, LONG_SPLITS_MAX)
    # the kernel sums the rows' lengths (one per row, not per tile): its target is per row
    row_target = max(1, target // q_tiles)
    block_d = tile_d(spec.head_dim)
    block_s = triton_next_pow2(splits)
    cu_q, refresh_cu = support.live_int32(cu_seqlens_q)
    table, refresh_table = support.live_int32(page_table, rows=True)
    lens, refresh_lens = support.live_int32(seq_lens)
    refreshes = (refresh_cu, refresh_table, refresh_lens)
    # in-kernel merge (one launch) for eager runs of small tiles; see MERGE_IN_DECODE_KERNEL and plan_decode
    merge_ok = (splits > 1 and MERGE_IN_DECODE_KERNEL and block_s * block_d <= MERGE_TILE_MAX
                and max_seqlen_q * spec.group_size <= MERGE_ROWS_MAX and not support.capturing(seq_lens))
    part_rows = programs * tiles.block_q  # partial row of tile p's query i: p x block_q + i
    heads = spec.num_q_heads
    if splits > 1:
        o_part = torch.empty(part_rows, heads, splits, block_d, dtype=torch.float32, device=device)
        lse_part = torch.empty(part_rows, heads, splits, dtype=torch.float32, device=device)
        part_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
    else:
        o_part = lse_part = lens  # unused placeholders
        part_strides = (0, 0, 0)
    arrived = torch.zeros(programs, spec.num_kv_heads, dtype=torch.int32, device=device) if merge_ok else lens
    if max(o_part.numel(), table.numel()) >= INT32_OFFSETS:
        raise ValueError(f"triton extend: {part_rows} query rows x {heads} heads x {splits} splits or the page "
                         "table passes 2^31 elements (32-bit offsets); use a smaller batch")
    scale_in, softcap = _scale_args(spec)
    window = spec.sliding_window or 0
    fp8 = spec.kv_dtype is not None
    upcast = interpreted()

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        sinks = _check_sinks(spec, sinks)
        if fp8 and (k_scale is None or v_scale is None):
            raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element tensors)")
        if q.numel() >= INT32_OFFSETS:
            raise ValueError(f"triton extend: q has {q.numel()} elements, past 2^31 (32-bit offsets)")
        out = torch.empty_like(q)
        if batch == 0:
            return out
        support.refresh_captured(refreshes, q)
        merge = merge_ok and not support.capturing(q)
        paged_kernel[(programs, spec.num_kv_heads, splits)](
            q, k_cache, v_cache, table, lens, out, o_part, lse_part, arrived, sinks,
            k_scale if fp8 else None, v_scale if fp8 else None, scale_in, splits, row_target, min_chunk, batch,
            heads, spec.num_kv_heads, None, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
            out.stride(0), out.stride(1), *part_strides, cu_q, q_tiles,
            GROUP=spec.group_size, BLOCK_G=tiles.block_g, HEAD_DIM=spec.head_dim, BLOCK_D=block_d,
            PAGE_SIZE=spec.page_size, BLOCK_N=tiles.block_n, SPLIT=splits > 1,
            BLOCK_B=LENS_BLOCK, BLOCK_S=block_s, MERGE=merge, WINDOW=window, SOFTCAP=softcap,
            HAS_SINKS=sinks is not None, FP8=fp8, UPCAST=upcast, BLOCK_Q=tiles.block_q, ORDERED=False,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        if splits > 1 and not merge:
            paged_reduce_kernel[(part_rows, heads)](
                out, o_part, lse_part, sinks, splits, heads, out.stride(0), out.stride(1), *part_strides,
                cu_q, q_tiles * tiles.block_q,
                HEAD_DIM=spec.head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
                HAS_SINKS=sinks is not None, num_warps=4)
        return out

    run.tiles = tiles  # for tests and reports: the path this plan takes
    run.splits = splits
    return run
