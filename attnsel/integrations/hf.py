"""Hugging Face transformers integration: attention implementations ``"attnsel"`` and ``"paged|attnsel"``.

``register()`` once, before loading the model, then ``from_pretrained(..., attn_implementation="attnsel")`` for
``generate`` or ``"paged|attnsel"`` for continuous batching (``generate_batch``). The backend selection runs once per
model shape and device at the first attention call (or explicitly with ``select_for_model``), with the same
options, environment and cache as the CLI, and is logged as ``prefill: X, decode: Y``.

Dense path: the 2D padding mask is unpadded into a ragged batch for prefill; one-token steps go through the paged
decode API (the dense cache rows are gathered into pages, left-aligned). Paged path (transformers 5.17): decode-only
steps write the new tokens into transformers' own cache tensors and read them in place through a page table derived
from its read index; steps with prefill tokens go through the ragged prefill API.
Calls the selected backend cannot serve (sliding windows, dropout, non-causal attention) fall back to the torch
backend, logged once per reason.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch

from ..backends.torch_sdpa import sdpa
from ..selection import Selection, select
from ..spec import AttentionSpec, dtype_name, hf_fields

log = logging.getLogger(__name__)

NAME = "attnsel"
PAGED_NAME = "paged|attnsel"
PAGED_VERSIONS = ("5.17",)  # custom paged implementations are accepted (5.19 refuses them; 5.18 changed the cache)
DENSE_PAGE_SIZE = 16
ENV_PREFILL, ENV_DECODE = "ATTNSEL_PREFILL_BACKEND", "ATTNSEL_DECODE_BACKEND"

_options: dict = {}
_selections: dict = {}
_logged: set = set()
_registrations = [0]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def paged_unsupported() -> str | None:
    """Why "paged|attnsel" cannot be registered with the installed transformers, or None."""
    version = _transformers_version()
    if ".".join(version.split(".")[:2]) not in PAGED_VERSIONS:
        return (f"the paged implementation needs transformers {' or '.join(PAGED_VERSIONS)} (found {version}): later "
                "versions accept only flash-named or Hub-kernel implementations for continuous batching")
    return None


def register(prefill: str | None = None, decode: str | None = None, **select_options) -> list[str]:
    """Register the attnsel attention implementations with transformers; returns the names registered.

    prefill/decode: "auto" or a backend name (default $ATTNSEL_PREFILL_BACKEND / $ATTNSEL_DECODE_BACKEND or auto);
    select_options go to ``attnsel.select`` (policy, mode, priorities, timeout, cache_dir, use_cache).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import (
            AttentionMaskInterface,
            flash_attention_mask,
        )
    except ImportError as exc:
        raise RuntimeError("attnsel.integrations.hf needs transformers >= 5.0 with AttentionInterface and "
                           f"AttentionMaskInterface ({exc})") from exc
    _options.clear()
    _options.update(select_options)
    _options.update({k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None})
    _selections.clear()
    _logged.clear()
    _registrations[0] += 1
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)  # 2D padding mask (or None), unpadded here
    names = [NAME]
    reason = paged_unsupported()
    if reason is None:
        AttentionInterface.register(PAGED_NAME, paged_attention_forward)
        names.append(PAGED_NAME)
    else:  # transformers >= 5.19: continuous batching through the flash-named route (hf_kernels)
        from . import hf_kernels

        log.warning("attnsel: %s not registered: %s; use %s for continuous batching", PAGED_NAME, reason,
                    hf_kernels.NAME)
        names += hf_kernels.register(prefill, decode, **select_options)
    return names


