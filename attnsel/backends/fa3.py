"""fa3: FlashAttention 3 (package tokenspeed-fa3, module flash_attn_interface). Hopper only.

Calls the raw op ``torch.ops.flash_attn_3.fwd`` (schema read from the build: q, k, v, k_new, v_new, q_v, out,
cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table,
kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale,
is_causal, window_size_left, window_size_right, attention_chunk, softcap, is_rotary_interleaved,
scheduler_metadata, num_splits, pack_gqa, sm_margin, sinks): the Python wrappers add a ``torch.library.custom_op``
layer that costs tens of microseconds (decode) to over a hundred (varlen prefill) more host time per call than the
raw op (see the results file), more than a small decode's kernel. Decode passes no precomputed scheduling metadata
(mutable state shared by every run of a plan); each run prepares its own.

Features: sliding window as ``window_size=(w - 1, 0)``; sinks (the op takes them as bfloat16 ``[num_q_heads]``);
softcap only where the build has it (tokenspeed-fa3 3.0.0 is built with FLASHATTENTION_DISABLE_SOFTCAP); an fp8
e4m3 cache needs fp8 queries too (FA3 requires q, k, v of one dtype), so decode and extend quantise q per (row, KV
head), the one scale FA3's ``q_descale [batch, kv_heads]`` can take, computed on the device (amax over the row's
tokens and the group's heads / 448), and pass q/k/v descale factors; the output is bf16.
Extend (ragged queries over the paged cache) is the varlen call with the paged cache: q ``[total_q, H, D]``,
``cu_seqlens_q``, ``seqused_k`` = seq_lens, the page table, causal (FA3 aligns bottom-right by each row's lengths).
Any page size: FA3 loads pages with TMA only when the page size is a multiple of its key tile and otherwise reads
them row by row (``PagedKVNonTMA``), page size 1 (a token-level table, as LightLLM passes it) included.
Variants: ``fa3_packgqa`` forces ``pack_gqa=True`` (the default lets FA3's heuristic decide); ``fa3_split`` (prefill,
extend) lets FA3 split the keys of a sequence (``num_splits=0``, its heuristic; ``fa3`` prefill and extend use 1):
prefix-cached chunks and multi-token decode, few queries over long keys.
"""
from __future__ import annotations

import importlib.util

import torch

from ..device import package_version
from ..spec import AttentionSpec
from . import Phase, RunFn
from .support import (capability_reason, capturing, dtype_reason, feature_reasons, joined, live_int32,
                      refresh_captured)

# FA3 compiles kernels for these head_dim bins; a head_dim runs in the smallest bin that holds it.
_HDIM_BINS = (64, 96, 128, 192, 256)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _build_flags() -> dict:
    from flash_attn_config import (
        CONFIG,  # a plain dict written at build time; imports no CUDA code
    )

    return CONFIG["build_flags"]


def head_dim_reason(head_dim: int) -> str | None:
    flags = _build_flags()
    enabled = [d for d in _HDIM_BINS if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}", False)]
    bin_ = next((d for d in _HDIM_BINS if head_dim <= d), None)
    if bin_ is None or bin_ not in enabled or head_dim % 8:
        return f"head_dim {head_dim} is not supported by this FA3 build (supported: {', '.join(map(str, enabled))})"
    return None


def feature_support() -> tuple[set[str], dict[str, str]]:
    """(features this FA3 build implements, why for the others), from its build flags."""
    flags = _build_flags()
    supported, why = {"sinks", "non_causal"}, {}
    for key, flag in (("sliding_window", "LOCAL"), ("softcap", "SOFTCAP"), ("kv_dtype", "FP8")):
        if flags.get(f"FLASHATTENTION_DISABLE_{flag}", False):
            why[key] = f"this FA3 build was compiled with FLASHATTENTION_DISABLE_{flag}"
        else:
            supported.add(key)
    return supported, why


