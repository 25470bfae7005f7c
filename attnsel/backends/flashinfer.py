"""flashinfer: FlashInfer's ragged prefill and paged decode wrappers (plan once per batch, run per layer).

Variants are separate candidates because their speed differs by shape (see the results file):
``flashinfer`` (prefill and extend: FlashInfer's own template choice, its FA3 template on Hopper, FA2 with an fp8
cache; decode: tensor-core kernels), ``flashinfer_cuda_cores`` (decode on CUDA cores), ``flashinfer_fa2`` (prefill and
extend on the FA2 template, Hopper only: below Hopper, and in extend with an fp8 cache, it is what ``flashinfer``
runs), ``flashinfer_fa3`` (tensor-core
decode on the FA3 template, Hopper only).
Extend (ragged queries over the paged cache) runs BatchPrefillWithPagedKVCacheWrapper: qo_indptr = cu_seqlens_q, the
page table in CSR form, causal (FlashInfer aligns bottom-right by each row's lengths). A row without keys is planned
as a one-token row on page 0 (FlashInfer's FA3 template plans rows by their host lengths, and a row of no pages
would read the page ids of the next row) and its queries are zeroed, as are queries before a row's first key.

Features (FlashInfer 0.6.4): sliding window (``window_left = w - 1``) and logit softcap (``logits_soft_cap``) at
plan time; an fp8 e4m3 cache (``kv_data_type``; decode and extend) with ``k_scale`` folded into the softmax scale on
the host (FlashInfer takes it as a Python float: the tensor is read once per tensor version, a host sync only then)
and ``v_scale`` applied to the output on the device. Sinks (``flashinfer`` only): FlashInfer's
BatchAttentionWithAttentionSinkWrapper, a paged prefill JIT variant (its own module per dtype/window) that adds the
sink to the first KV tile's softmax state; extend plans it as it comes, decode with one query per sequence, prefill
with the ragged k/v viewed as a paged cache of page size 1. That variant has no softcap and no fp8 dequantisation:
declined with sinks.

Workspace: one zeroed float buffer per device, the largest asked for: ATTNSEL_FLASHINFER_WORKSPACE_MB (default 128,
FlashInfer's recommendation for real batches), or more where a spec's plans may need more on this GPU
(``plan_bytes``), used for validation and serving alike, shared by the wrappers of the device (their runs go on one
stream). A wrapper holds one plan, and every live run function owns its wrapper (``_take``): a later plan takes
another wrapper from a pool per device and variant, so a run function, and a CUDA graph captured from it, stays
valid as long as it is kept.
FlashInfer JIT-compiles kernels on first use (minutes on a fresh machine) into ``jit_cache_dir()``.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
import weakref

import torch

from .. import settings
from ..device import package_version
from ..spec import AttentionSpec
from . import Phase, RunFn
from . import support
from .support import capability_reason, dtype_reason, feature_reasons, joined

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128, 256)
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE in flashinfer/utils.cuh
SINKS_WHY = ("FlashInfer 0.6.4 takes sinks only in its trtllm-gen (Blackwell) path and in the attention-sink JIT "
             "variant, which attnsel uses for the flashinfer candidate only")


def workspace_bytes(spec: AttentionSpec | None = None, device: torch.device | None = None) -> int:
    """FlashInfer's float workspace in bytes: $ATTNSEL_FLASHINFER_WORKSPACE_MB (settings.Settings), raised to the
    most a plan of ``spec`` may carve out of it on ``device`` (``plan_bytes``). FlashInfer does not grow the buffer:
    a plan whose partial outputs do not fit raises, so a fixed size served some shapes of a spec and failed others
    (an 8-query-head, 1-KV-head spec overflowed 128 MiB on an H100)."""
    floor = settings.read("flashinfer_workspace_mb") << 20
    sms = _sms(device) if device is not None else None
    return floor if spec is None or sms is None else max(floor, plan_bytes(spec, sms))


def plan_bytes(spec: AttentionSpec, sms: int) -> int:
    """The most float workspace FlashInfer's plans take for ``spec`` on a GPU of ``sms`` multiprocessors, rounded up
    to whole MiB (FlashInfer's scheduler.cuh). A split-KV FA2 plan (PrefillPlan: prefill, extend, tensor-core decode,
    and the attention-sink wrapper, a BatchPrefillWithPagedKVCacheWrapper): partial outputs and log-sum-exps of
    num_q_heads x (2 x sms // num_kv_heads) work tiles (two CTAs per SM, shared by the KV heads) x 128 query rows
    (64 from head_dim 256) x (head_dim + 1) floats. CUDA-core decode (DecodePlan: at most 32 blocks per SM, one row
    of head_dim + 1 floats per tile) and the FA3 template (no float workspace) take less."""
    tile = 128 if spec.head_dim < 256 else 64
    need = spec.num_q_heads * (2 * sms // spec.num_kv_heads) * tile * (spec.head_dim + 1) * 4
    need += 4 * 16  # each allocation aligned to 16 bytes
    return -(-need >> 20) << 20


def _sms(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def jit_cache_dir() -> str:
    """Where FlashInfer keeps compiled kernels (FLASHINFER_WORKSPACE_BASE, default the home directory)."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~"))
    return os.path.join(base, ".cache", "flashinfer")