def model_spec(config, dtype: torch.dtype, page_size: int, scaling: float | None = None) -> AttentionSpec:
    """AttentionSpec of a transformers model config at the model's dtype."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = hf_fields(data)
    fields.update(dtype=dtype_name(dtype), page_size=page_size)
    if scaling is not None and not math.isclose(scaling, fields["head_dim"] ** -0.5, rel_tol=1e-6):
        fields["softmax_scale"] = float(scaling)
    return AttentionSpec(**fields)


def selection_for(spec: AttentionSpec, device: torch.device) -> Selection:
    """The Selection for a spec on a device, made once per process (the persistent cache makes later starts fast)."""
    key = (spec, str(device))
    if key not in _selections:
        opts = {"prefill": os.environ.get(ENV_PREFILL, "auto"), "decode": os.environ.get(ENV_DECODE, "auto"),
                **_options}
        sel = select(spec, opts.pop("prefill"), opts.pop("decode"), device=str(device), **opts)
        log.info("attnsel for %s on %s: prefill: %s, decode: %s", spec.describe(), device, sel.prefill, sel.decode)
        _selections[key] = sel
    return _selections[key]


def _module_selection(module, query: torch.Tensor, scaling: float | None, page_size: int) -> Selection:
    """selection_for this attention module's spec, remembered on the module: building the spec from the config on
    every layer call would put a config.to_dict() on the hot path."""
    key = (query.dtype, query.device, page_size, scaling, _registrations[0])  # a new register() forgets the memo
    memo = module.__dict__.get("_attnsel_selection")
    if memo is None or memo[0] != key:
        sel = selection_for(model_spec(module.config, query.dtype, page_size, scaling), query.device)
        module.__dict__["_attnsel_selection"] = memo = (key, sel)
    return memo[1]


def select_for_model(model, page_size: int = DENSE_PAGE_SIZE) -> Selection:
    """Run the selection for a loaded model now (instead of at its first attention call)."""
    param = next(model.parameters())
    return selection_for(model_spec(model.config, param.dtype, page_size), param.device)


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("attnsel: falling back to the torch backend: %s", reason)


def _cannot_serve(module, dropout: float, kwargs: dict, longest_kv: int) -> str | None:
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        return "non-causal attention"
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window and longest_kv > window:  # a window longer than every sequence is plain causal attention
        return f"sliding-window attention (window {window})"
    if dropout and module.training:
        return "attention dropout in training"
    if kwargs.get("softcap"):
        return "logit softcapping"
    return None


# --- dense path (generate) ------------------------------------------------------------------------------------------

class _StepPlans:
    """One plan per forward step: a step begins when a layer index does not exceed the previous call's (layers run
    in order), or when the kind of step changes. Tensor identity or version counters are not reliable for this:
    transformers refills static input buffers in ways that do not always bump a tensor's version.

    Off CUDA every call plans afresh: reusing a step's plan across layers gave NaN outputs for a CPU-resident model
    under the device machine's torch 2.11 (2026-12-02, scripts/hf_debug.py; CUDA runs were token-identical either
    way, the cause was not found). Planning is cheap next to CPU attention."""

    def __init__(self) -> None:
        self.layer: int | None = None
        self.key = None
        self.plan = None

    def get(self, layer_idx: int | None, key, make, device: torch.device):
        new_step = device.type != "cuda" or layer_idx is None or self.layer is None or layer_idx <= self.layer
        if self.plan is None or new_step or key != self.key:
            self.plan, self.key = make(), key
        self.layer = layer_idx
        return self.plan


_dense_steps = _StepPlans()
_paged_steps = _StepPlans()


@dataclasses.dataclass
class _DensePlan:
    decode: bool
    run: object
    q_index: tuple  # (rows, positions) of the real query tokens
    k_index: tuple  # (rows, positions) of the real key tokens; decode: gather grid [B, padded length]


def _plan_dense(sel: Selection, mask: torch.Tensor | None, batch: int, len_q: int, len_kv: int,
                device: torch.device) -> _DensePlan:
    kmask = mask.bool() if mask is not None else torch.ones(batch, len_kv, dtype=torch.bool, device=device)
    qmask = kmask[:, -len_q:]
    q_lens, k_lens = qmask.sum(1), kmask.sum(1)
    if len_q == 1 and bool((q_lens == 1).all()):
        ps = sel.spec.page_size
        padded = math.ceil(int(k_lens.max()) / ps) * ps
        order = torch.argsort((~kmask).to(torch.int8), dim=1, stable=True)  # real positions first, in order
        if padded > len_kv:
            order = torch.cat([order, order[:, -1:].expand(batch, padded - len_kv)], 1)
        pos = order[:, :padded]
        rows = torch.arange(batch, device=device)[:, None].expand(batch, padded)
        pages = padded // ps
        page_table = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
        return _DensePlan(True, sel.plan_decode(page_table, k_lens.to(torch.int32)), (), (rows, pos))
    else:
        cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        cu_q[1:], cu_k[1:] = torch.cumsum(q_lens, 0), torch.cumsum(k_lens, 0)
        run = sel.plan_prefill(cu_q, cu_k, int(q_lens.max()), int(k_lens.max()))
        return _DensePlan(False, run, qmask.nonzero(as_tuple=True), kmask.nonzero(as_tuple=True))


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[B, H, Sq, D]``, key/value ``[B, KVH, Skv, D]``; out ``[B, Sq, H, D]``.
    """
    batch, _, len_q, _ = query.shape
    len_kv = key.shape[2]
    why = _cannot_serve(module, dropout, kwargs, len_kv)
    if why is None and attention_mask is not None and attention_mask.dim() != 2:
        why = f"a {attention_mask.dim()}D attention mask (attnsel registers a 2D padding mask)"
    if why is not None:
        _log_once(why)
        return _torch_dense(query, key, value, attention_mask, scaling, kwargs.get("sliding_window")), None
    sel = _module_selection(module, query, scaling, DENSE_PAGE_SIZE)
    plan = _dense_steps.get(getattr(module, "layer_idx", None), (batch, len_q, len_kv, sel.prefill, sel.decode),
                            lambda: _plan_dense(sel, attention_mask, batch, len_q, len_kv, query.device),
                            query.device)
    k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, Skv, KVH, D] views
    if plan.decode:
        rows, pos = plan.k_index
        kvh, d = k.shape[2:]
        k_pages = k[rows, pos].view(-1, sel.spec.page_size, kvh, d)
        v_pages = v[rows, pos].view(-1, sel.spec.page_size, kvh, d)
        out = plan.run(query[:, :, 0].contiguous(), k_pages, v_pages)
        return out[:, None], None
    q_rows, q_pos = plan.q_index
    k_rows, k_pos = plan.k_index
    packed = plan.run(query.transpose(1, 2)[q_rows, q_pos], k[k_rows, k_pos], v[k_rows, k_pos])
    out = query.new_zeros(batch, len_q, query.shape[1], query.shape[3])
    out[q_rows, q_pos] = packed
    return out, None


