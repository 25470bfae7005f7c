"""flashinfer_xqa: FlashInfer's XQA decode (TensorRT-LLM's GQA decode kernels; ``flashinfer.decode.
xqa_batch_decode_with_kv_cache``), a decode-only candidate on Hopper (sm90) and later.

XQA takes the caches as attnsel does (``[num_pages, page_size, kv_heads, head_dim]``, one page table for K and V)
and reads seq_lens on the device at run time (as uint32: a view of our int32 lengths, so in-place updates reach it),
so its plan does nothing on the host and can be made during CUDA-graph capture. With an fp8 e4m3 cache it runs
FlashInfer's sm90 fp8 kernel (queries quantised inside it); k_scale folds into the score scale and v_scale into the
output, both as device tensors (no host read). Sliding window (``window_left = w - 1``) and sinks (per query head,
natural-log logits, given to XQA per KV head and group) are XQA's own; it has no logit softcap.

Limits (FlashInfer 0.6.4, flashinfer/jit/xqa.py): q fp16 or bf16; page size 16, 32, 64 or 128; head_dim a multiple
of 16 up to 256; compute capability 9.x, 10.x or 12.x. Its workspace holds semaphores that must start at zero and a
scratch area for split-K partial results: one zeroed buffer per device (ATTNSEL_FLASHINFER_WORKSPACE_MB, default
128), separate from the wrappers' workspace; runs go on one stream (as the FlashInfer wrappers' do). Each
(dtype, cache dtype, page size, head_dim, group size, window or not) is its own JIT module: minutes on first use.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from ..device import package_version
from ..spec import AttentionSpec
from . import Phase, RunFn
from .flashinfer import jit_cache_dir, workspace_bytes
from .support import capability_reason, capturing, dtype_reason, feature_reasons, joined

PAGE_SIZES = (16, 32, 64, 128)


@functools.cache
def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _has_xqa() -> bool:
    try:
        return importlib.util.find_spec("flashinfer.xqa") is not None
    except (ImportError, ValueError):  # the parent package fails to import
        return False


class XQABackend:
    name = "flashinfer_xqa"
    first_use_note = "first use JIT-compiles FlashInfer's XQA kernels: minutes on a fresh machine"

    def version(self) -> str | None:
        return package_version("flashinfer-python")

    def report_extras(self) -> dict:
        return {"flashinfer_jit_dir": jit_cache_dir()}

    def unsupported(self, spec: AttentionSpec, phase: Phase, device: torch.device | None = None) -> str | None:
        if phase != "decode":
            return "this variant differs from flashinfer only in decode (XQA: one query token per sequence)"
        reasons = []
        if importlib.util.find_spec("flashinfer") is None:
            reasons.append("flashinfer is not installed (pip install flashinfer-python)")
        elif not _has_xqa():
            reasons.append(f"this flashinfer ({package_version('flashinfer-python')}) has no XQA module "
                           "(flashinfer.xqa, 0.5 and later)")
        reasons.append(capability_reason("9.x, 10.x or 12.x (XQA's kernels)", lambda cap: cap[0] in (9, 10, 12),
                                         device))
        reasons.append(dtype_reason(spec))
        if spec.page_size not in PAGE_SIZES:
            reasons.append(f"page_size {spec.page_size} is not supported (supported: "
                           f"{', '.join(map(str, PAGE_SIZES))})")
        if spec.head_dim % 16 or spec.head_dim > 256:
            reasons.append(f"head_dim {spec.head_dim} is not supported (multiples of 16 up to 256)")
        reasons += feature_reasons(spec, phase, {"sliding_window", "sinks", "kv_dtype", "non_causal"},
                                   {"softcap": "XQA has no logit softcap"})
        return joined(reasons)

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        raise NotImplementedError("flashinfer_xqa serves decode only")

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        device = seq_lens.device
        page_table = page_table.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        lens_u32 = lens.view(torch.uint32)  # XQA's dtype; the same memory, so in-place updates of lens reach it
        batch = lens.numel()
        max_seq_len = page_table.shape[1] * spec.page_size
        # zero-length rows (CUDA-graph padding) are zeros by contract: masked when the plan has such rows (read on
        # the host), or, for a plan made during capture (no host read allowed), on every run from the lengths then
        mask_each_run = batch > 0 and capturing(lens)
        empty_rows = None
        if batch and not mask_each_run:
            empty_rows = (lens == 0)[:, None, None]
            empty_rows = empty_rows if bool(empty_rows.any()) else None
        workspace = _workspace(device, workspace_bytes())
        window_left = spec.sliding_window - 1 if spec.sliding_window is not None else -1
        scale, fp8 = spec.scale, spec.kv_dtype is not None

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            if spec.sinks:
                if sinks is None or sinks.shape != (spec.num_q_heads,) or sinks.dtype != torch.float32:
                    raise ValueError(f"spec.sinks needs sinks: a float32 tensor [num_q_heads={spec.num_q_heads}]")
                sinks = sinks.contiguous()
            elif sinks is not None:
                raise ValueError("sinks were passed but the spec has sinks=False")
            bmm1, bmm2 = scale, 1.0
            if fp8:
                if k_scale is None or v_scale is None:
                    raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element "
                                     "tensors)")
                bmm1, bmm2 = k_scale.float().reshape(1) * scale, v_scale.float().reshape(1)
            out = xqa_batch_decode_with_kv_cache(q.contiguous(), (k_cache, v_cache), workspace, page_table, lens_u32,
                                                 max_seq_len, bmm1_scale=bmm1, bmm2_scale=bmm2,
                                                 window_left=window_left, sinks=sinks, kv_layout="NHD")
            if mask_each_run:
                out = out.masked_fill((lens == 0)[:, None, None], 0.0)
            elif empty_rows is not None:
                out = out.masked_fill(empty_rows, 0.0)
            return out

        return run


BACKEND = XQABackend()