def build_reason(phase: str) -> str | None:
    """Why this FA3 build cannot run the phase's call at all: every phase passes lengths per sequence (varlen:
    cu_seqlens or seqused_k), decode and extend read the paged cache."""
    flags = _build_flags()
    needed = ["VARLEN"] + (["PAGEDKV"] if phase != "prefill" else [])
    off = [f"FLASHATTENTION_DISABLE_{f}" for f in needed if flags.get(f"FLASHATTENTION_DISABLE_{f}", False)]
    return f"this FA3 build was compiled with {' and '.join(off)}: {phase} needs it" if off else None


def _window(spec: AttentionSpec) -> tuple[int, int]:
    return (spec.sliding_window - 1, 0) if spec.sliding_window is not None else (-1, -1)


def _fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
         page_table=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale, causal,
         window=(-1, -1), softcap=0.0, scheduler_metadata=None, num_splits=1, pack_gqa=None, sinks=None):
    return torch.ops.flash_attn_3.fwd(
        q, k, v, None, None, None, None,  # k_new, v_new, q_v, out
        cu_seqlens_q, cu_seqlens_k, None, None, seqused_k, max_seqlen_q, max_seqlen_k,  # cu_seqlens_k_new, seqused_q
        page_table, None, None, None, None, None,  # kv_batch_idx, leftpad_k, rotary cos/sin/seqlens
        q_descale, k_descale, v_descale, softmax_scale, causal,
        window[0], window[1], 0, softcap, False,  # attention_chunk, softcap, is_rotary_interleaved
        scheduler_metadata, num_splits, pack_gqa, 0, sinks)[0]  # sm_margin


