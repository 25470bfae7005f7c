"""transformers' own attention for the calls attnsel hands back (its SDPA, or the model's eager attention where SDPA
would ignore an argument), and the mask function registered as "attnsel": a 2D key mask for the patterns attnsel
serves, transformers' own 4D mask for the others."""
from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F

from .hf_calls import PAGED, is_causal, sdpa_ignores

NAME = "attnsel"  # the name of attnsel's attention and mask functions in transformers' registries


def transformers_attention(module, kwargs: dict):
    """(function, needs_float_mask): transformers' SDPA attention when it computes what the call asks, else the
    model's own eager attention (sinks, softcap and whatever else the model's arguments mean)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ignored = sdpa_ignores(kwargs)
    if not ignored:
        return sdpa_attention_forward, False
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"{type(module).__name__}: attnsel cannot serve this call and transformers' SDPA "
                                  f"would ignore {', '.join(ignored)}; the model's module has no "
                                  "eager_attention_forward to hand it to")
    return eager, True


def dense(module, query, key, value, attention_mask, scaling, dropout, kwargs, window):
    """The call computed by transformers: its SDPA or the model's eager attention, on the 4D mask transformers'
    own builders make from the 2D key mask (same padding, sliding window, and causal or, for a non-causal call,
    bidirectional pattern)."""
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        eager_mask,
        sdpa_mask,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    fn, float_mask = transformers_attention(module, kwargs)
    batch, len_q, len_kv = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
        if float_mask and mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    else:
        n = len_kv if attention_mask is None else attention_mask.shape[1]
        if is_causal(module, kwargs):
            pattern = causal_mask_function if not window else sliding_window_causal_mask_function(window)
        else:
            pattern = bidirectional_mask_function if not window else sliding_window_bidirectional_mask_function(window)
        build = eager_mask if float_mask else sdpa_mask
        mask = build(batch_size=batch, q_length=len_q, kv_length=len_kv, q_offset=n - len_q, kv_offset=0,
                     mask_function=pattern, attention_mask=None if attention_mask is None else attention_mask.bool(),
                     allow_is_causal_skip=False, dtype=query.dtype, device=query.device)
    return fn(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def paged(module, query, key, value, cache, cu_q, cu_k, read_index, write_index, cache_window, scaling, dropout,
          kwargs):
    """The call computed by transformers: the keys ``cache.update`` gathers, the float mask continuous batching's
    own ``build_attention_mask`` makes for paged|eager and paged|sdpa, then transformers' SDPA or the model's
    eager attention (which, unlike paged|sdpa, honours sinks and softcap)."""
    from transformers.generation.continuous_batching.utils import build_attention_mask

    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, read_index=read_index,
                        write_index=write_index)
    mask = torch.full((1, 1, query.shape[2], k.shape[0]), torch.finfo(query.dtype).min, dtype=query.dtype,
                      device=query.device)
    build_attention_mask(mask, cu_q.tolist(), cu_k.tolist(), sliding_window=cache_window)
    model_kwargs = {n: val for n, val in kwargs.items() if n not in PAGED}
    fn, _ = transformers_attention(module, model_kwargs)
    return fn(module, query, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scaling=scaling,
              dropout=dropout, **model_kwargs)


# --- the mask function of "attnsel" ------------------------------------------------------------------------------

def mask_window(mask_function, local_size):
    """The sliding window of a transformers mask function: None for plain causal, an int for a sliding-window causal
    pattern, False for anything else (chunked, packed, bidirectional, overlays)."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return None
    try:
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
        overlay, causal = parts
        window = inspect.getclosurevars(overlay).nonlocals.get("sliding_window")
    except (TypeError, ValueError):
        return False
    if (getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask" and causal is causal_mask_function
            and getattr(overlay, "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"
            and isinstance(window, int) and window == local_size):
        return window
    return False


@torch.compiler.disable  # host-side planning and selection: runs eagerly inside compiled models
def key_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, mask_function=None,
             attention_mask: torch.Tensor | None = None, local_size: int | None = None, **kwargs):
    """transformers mask function of "attnsel": a bool key mask ``[B, n]`` over the key slots that exist (padding
    False; slots n..kv_length-1 are empty static-cache slots; the queries are the last q_length of the n slots),
    tagged with its sliding window (``_attnsel_window``). Patterns attnsel does not serve get transformers' own 4D
    SDPA mask, and their attention calls are handed back."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    kwargs.pop("allow_is_causal_skip", None)
    window = mask_window(mask_function, local_size)
    # generate() makes the masks of a StaticCache step ahead of the forward, and models without per-layer-type
    # masks pass that mask back in here: it is already a key mask of this step (slicing it again would be wrong)
    made = getattr(attention_mask, "_attnsel_window", False)
    if made is not False:
        if made != window:
            raise ValueError(f"{NAME}: a key mask made for sliding window {made} was passed back for window {window}")
        return attention_mask
    if window is False:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         local_size=local_size, allow_is_causal_skip=False, **kwargs)
    n = int(q_offset) + q_length - kv_offset  # a StaticCache gives q_offset as a tensor: one host read per mask
    device = kwargs.get("device", "cpu")
    if attention_mask is None:
        mask = torch.ones(batch_size, n, dtype=torch.bool, device=device)
    else:
        mask = attention_mask.bool()[:, kv_offset:kv_offset + n]
        if mask.shape[1] < n:  # a 2D mask shorter than the keys: the missing columns are padding, as transformers'
            mask = F.pad(mask, (0, n - mask.shape[1]), value=False)
    mask._attnsel_window = window
    return mask