def _torch_dense(query, key, value, mask2d, scaling, window) -> torch.Tensor:
    """The torch backend on the dense layout: bottom-right causal, padding and sliding-window mask."""
    len_q, len_kv = query.shape[2], key.shape[2]
    q_pos = torch.arange(len_kv - len_q, len_kv, device=query.device)[:, None]
    k_pos = torch.arange(len_kv, device=query.device)[None, :]
    keep = k_pos <= q_pos
    if window:
        keep = keep & (k_pos > q_pos - window)
    keep = keep[None, None]
    if mask2d is not None:
        keep = keep & mask2d.bool()[:, None, None, :] if mask2d.dim() == 2 else keep & mask2d.bool()
    keep = keep | ~keep.any(-1, keepdim=True)  # fully padded query rows: any finite output, ignored by the model
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return sdpa(query, key, value, scale, mask=keep).transpose(1, 2)


# --- paged path (continuous batching, transformers 5.17) ------------------------------------------------------------

def paged_page_table(read_index: torch.Tensor, cu_k: torch.Tensor, block_size: int) -> tuple:
    """(page_table, seq_lens) of a decode step from transformers' read index: sequence i reads slots
    ``read_index[cu_k[i]:cu_k[i+1]]``, which lie block by block in its pages."""
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    max_pages = max(1, math.ceil(int(lens.max()) / block_size))
    offsets = cu_k[:-1, None].long() + torch.arange(max_pages, device=cu_k.device)[None, :] * block_size
    valid = offsets < cu_k[1:, None].long()
    slots = read_index[offsets.clamp(max=read_index.numel() - 1)]
    page_table = torch.where(valid, slots // block_size, torch.zeros_like(slots)).to(torch.int32)
    return page_table, lens


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, read_index=None, write_index=None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Continuous-batching attention: query ``[1, H, T, D]`` packed, key/value the new tokens; out ``[1, T, H, D]``."""
    if cache is None:
        raise ValueError(f"{PAGED_NAME} was called without a paged attention cache: load the model with "
                         f"attn_implementation='{NAME}' for plain forward/generate calls")
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k["full_attention"], max_seqlen_k["full_attention"]
    # Sliding layers keep their own cache group and lengths: always transformers' paged sdpa for them.
    why = _cannot_serve(module, dropout, kwargs, longest_kv=1 << 62)
    if why is not None:
        from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

        _log_once(f"{why} (paged: transformers' paged sdpa)")
        return sdpa_attention_paged_forward(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, cache=cache, read_index=read_index,
                                            write_index=write_index, **kwargs)
    group, layer_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    block = cache.block_size
    sel = _module_selection(module, query, scaling, block)
    tokens = query.shape[2]
    batch = cu_seq_lens_q.numel() - 1
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    if max_seqlen_q == 1 and tokens == batch and read_index[group].numel() > 0:
        k_cache, v_cache = cache.key_cache[layer_in_group], cache.value_cache[layer_in_group]
        k_cache.index_copy_(0, write_index[group], key[0].transpose(0, 1))
        v_cache.index_copy_(0, write_index[group], value[0].transpose(0, 1))
        run = _paged_steps.get(module.layer_idx, ("decode", group, sel.decode),
                               lambda: sel.plan_decode(*paged_page_table(read_index[group], cu_seq_lens_k, block)),
                               query.device)
        kvh, d = k_cache.shape[-2:]
        out = run(q, k_cache.view(-1, block, kvh, d), v_cache.view(-1, block, kvh, d))
        return out[None], None
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, read_index=read_index,
                        write_index=write_index)
    run = _paged_steps.get(module.layer_idx, ("prefill", group, sel.prefill),
                           lambda: sel.plan_prefill(cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32),
                                                    int(max_seqlen_q), int(max_seqlen_k)),
                           query.device)
    return run(q, k.contiguous(), v.contiguous())[None], None
