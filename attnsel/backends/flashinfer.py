"""flashinfer: FlashInfer's ragged prefill and paged decode wrappers (plan once per batch, run per layer).

Two decode variants are separate candidates because they differ in speed by up to 1.9x (DESIGN.md):
``flashinfer`` (tensor-core decode kernels) and ``flashinfer_cuda_cores``.

Workspace: one zeroed float buffer per device, ATTNSEL_FLASHINFER_WORKSPACE_MB (default 128, FlashInfer's
recommendation for real batches); the validation worker sets 32. The wrappers, and so the plans, are one per device
and phase: a run function is valid until the next plan of the same phase and variant on that device.
FlashInfer JIT-compiles kernels on first use (minutes on a fresh machine) into ``jit_cache_dir()``.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from ..device import capability_reason, package_version
from ..spec import AttentionSpec
from . import Phase, RunFn

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128, 256)
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE in flashinfer/utils.cuh
WORKSPACE_ENV = "ATTNSEL_FLASHINFER_WORKSPACE_MB"


def workspace_bytes() -> int:
    raw = os.environ.get(WORKSPACE_ENV, "128")
    try:
        mb = int(raw)
    except ValueError:
        raise ValueError(f"{WORKSPACE_ENV} must be a whole number of MiB, got {raw!r}") from None
    if mb < 8:
        raise ValueError(f"{WORKSPACE_ENV} must be at least 8 (MiB), got {mb}")
    return mb << 20


def jit_cache_dir() -> str:
    """Where FlashInfer keeps compiled kernels (FLASHINFER_WORKSPACE_BASE, default the home directory)."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~"))
    return os.path.join(base, ".cache", "flashinfer")


@functools.cache
def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


@functools.cache
def _wrapper(device: torch.device, kind: str, nbytes: int):
    import flashinfer

    ws = _workspace(device, nbytes)
    if kind == "prefill":
        return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=(kind == "decode_tc"))


def paged_kv_layout(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """(indptr, indices, last_page_len) in FlashInfer's CSR form from a page table and sequence lengths."""
    lens = seq_lens.to(torch.int32)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(page_table.shape[1], device=lens.device)[None, :] < pages[:, None]
    indices = page_table.to(torch.int32)[used]
    last = lens - (pages - 1) * page_size
    return indptr, indices, last


class FlashInferBackend:
    def __init__(self, name: str, tensor_cores: bool):
        self.name = name
        self.tensor_cores = tensor_cores

    def version(self) -> str | None:
        return package_version("flashinfer-python")

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer is not installed (pip install flashinfer-python)"
        reasons = [capability_reason(">= 8.0", lambda cap: cap >= (8, 0))]
        if spec.dtype not in ("fp16", "bf16"):
            reasons.append(f"dtype {spec.dtype} is not supported (fp16, bf16)")
        if spec.head_dim not in HEAD_DIMS:
            reasons.append(f"head_dim {spec.head_dim} is not supported (supported: "
                           f"{', '.join(map(str, HEAD_DIMS))})")
        if phase == "prefill" and not self.tensor_cores:
            reasons.append("this variant differs from flashinfer only in decode; its prefill is flashinfer's")
        if phase == "decode" and not self.tensor_cores and spec.group_size not in CUDA_CORE_GROUP_SIZES:
            reasons.append(f"GQA group size {spec.group_size} is not supported by FlashInfer's CUDA-core decode "
                           f"(supported: {', '.join(map(str, CUDA_CORE_GROUP_SIZES))})")
        return "; ".join(r for r in reasons if r) or None

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        wrapper = _wrapper(cu_seqlens_q.device, "prefill", workspace_bytes())
        wrapper.plan(cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), spec.num_q_heads,
                     spec.num_kv_heads, spec.head_dim, causal=spec.causal, sm_scale=spec.scale,
                     q_data_type=spec.torch_dtype, kv_data_type=spec.torch_dtype)
        return self._checked(wrapper, lambda q, k, v: wrapper.run(q, k, v))

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        kind = "decode_tc" if self.tensor_cores else "decode_cc"
        wrapper = _wrapper(seq_lens.device, kind, workspace_bytes())
        indptr, indices, last = paged_kv_layout(page_table, seq_lens, spec.page_size)
        wrapper.plan(indptr, indices, last, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                     sm_scale=spec.scale, q_data_type=spec.torch_dtype, kv_data_type=spec.torch_dtype)
        return self._checked(wrapper, lambda q, k_cache, v_cache: wrapper.run(q, (k_cache, v_cache)))

    def _checked(self, wrapper, call) -> RunFn:
        """The run function of the wrapper's current plan; it raises once a later plan replaced that one."""
        generation = wrapper.attnsel_plans = getattr(wrapper, "attnsel_plans", 0) + 1
        name = self.name

        def run(*tensors: torch.Tensor) -> torch.Tensor:
            if wrapper.attnsel_plans != generation:
                raise RuntimeError(f"{name}: this run function belongs to an earlier plan; FlashInfer keeps one "
                                   "plan per device and phase, so plan again for this batch")
            return call(*tensors)

        return run


BACKEND = FlashInferBackend("flashinfer", tensor_cores=True)
BACKEND_CUDA_CORES = FlashInferBackend("flashinfer_cuda_cores", tensor_cores=False)