def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """The device's float workspace, at least ``nbytes``: the largest asked for so far. A larger request replaces it:
    the free wrappers on older buffers leave every pool of the device now, those of live run functions keep theirs
    until ``_take`` finds them free, so a process serving specs of different bounds ends with one buffer per device."""
    with _pool_lock:
        ws = _workspaces.get(device)
        if ws is None or ws.numel() < nbytes:
            ws = _workspaces[device] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            for key, pool in _pools.items():
                if key[0] == device:
                    pool[:] = [w for w in pool if w.attnsel_ws_bytes >= nbytes or w.attnsel_owner() is not None]
        return ws


FREE_KEPT = 4  # wrappers without a live plan kept per kind for reuse (each holds 8 MB of int workspace + 8 MB pinned)
_pools: dict = {}
_workspaces: dict = {}  # device -> its float workspace (``_workspace``)
_pool_lock = threading.Lock()


class _Hold:
    """Reserves a wrapper between taking it from the pool and handing out the run function of its plan."""


_DEAD = weakref.ref(_Hold())  # the owner of a free wrapper
_planning = threading.local()  # wrappers taken by the plan running in this thread


def _released_on_error(plan, *args) -> RunFn:
    """plan(*args); if it raises, the wrappers it took go back to the pool (a kept traceback would otherwise keep the
    planning frame, and with it the wrapper's hold, alive)."""
    taken = _planning.__dict__.setdefault("taken", [])
    mark = len(taken)
    try:
        return plan(*args)
    except BaseException:
        for wrapper in taken[mark:]:
            wrapper.attnsel_owner = _DEAD
        raise
    finally:
        del taken[mark:]


def _take(key: tuple, nbytes: int, make) -> tuple[object, _Hold]:
    """A wrapper of ``key`` that no live run function holds, on the device's current float workspace (``_workspace``,
    at least ``nbytes``): a new one from ``make(ws)`` if none is free; free ones on an older buffer leave the pool.

    A FlashInfer wrapper keeps one plan, and planning rewrites its buffers and workspace in place: a run function,
    and any CUDA graph captured from it, replays what its wrapper holds at replay time. So every live run function
    owns its wrapper (``wrapper.attnsel_owner``: a weak reference to it): a later plan takes another wrapper, and a
    wrapper returns to the pool when its run function is dropped. Returns (wrapper, hold): keep the hold alive until
    ``_checked`` has made the run function."""
    hold = _Hold()
    with _pool_lock:
        pool = _pools.setdefault(key, [])
        free = [w for w in pool if w.attnsel_owner() is None]
        current = _workspaces.get(key[0])  # buffers only grow: a wrapper on less than the current one is on an old one
        least = max(nbytes, current.numel() if current is not None else 0)
        for small in [w for w in free if w.attnsel_ws_bytes < least]:
            pool.remove(small)
            free.remove(small)
        for extra in free[FREE_KEPT:]:
            pool.remove(extra)
        wrapper = free[0] if free else None
        if wrapper is not None:
            wrapper.attnsel_owner = weakref.ref(hold)
    if wrapper is None:
        ws = _workspace(key[0], nbytes)
        wrapper = make(ws)  # outside the lock: a first sinks wrapper builds its JIT module (minutes)
        wrapper.attnsel_owner = weakref.ref(hold)
        wrapper.attnsel_ws_bytes = ws.numel()
        with _pool_lock:
            pool.append(wrapper)
    _planning.__dict__.setdefault("taken", []).append(wrapper)
    return wrapper, hold


