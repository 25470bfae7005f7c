"""flashinfer_xqa: FlashInfer's XQA decode (TensorRT-LLM's GQA decode kernels; ``flashinfer.decode.
xqa_batch_decode_with_kv_cache``), a decode-only candidate on Hopper (sm90) and later.

XQA takes the caches as attnsel does (``[num_pages, page_size, kv_heads, head_dim]``, one page table for K and V)
and reads seq_lens on the device at run time (as uint32: a view of our int32 lengths, so in-place updates reach it).
Its plan reads the lengths on the host only to know whether zero-length rows need masking, and not at all during
CUDA-graph capture (it then masks on every run). k_scale folds into the score scale and v_scale into the output,
both as device tensors (no host read). Sliding window (``window_left = w - 1``) and sinks (per query head,
natural-log logits, given to XQA per KV head and group) are XQA's own; it has no logit softcap. An fp8 cache is
declined on Hopper: FlashInfer 0.6.4's sm90 fp8 kernel reads the unused slots of a sequence's last page (NaN there
gives NaN rows) and quantises the queries to fp8 (errors over the tolerance even with those slots zeroed; see the
results file). XQA splits every sequence into max(1, SMs / (batch x kv_heads)) parts whatever its length, so a ragged
batch (one long row among short ones) runs its long row on few parts (far slower than Triton there).

Limits (FlashInfer 0.6.4, flashinfer/jit/xqa.py): q fp16 or bf16; page size 16, 32, 64 or 128; head_dim a multiple
of 16 up to 256; compute capability 9.x, 10.x or 12.x. Its workspace holds semaphores that must start at zero and a
scratch area for split-K partial results: one zeroed buffer per device (ATTNSEL_FLASHINFER_WORKSPACE_MB, default
128, at least 16 here: XQA keeps its first 8 MiB for semaphores), separate from the wrappers' workspace, made outside
CUDA-graph capture (zeros recorded in a graph would only be written at its first replay); runs go on one stream (as
the FlashInfer wrappers' do). Each
(dtype, cache dtype, page size, head_dim, group size, window or not) is its own JIT module (seconds to build each).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ..device import package_version
from ..spec import AttentionSpec
from . import Phase, RunFn
from .flashinfer import _no_sinks, _sinks_arg, _window_left, jit_cache_dir, workspace_bytes
from .support import (capability_reason, capturing, dtype_reason, feature_reasons, joined, live_int32,
                      refresh_captured)

PAGE_SIZES = (16, 32, 64, 128)
MIN_WORKSPACE = 16 << 20  # XQA reserves the first 8 MiB for semaphores; the rest holds split-K partial results
FP8_WHY = ("FlashInfer's sm90 fp8 XQA kernel reads the unused slots of a sequence's last page and quantises q: NaN "
           "rows and errors over tolerance")


_workspaces: dict[tuple[str, int], torch.Tensor] = {}


def _workspace(device: torch.device, nbytes: int, during_capture: bool) -> torch.Tensor:
    """The device's zeroed XQA workspace, made on the first plan outside CUDA-graph capture (inside, the zeroing would
    be recorded into the graph and run only at its first replay, leaving garbage semaphores for anything before)."""
    if nbytes < MIN_WORKSPACE:
        raise ValueError(f"flashinfer_xqa needs ATTNSEL_FLASHINFER_WORKSPACE_MB of at least {MIN_WORKSPACE >> 20} "
                         f"(XQA keeps the first 8 MiB for semaphores), got {nbytes >> 20}")
    key = (str(device), nbytes)
    found = _workspaces.get(key)
    if found is None:
        if during_capture:
            raise RuntimeError("flashinfer_xqa: its workspace is made by the first plan outside CUDA-graph capture; "
                               "run one decode step with it before capturing")
        found = _workspaces.setdefault(key, torch.zeros(nbytes, dtype=torch.uint8, device=device))
    return found


def _has_xqa() -> bool:
    """Whether the installed flashinfer has its xqa module, without importing flashinfer (find_spec of a submodule
    imports the package: seconds, in the selecting process)."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return False
    locations = getattr(spec, "submodule_search_locations", None) if spec is not None else None
    if locations is None:
        return spec is not None  # not a regular package on disk (e.g. faked in tests): assume present
    return any(os.path.exists(os.path.join(loc, "xqa.py")) for loc in locations)


def _is_hopper(device: torch.device | None) -> bool:
    return capability_reason("9.x", lambda cap: cap[0] == 9, device) is None


class XQABackend:
    name = "flashinfer_xqa"
    first_use_note = "first use JIT-compiles FlashInfer's XQA kernels (seconds per configuration)"

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
        supported, why = {"sliding_window", "sinks", "kv_dtype", "non_causal"}, {"softcap": "XQA has no logit softcap"}
        if spec.kv_dtype is not None and _is_hopper(device):
            supported.discard("kv_dtype")
            why["kv_dtype"] = FP8_WHY
        reasons += feature_reasons(spec, phase, supported, why)
        return joined(reasons)

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        raise NotImplementedError("flashinfer_xqa serves decode only")

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        device = seq_lens.device
        (page_table, refresh_table), (lens, refresh_lens) = live_int32(page_table), live_int32(seq_lens)
        lens_u32 = lens.view(torch.uint32)  # XQA's dtype; the same memory, so in-place updates of lens reach it
        batch = lens.numel()
        max_seq_len = page_table.shape[1] * spec.page_size
        # zero-length rows (CUDA-graph padding) are zeros by contract: masked eagerly when the plan has such rows
        # (read on the host); a run being captured masks from the lengths of each replay
        during_capture = capturing(lens)
        has_empty = batch > 0 and (during_capture or bool((lens == 0).any()))
        workspace = _workspace(device, workspace_bytes(), during_capture)
        window_left = _window_left(spec)
        scale, fp8 = spec.scale, spec.kv_dtype is not None

        def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
            if spec.sinks:
                sinks = _sinks_arg(spec, sinks)
                if sinks.device != q.device:  # XQA reads it through a raw pointer: a host tensor would fault
                    raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
                sinks = sinks.contiguous()
            else:
                _no_sinks(sinks)
            bmm1, bmm2 = scale, 1.0
            if fp8:
                if k_scale is None or v_scale is None:
                    raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element "
                                     "tensors)")
                if k_scale.device != q.device or v_scale.device != q.device:  # read through raw pointers
                    raise ValueError(f"k_scale and v_scale must be on q's device {q.device}, got {k_scale.device} "
                                     f"and {v_scale.device}")
                bmm1, bmm2 = k_scale.float().reshape(1) * scale, v_scale.float().reshape(1)
            if batch == 0:  # XQA's launcher divides by the batch size
                return q.new_empty(q.shape)
            refresh_captured((refresh_table, refresh_lens), q)
            out = xqa_batch_decode_with_kv_cache(q.contiguous(), (k_cache, v_cache), workspace, page_table, lens_u32,
                                                 max_seq_len, bmm1_scale=bmm1, bmm2_scale=bmm2,
                                                 window_left=window_left, sinks=sinks, kv_layout="NHD")
            if has_empty or capturing(q):
                out = out.masked_fill((lens == 0)[:, None, None], 0.0)
            return out

        return run


BACKEND = XQABackend()