def _sinks_arg(spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor | None:
    if not spec.sinks:
        if sinks is not None:
            raise ValueError("sinks were passed but the spec has sinks=False")
        return None
    if sinks is None or sinks.shape != (spec.num_q_heads,):
        raise ValueError(f"spec.sinks needs sinks: a float32 tensor [num_q_heads={spec.num_q_heads}]")
    return sinks.to(torch.bfloat16).contiguous()  # the op's dtype for sinks


def quantize_q(q: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D] -> (fp8 e4m3 q, float32 descale [B, num_kv_heads]): one scale per sequence and KV head group,
    amax / 448, computed on the device (no host sync)."""
    b, h, d = q.shape
    grouped = q.float().view(b, num_kv_heads, h // num_kv_heads, d)
    scale = (grouped.abs().amax(dim=(2, 3)) / FP8_MAX).clamp_min(1e-12)  # [B, KVH]
    q8 = (grouped / scale[:, :, None, None]).to(torch.float8_e4m3fn).view(b, h, d)
    return q8, scale


def token_rows(cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """int64 ``[total_q]``: the row of each query token, ``batch`` for padding tokens past ``cu_seqlens_q[-1]``
    (computed on the device: no host sync, captured runs read the metadata of each replay)."""
    tokens = torch.arange(total_q, dtype=cu_seqlens_q.dtype, device=cu_seqlens_q.device)
    return torch.searchsorted(cu_seqlens_q[1:], tokens, right=True)


def quantize_q_rows(q: torch.Tensor, rows: torch.Tensor, batch: int, num_kv_heads: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] of ragged rows -> (fp8 e4m3 q, float32 descale [batch, num_kv_heads]): one scale per row and KV
    head group (FA3's q_descale has no token dimension), amax over the row's tokens and the group's heads / 448,
    computed on the device. ``rows``: each token's row (``token_rows``); padding tokens (row ``batch``) get a scale
    of their own, so whatever they hold does not reach a row's scale."""
    t, h, d = q.shape
    grouped = q.float().view(t, num_kv_heads, h // num_kv_heads, d)
    token_amax = grouped.abs().amax(dim=(2, 3))  # [T, KVH]
    amax = torch.zeros(batch + 1, num_kv_heads, dtype=torch.float32, device=q.device)
    amax.scatter_reduce_(0, rows[:, None].expand(t, num_kv_heads), token_amax, "amax")
    scale = (amax / FP8_MAX).clamp_min(1e-12)  # [batch + 1, KVH]
    q8 = (grouped / scale[rows][:, :, None, None]).to(torch.float8_e4m3fn).view(t, h, d)
    return q8, scale[:batch]


class FA3Backend:
    def __init__(self, name: str, pack_gqa: bool | None = None, prefill_splits: int = 1,
                 phases: tuple[str, ...] = ("prefill", "decode", "extend")):
        self.name = name
        self.pack_gqa = pack_gqa
        # prefill and extend: 1, no KV split; 0, FA3's heuristic (splits few-query long-key rows). Decode: always 0.
        self.prefill_splits = prefill_splits
        self.phases = phases
        # FA3's op takes q [B, 1, H, D]: the FA-compatible decode makes no views (decoding variants only)
        self.decode_takes_b1hd = "decode" in phases

    def version(self) -> str | None:
        return package_version("tokenspeed-fa3")

    def unsupported(self, spec: AttentionSpec, phase: Phase, device: torch.device | None = None) -> str | None:
        if phase not in self.phases:
            return f"this variant differs from fa3 only in {', '.join(self.phases)}"
        installed = importlib.util.find_spec("flash_attn_interface") is not None
        reasons = [None if installed else "flash_attn_interface is not installed (pip install tokenspeed-fa3)",
                   capability_reason("9.x (Hopper)", lambda cap: cap[0] == 9, device), dtype_reason(spec)]
        if installed:  # head dims and features depend on how the installed build was compiled
            reasons.append(head_dim_reason(spec.head_dim))
        if self.pack_gqa and spec.group_size == 1:
            reasons.append("pack_gqa changes nothing without GQA (group size 1); fa3 covers this spec")
        if spec.sliding_window is not None and not spec.causal:
            reasons.append("a sliding window with non-causal attention is not supported (the window is causal)")
        if installed:
            supported, why = feature_support()
            reasons += feature_reasons(spec, phase, supported, why)
            reasons.append(build_reason(phase))
        return joined(reasons)

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        import flash_attn_interface  # noqa: F401  registers torch.ops.flash_attn_3

        (cu_q, refresh_q), (cu_k, refresh_k) = live_int32(cu_seqlens_q), live_int32(cu_seqlens_k)
        scale, causal, window = spec.scale, spec.causal, _window(spec)
        softcap = spec.softcap or 0.0
        pack_gqa, splits = self.pack_gqa, self.prefill_splits

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
            refresh_captured((refresh_q, refresh_k), q)
            return _fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal, window=window,
                        softcap=softcap, num_splits=splits, pack_gqa=pack_gqa, sinks=_sinks_arg(spec, sinks))

        return run

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        import flash_attn_interface  # noqa: F401  registers torch.ops.flash_attn_3

        (page_table, refresh_table), (lens, refresh_lens) = live_int32(page_table, rows=True), live_int32(seq_lens)
        batch = lens.numel()
        # No precomputed scheduler metadata (get_scheduler_metadata): it holds a tile counter that every run of the
        # plan shares and resets, i.e. mutable device state. Without it every run prepares its own (one small kernel
        # more per call), so runs of one plan share nothing.
        # zero-length rows (CUDA-graph padding) get zeros: masked eagerly only when the plan has such rows (read on
        # the host); a run being captured masks from the lengths of each replay (a replay may bring such rows)
        has_empty = bool(batch) and (capturing(lens) or bool((lens == 0).any()))
        scale, window, softcap = spec.scale, _window(spec), spec.softcap or 0.0
        fp8 = spec.kv_dtype is not None
        pack_gqa, kvh = self.pack_gqa, spec.num_kv_heads

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            # q [B, H, D], or [B, 1, H, D] (FA3's own layout, decode_takes_b1hd): out in q's layout
            b1hd = q.dim() == 4
            refresh_captured((refresh_table, refresh_lens), q)
            descale = {}
            if fp8:
                if k_scale is None or v_scale is None:
                    raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element "
                                     "tensors)")
                q_in, q_descale = quantize_q(q.squeeze(1) if b1hd else q, kvh)
                q_in = q_in.unsqueeze(1)
                descale = dict(q_descale=q_descale, k_descale=k_scale.float().view(1, 1).expand(batch, kvh),
                               v_descale=v_scale.float().view(1, 1).expand(batch, kvh))
            else:
                q_in = q if b1hd else q.unsqueeze(1)
            out = _fwd(q_in, k_cache, v_cache, seqused_k=lens, page_table=page_table,
                       softmax_scale=scale, causal=True, window=window, softcap=softcap,
                       num_splits=0, pack_gqa=pack_gqa, sinks=_sinks_arg(spec, sinks), **descale)
            if not b1hd:
                out = out.squeeze(1)
            if out.dtype != q.dtype:  # fp8 inputs give bf16
                out = out.to(q.dtype)
            if batch and (has_empty or capturing(q)):  # zero-length rows (CUDA-graph padding) are zeros
                empty_rows = (lens == 0).view(batch, *([1] * (out.dim() - 1)))
                out = out.masked_fill(empty_rows, 0.0)
            return out

        return run

    def plan_extend(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor, max_seqlen_q: int, max_seq_len: int) -> RunFn:
        import flash_attn_interface  # noqa: F401  registers torch.ops.flash_attn_3

        (cu_q, refresh_q), (page_table, refresh_table), (lens, refresh_lens) = (
            live_int32(cu_seqlens_q), live_int32(page_table, rows=True), live_int32(seq_lens))
        batch = lens.numel()
        # as in decode: no scheduler metadata shared by the runs; rows of zero length (CUDA-graph padding) give
        # zeros, masked eagerly only when the plan has such rows, by a run being captured from each replay's lengths
        has_empty = bool(batch) and (capturing(lens) or bool((lens == 0).any()))
        scale, window, softcap, causal = spec.scale, _window(spec), spec.softcap or 0.0, spec.causal
        fp8 = spec.kv_dtype is not None
        pack_gqa, splits, kvh = self.pack_gqa, self.prefill_splits, spec.num_kv_heads

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            refresh_captured((refresh_q, refresh_table, refresh_lens), q)
            mask_empty = bool(batch) and (has_empty or capturing(q))
            rows = token_rows(cu_q, q.shape[0]) if fp8 or mask_empty else None
            descale = {}
            q_in = q
            if fp8:
                if k_scale is None or v_scale is None:
                    raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element "
                                     "tensors)")
                q_in, q_descale = quantize_q_rows(q, rows, batch, kvh)
                descale = dict(q_descale=q_descale, k_descale=k_scale.float().view(1, 1).expand(batch, kvh),
                               v_descale=v_scale.float().view(1, 1).expand(batch, kvh))
            out = _fwd(q_in, k_cache, v_cache, cu_seqlens_q=cu_q, seqused_k=lens, max_seqlen_q=max_seqlen_q,
                       page_table=page_table, softmax_scale=scale, causal=causal, window=window, softcap=softcap,
                       num_splits=splits, pack_gqa=pack_gqa, sinks=_sinks_arg(spec, sinks), **descale)
            if out.dtype != q.dtype:  # fp8 inputs give bf16
                out = out.to(q.dtype)
            if mask_empty:  # the queries of zero-length rows (CUDA-graph padding) are zeros
                lens_or_pad = torch.nn.functional.pad(lens, (0, 1), value=1)  # padding tokens: left as they are
                out = out.masked_fill((lens_or_pad[rows] == 0)[:, None, None], 0.0)
            return out

        return run


BACKEND = FA3Backend("fa3")
BACKEND_PACKGQA = FA3Backend("fa3_packgqa", pack_gqa=True)
BACKEND_SPLIT = FA3Backend("fa3_split", prefill_splits=0, phases=("prefill", "extend"))