def _wrapper(device: torch.device, kind: str, nbytes: int, template: str, spec: AttentionSpec
             ) -> tuple[object, _Hold]:
    """A free wrapper of this device, kind ("prefill", "extend", "decode_tc", "decode_cc"), template ("auto", "fa2",
    "fa3")
    and the spec's q/KV dtypes (a wrapper resolves its "auto" template once, on its first plan), and its hold (see
    ``_take``). The wrappers of a device share one float workspace: their runs must be issued on one stream (as an
    engine's layers are)."""
    def make(ws):
        import flashinfer

        if kind == "prefill":
            return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=template)
        if kind == "extend":
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=template)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=(kind == "decode_tc"),
                                                             backend=template)

    return _take((device, kind, template, spec.torch_dtype, spec.kv_torch_dtype), nbytes, make)


def _sink_wrapper(device: torch.device, phase: str, nbytes: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                  head_dim: int, window_left: int) -> tuple[object, _Hold]:
    """FlashInfer's attention-sink variant (one JIT module per dtype, head_dim and windowed-or-not), taken like the
    others."""
    def make(ws):
        import flashinfer

        return flashinfer.BatchAttentionWithAttentionSinkWrapper(
            ws, "NHD", backend="auto", q_data_type=q_dtype, kv_data_type=kv_dtype,
            head_dim_qk=head_dim, head_dim_vo=head_dim, window_left=window_left)

    return _take((device, "sinks-" + phase, q_dtype, kv_dtype, head_dim, window_left), nbytes, make)


def paged_kv_layout(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """(indptr, indices, last_page_len) in FlashInfer's CSR form from a page table and sequence lengths; only the
    first ceil(len / page_size) entries of each row are read (later ones may be sentinels)."""
    lens = seq_lens.to(torch.int32)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(page_table.shape[1], device=lens.device)[None, :] < pages[:, None]
    indices = page_table.to(torch.int32)[used]
    last = lens - (pages - 1) * page_size
    return indptr, indices, last


class HostScalar:
    """The float value of a one-element device tensor, read once per tensor and version (a host sync only then); a
    tensor made under torch.inference_mode() has no version counter and is read on every call."""

    def __init__(self):
        self._tensor: torch.Tensor | None = None  # kept alive, so identity cannot be reused by another tensor
        self._version = -1
        self._value = 0.0

    def __call__(self, t: torch.Tensor) -> float:
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter, a change cannot be seen
            self._tensor = None
            return float(t.reshape(-1)[0].item())
        if t is not self._tensor or version != self._version:
            self._value = float(t.reshape(-1)[0].item())
            self._tensor, self._version = t, version
        return self._value


GRAPH_STALE = ("its plan copies the lengths and page ids into its own buffers and splits the work on the host: a "
               "replay after the engine updates them in place would compute the old batch")


class FlashInferBackend:
    def __init__(self, name: str, *, phases: tuple[str, ...], prefill_template: str = "auto",
                 decode_kind: str = "decode_tc", decode_template: str = "auto", hopper_only: bool = False,
                 same_as: str = "flashinfer"):
        self.name = name
        self.phases = phases
        self.prefill_template = prefill_template
        self.decode_kind = decode_kind
        self.decode_template = decode_template
        self.hopper_only = hopper_only  # the variant differs from `same_as` only on Hopper
        self.same_as = same_as
        # FlashInfer's plan() turns the lengths and page ids into its own index buffers and work partition on the
        # host; a graph replays those. (FlashInfer's own graph mode calls plan() before every replay: attnsel's
        # contract has nothing called between replays.)
        self.graph_stale = {phase: GRAPH_STALE for phase in phases}
        self.first_use_note = ("first use JIT-compiles kernels: about 2 minutes on a fresh machine"
                               if decode_kind == "decode_tc" or "prefill" in phases else
                               "first use JIT-compiles kernels: about 20 s on a fresh machine")

    def version(self) -> str | None:
        return package_version("flashinfer-python")

    def report_extras(self) -> dict:
        return {"flashinfer_jit_dir": jit_cache_dir()}

    def unsupported(self, spec: AttentionSpec, phase: Phase, device: torch.device | None = None) -> str | None:
        if phase not in self.phases:
            return f"this variant differs from {self.same_as} only in {', '.join(self.phases)}"
        reasons = [None if importlib.util.find_spec("flashinfer") is not None
                   else "flashinfer is not installed (pip install flashinfer-python)"]
        if self.hopper_only:
            need = capability_reason("9.x (Hopper)", lambda cap: cap[0] == 9, device)
            why = (f"below Hopper {self.same_as} runs this same FA2 kernel" if self.prefill_template == "fa2"
                   else "FlashInfer's FA3 template runs on Hopper only")
            reasons.append(need and f"{need}: {why}")
            if self.prefill_template == "fa2" and phase == "extend" and spec.kv_dtype is not None:
                reasons.append(f"with an fp8 KV cache FlashInfer's own template choice is FA2: in extend this variant "
                               f"is the kernel {self.same_as} runs")
        else:
            reasons.append(capability_reason(">= 8.0", lambda cap: cap >= (8, 0), device))
        reasons.append(dtype_reason(spec))
        if spec.head_dim not in HEAD_DIMS:
            reasons.append(f"head_dim {spec.head_dim} is not supported (supported: "
                           f"{', '.join(map(str, HEAD_DIMS))})")
        if phase == "decode" and self.decode_kind == "decode_cc" and spec.group_size not in CUDA_CORE_GROUP_SIZES:
            reasons.append(f"GQA group size {spec.group_size} is not supported by FlashInfer's CUDA-core decode "
                           f"(supported: {', '.join(map(str, CUDA_CORE_GROUP_SIZES))})")
        if spec.sliding_window is not None and not spec.causal:
            reasons.append("a sliding window with non-causal attention is not supported (the window is causal)")
        supported = {"sliding_window", "softcap", "kv_dtype", "non_causal"}
        why = {"sinks": SINKS_WHY}
        if self.name == "flashinfer":
            supported.add("sinks")
            if spec.sinks and spec.softcap is not None:
                reasons.append("attention sinks with a logit softcap: not supported (FlashInfer's attention-sink "
                               "variant has no softcap)")
            if spec.sinks and spec.kv_dtype is not None and phase != "prefill":
                reasons.append("attention sinks with an fp8 KV cache: not supported (FlashInfer's attention-sink "
                               "variant does not dequantise)")
        if phase == "decode" and self.decode_template == "fa3":
            supported.discard("kv_dtype")
            why["kv_dtype"] = "FlashInfer's FA3 template needs fp8 queries with an fp8 KV cache"
        reasons += feature_reasons(spec, phase, supported, why)
        return joined(reasons)

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn:
        return _released_on_error(self._plan_prefill, spec, cu_seqlens_q, cu_seqlens_k)

    def _plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> RunFn:
        if spec.sinks:
            return self._plan_prefill_sinks(spec, cu_seqlens_q, cu_seqlens_k)
        device = cu_seqlens_q.device
        wrapper, hold = _wrapper(device, "prefill", workspace_bytes(spec, device), self.prefill_template, spec)
        # private copies: FlashInfer's plan keeps the indptr tensors it is given and its run reads them, so a caller
        # that rewrites its cu_seqlens in place would change what this plan (or a graph captured from it) reads
        wrapper.plan(cu_seqlens_q.to(torch.int32, copy=True), cu_seqlens_k.to(torch.int32, copy=True), spec.num_q_heads,
                     spec.num_kv_heads, spec.head_dim, causal=spec.causal, sm_scale=spec.scale,
                     window_left=_window_left(spec), logits_soft_cap=spec.softcap,
                     q_data_type=spec.torch_dtype, kv_data_type=spec.torch_dtype)
        blind = support.rows_without_keys(cu_seqlens_q, cu_seqlens_k) if spec.causal else None

        def call(q, k, v, *, sinks=None):
            _no_sinks(sinks)
            out = wrapper.run(q, k, v)
            return out.index_fill_(0, blind, 0.0) if blind is not None else out

        return self._checked(wrapper, hold, call)

    def _plan_prefill_sinks(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
                            ) -> RunFn:
        """Ragged k/v [total_k, kvh, d] as a paged cache of page size 1: page i is key row i."""
        device = cu_seqlens_q.device
        wrapper, hold = _sink_wrapper(device, "prefill", workspace_bytes(spec, device), spec.torch_dtype,
                                      spec.torch_dtype, spec.head_dim, _window_left(spec))
        cu_q, cu_k = cu_seqlens_q.to(torch.int32, copy=True), cu_seqlens_k.to(torch.int32, copy=True)  # see above
        total_k = int(cu_k[-1])
        indices = torch.arange(total_k, dtype=torch.int32, device=device)
        last = torch.ones(cu_k.numel() - 1, dtype=torch.int32, device=device)
        wrapper.plan(cu_q, cu_k, indices, last, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, 1,
                     causal=spec.causal, sm_scale=spec.scale, window_left=_window_left(spec),
                     q_data_type=spec.torch_dtype, kv_data_type=spec.torch_dtype)
        scale = spec.scale
        blind = support.rows_without_keys(cu_q, cu_k) if spec.causal else None

        def call(q, k, v, *, sinks=None):
            out = wrapper.run(q, (k.unsqueeze(1), v.unsqueeze(1)), _sinks_arg(spec, sinks), scale)
            return out.index_fill_(0, blind, 0.0) if blind is not None else out

        return self._checked(wrapper, hold, call)

    def _plan_paged_sinks(self, spec: AttentionSpec, phase: str, qo_indptr: torch.Tensor, page_table: torch.Tensor,
                          seq_lens: torch.Tensor) -> RunFn:
        """The attention-sink wrapper over the paged cache: decode (one query per row) and extend."""
        device = seq_lens.device
        wrapper, hold = _sink_wrapper(device, phase, workspace_bytes(spec, device), spec.torch_dtype,
                                      spec.kv_torch_dtype, spec.head_dim, _window_left(spec))
        indptr, indices, last, blind = _extend_layout(qo_indptr, page_table, seq_lens, spec.page_size)
        wrapper.plan(qo_indptr, indptr, indices, last, spec.num_q_heads, spec.num_kv_heads, spec.head_dim,
                     spec.page_size, causal=spec.causal, sm_scale=spec.scale, window_left=_window_left(spec),
                     q_data_type=spec.torch_dtype, kv_data_type=spec.kv_torch_dtype)
        scale = spec.scale

        def call(q, k_cache, v_cache, *, sinks=None, k_scale=None, v_scale=None):
            out = wrapper.run(q, (k_cache, v_cache), _sinks_arg(spec, sinks), scale)
            return out.index_fill_(0, blind, 0.0) if blind is not None else out

        return self._checked(wrapper, hold, call)

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        return _released_on_error(self._plan_decode, spec, page_table, seq_lens)

    def _plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        if spec.sinks:
            qo_indptr = torch.arange(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
            return self._plan_paged_sinks(spec, "decode", qo_indptr, page_table, seq_lens)
        wrapper, hold = _wrapper(seq_lens.device, self.decode_kind, workspace_bytes(spec, seq_lens.device),
                                 self.decode_template, spec)
        indptr, indices, last = paged_kv_layout(page_table, seq_lens, spec.page_size)
        wrapper.plan(indptr, indices, last, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                     window_left=_window_left(spec), logits_soft_cap=spec.softcap, sm_scale=spec.scale,
                     q_data_type=spec.torch_dtype, kv_data_type=spec.kv_torch_dtype)
        lens = seq_lens.to(torch.int32)
        empty_rows = (lens == 0)[:, None, None] if lens.numel() and bool((lens == 0).any()) else None
        run = _paged_run(wrapper, spec)

        def call(q, k_cache, v_cache, **kwargs):
            out = run(q, k_cache, v_cache, **kwargs)
            if empty_rows is not None:  # zero-length rows (CUDA-graph padding) are zeros by contract
                out = out.masked_fill(empty_rows, 0.0)
            return out

        return self._checked(wrapper, hold, call)

    def plan_extend(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor, max_seqlen_q: int, max_seq_len: int) -> RunFn:
        return _released_on_error(self._plan_extend, spec, cu_seqlens_q, page_table, seq_lens)

    def _plan_extend(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor) -> RunFn:
        qo_indptr = cu_seqlens_q.to(torch.int32, copy=True)  # private: FlashInfer's run reads the tensor it was given
        if spec.sinks:
            return self._plan_paged_sinks(spec, "extend", qo_indptr, page_table, seq_lens)
        wrapper, hold = _wrapper(seq_lens.device, "extend", workspace_bytes(spec, seq_lens.device),
                                 self.prefill_template, spec)
        indptr, indices, last, blind = _extend_layout(qo_indptr, page_table, seq_lens, spec.page_size)
        wrapper.plan(qo_indptr, indptr, indices, last, spec.num_q_heads, spec.num_kv_heads, spec.head_dim,
                     spec.page_size, causal=spec.causal, sm_scale=spec.scale, window_left=_window_left(spec),
                     logits_soft_cap=spec.softcap, q_data_type=spec.torch_dtype, kv_data_type=spec.kv_torch_dtype)
        run = _paged_run(wrapper, spec)

        def call(q, k_cache, v_cache, **kwargs):
            out = run(q, k_cache, v_cache, **kwargs)
            return out.index_fill_(0, blind, 0.0) if blind is not None else out

        return self._checked(wrapper, hold, call)

    def _checked(self, wrapper, hold: _Hold, call) -> RunFn:
        """The run function of the wrapper's current plan, which owns the wrapper from now on (``hold`` reserved it
        while planning). It raises if a later plan replaced its plan anyway, and ``run.current()`` says whether it
        still holds (callers that cache plans re-plan when it does not)."""
        generation = wrapper.attnsel_plans = getattr(wrapper, "attnsel_plans", 0) + 1
        name = self.name

        def run(*tensors: torch.Tensor, **kwargs) -> torch.Tensor:
            if wrapper.attnsel_plans != generation:
                raise RuntimeError(f"{name}: this run function's plan was replaced (FlashInfer keeps one plan "
                                   "per wrapper); plan again for this batch")
            return call(*tensors, **kwargs)

        run.current = lambda: wrapper.attnsel_plans == generation
        wrapper.attnsel_owner = weakref.ref(run)
        del hold  # the run function holds the wrapper now
        return run


def _extend_layout(qo_indptr: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """(indptr, indices, last_page_len, query rows that see no key or None) of a batch for FlashInfer's paged
    prefill wrappers. A row without keys becomes a one-token row on page 0 (its queries are among the blind rows,
    zeroed): FlashInfer's FA3 template plans each row by its host length, and a row of no pages gets ``page_size``
    tokens there, read through the page ids of the next row. Reads the metadata on the host (the plan syncs anyway)."""
    lens = seq_lens.to(torch.int32)
    keys = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    keys[1:] = torch.cumsum(lens, 0)
    blind = support.rows_without_keys(qo_indptr, keys)
    empty = lens == 0
    if lens.numel() and bool(empty.any()):
        table = page_table if page_table.shape[1] else torch.zeros(lens.numel(), 1, dtype=torch.int32,
                                                                   device=lens.device)
        table = table.to(torch.int32, copy=True)
        table[:, 0] = torch.where(empty, 0, table[:, 0])
        page_table, lens = table, torch.where(empty, 1, lens)
    return (*paged_kv_layout(page_table, lens, page_size), blind)


def _paged_run(wrapper, spec: AttentionSpec) -> RunFn:
    """The planned wrapper's run over the paged caches, fp8 scales applied: k_scale as FlashInfer's float (one host
    read per distinct tensor, HostScalar), v_scale on the output on the device in float32 (FlashInfer's is a float)."""
    fp8 = spec.kv_dtype is not None
    k_scale_host = HostScalar()

    def run(q, k_cache, v_cache, *, sinks=None, k_scale=None, v_scale=None):
        _no_sinks(sinks)
        if not fp8:
            return wrapper.run(q, (k_cache, v_cache))
        if k_scale is None or v_scale is None:
            raise ValueError(f"kv_dtype {spec.kv_dtype} needs k_scale and v_scale (float32 one-element tensors)")
        out = wrapper.run(q, (k_cache, v_cache), k_scale=k_scale_host(k_scale))
        return (out * v_scale).to(q.dtype)

    return run


def _window_left(spec: AttentionSpec) -> int:
    return spec.sliding_window - 1 if spec.sliding_window is not None else -1


def _no_sinks(sinks) -> None:
    if sinks is not None:
        raise ValueError("sinks were passed but the spec has sinks=False")


def _sinks_arg(spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor:
    if sinks is None or sinks.shape != (spec.num_q_heads,) or sinks.dtype != torch.float32:
        raise ValueError(f"spec.sinks needs sinks: a float32 tensor [num_q_heads={spec.num_q_heads}]")
    return sinks


BACKEND = FlashInferBackend("flashinfer", phases=("prefill", "decode", "extend"))
BACKEND_CUDA_CORES = FlashInferBackend("flashinfer_cuda_cores", phases=("decode",), decode_kind="decode_cc")
BACKEND_FA2 = FlashInferBackend("flashinfer_fa2", phases=("prefill", "extend"), prefill_template="fa2",
                               hopper_only=True)
BACKEND_FA3 = FlashInferBackend("flashinfer_fa3", phases=("decode",), decode_template="fa3", hopper_only=True)
