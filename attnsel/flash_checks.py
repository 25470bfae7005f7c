"""The FlashAttention-compatible functions' argument checks (flash_api): what is not served, tensor types, layouts,
dtypes, devices, strides, scales and sinks, each error naming the argument and what is allowed."""
from __future__ import annotations

import numbers
import operator

import torch

from .errors import InvalidArgument
from .flash_masks import UnsupportedArgument, spec_masks

REALS = (float, int)  # softcap types memoised by value (a tensor option hashes by identity: checked every call)
KVCACHE_OPTIONAL = ("k", "v", "k_descale", "v_descale", "sinks")


def unsupported(func: str, given: dict) -> None:
    names = ", ".join(f"{k}={show(v)}" for k, v in given.items())
    raise UnsupportedArgument(f"attnsel.{func}: {names}: not supported by attnsel (leave at FlashAttention's default)")


def speed_hints(func: str, num_splits, pack_gqa, scheduler_metadata=None) -> None:
    """FA3's speed hints (num_splits, pack_gqa, scheduler_metadata) choose only how FA3 parallelises, which the
    dispatch decides itself: checked, then ignored. InvalidArgument naming a value FA3 would not take either:
    num_splits is any int to FA3 (<= 0: its own heuristic; numpy ints too), not a bool or a tensor (a device read).
    The callers skip this for the defaults (host time per call)."""
    if isinstance(num_splits, (bool, torch.Tensor)) or not hasattr(num_splits, "__index__"):
        raise InvalidArgument(f"attnsel.{func}: num_splits={show(num_splits)}: allowed: an int (a speed hint, "
                              "ignored: attnsel's dispatch chooses the split)")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise InvalidArgument(f"attnsel.{func}: pack_gqa={show(pack_gqa)}: allowed: None, True or False (a speed "
                              "hint, ignored)")
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise InvalidArgument(f"attnsel.{func}: scheduler_metadata={show(scheduler_metadata)}: allowed: None or "
                              "FA3's scheduler tensor (a speed hint, ignored)")


def show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def plain(causal, window_size, softcap) -> bool:
    """Whether a call's options are plain Python values that the memo may key on: a bool, a tuple of two ints, a
    float or int. A tensor option hashes by identity and could change in place; a call with one is never
    remembered, so it is checked in full every time (the memo's key holds each option's type beside its value, so
    a lookup cannot match a remembered call through equal values of another type)."""
    return (type(causal) is bool and type(softcap) in REALS and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int)


def unit_stride(func: str, **tensors: torch.Tensor) -> None:
    """Every tensor's last dimension is contiguous (the kernels index it with stride 1): InvalidArgument naming the
    first that is not. Called when one of them is not contiguous (the cheap common case is checked inline)."""
    for arg, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise InvalidArgument(f"attnsel.{func}: {arg}'s last dimension must be contiguous (stride 1), got strides "
                                  f"{tuple(t.stride())}; pass {arg}.contiguous()")


def scale_tensor(t: torch.Tensor) -> torch.Tensor:
    """A descale factor as the run functions take it (float32 [1]): the caller's own tensor when it already is one, so
    that backends reading it on the host (FlashInfer) read it once per tensor and version, not on every call."""
    if t.dtype == torch.float32 and t.dim() == 1:
        return t
    return t.reshape(1).float()


def scale_value(softmax_scale):
    """softmax_scale as a Python float (None stays None): FA3 takes any real number; tensors and bools are refused
    (a tensor would need a host sync per call, and never compares equal in the spec memo)."""
    if softmax_scale is None or type(softmax_scale) is float:
        return softmax_scale
    if isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool):
        return float(softmax_scale)
    raise scale_error(softmax_scale)


def scale_error(softmax_scale) -> InvalidArgument:
    return InvalidArgument(f"softmax_scale must be None (1/sqrt(head_dim)) or a positive finite Python float, got "
                           f"{show(softmax_scale)}")


def sinks_kwargs(func: str, sinks: torch.Tensor | None, heads: int) -> dict:
    if sinks is None:
        return {}
    if sinks.shape != (heads,):
        raise InvalidArgument(f"attnsel.{func}: sinks must have shape ({heads},) (one per query head), got "
                              f"{tuple(sinks.shape)}")
    return {"sinks": sinks if sinks.dtype == torch.float32 else sinks.float()}


def non_tensor(func: str, optional: tuple[str, ...], **args) -> None:
    """Raises TypeError naming the first argument that is not a tensor (None only where ``optional`` names it;
    cache_seqlens may be an int). Numpy arrays have a shape and a dtype: they are named here too."""
    for name, x in args.items():
        if isinstance(x, torch.Tensor) or (x is None and name in optional):
            continue
        if name == "cache_seqlens" and isinstance(x, int) and not isinstance(x, bool):
            continue
        allowed = "an int or an int32 torch.Tensor" if name == "cache_seqlens" else "a torch.Tensor"
        raise TypeError(f"attnsel.{func}: {name} must be {allowed}, got {type(x).__name__}")


def host_int(name: str, x) -> int:
    """A host integer argument (max_seqlen_q/k): an int, or what converts to one exactly (numpy ints); a float,
    text, a bool or None is an InvalidArgument naming it (int() would truncate 2.7 or read "3")."""
    if type(x) is int:
        return x
    try:
        if isinstance(x, bool):
            raise TypeError
        return operator.index(x)
    except TypeError:
        raise InvalidArgument(f"attnsel.flash_attn_varlen_func: {name} must be a Python int (the longest sequence's "
                              f"tokens, an upper bound is fine), got {x!r}") from None


def varlen_masks(q, k, v, cu_seqlens_q, cu_seqlens_k, qs, ks, causal, window_size, softcap, sinks) -> tuple:
    """flash_attn_varlen_func's argument checks for a call whose facts were not seen before (or could not be
    memoised): the spec's (causal, sliding_window, softcap); raises on the first bad argument."""
    non_tensor("flash_attn_varlen_func", ("sinks",), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
               cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    if len(qs) != 3 or len(ks) != 3 or v.shape != ks:
        raise InvalidArgument(f"attnsel.flash_attn_varlen_func: q must be [total_q, heads, head_dim] and k, v "
                              f"[total_k, kv_heads, head_dim] alike; got q {tuple(qs)}, k {tuple(ks)}, "
                              f"v {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidArgument(f"attnsel.flash_attn_varlen_func: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                              f"{v.dtype}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        unit_stride("flash_attn_varlen_func", q=q, k=k, v=v)
    if window_size == (-1, -1) and softcap == 0.0:
        return bool(causal), None, None
    return spec_masks("flash_attn_varlen_func", causal, window_size, softcap, one_query=False)


def kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table, qs, ks, ts, k_descale, v_descale, causal,
                   window_size, softcap, sinks) -> tuple:
    """flash_attn_with_kvcache's decode checks (q ``[batch, 1, H, D]``, at most one new token per sequence: flash_api
    sends other calls to flash_extend) for a call whose facts were not seen before, or that writes new tokens or reads
    an fp8 cache (checked every call): (cache_seqlens as a tensor, the run's descale kwargs, its sinks
    kwargs, the spec's sliding_window and softcap); raises on the first bad argument."""
    func = "flash_attn_with_kvcache"
    non_tensor(func, KVCACHE_OPTIONAL, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
               page_table=page_table, k_descale=k_descale, v_descale=v_descale, sinks=sinks)
    if len(ks) != 4 or v_cache.shape != ks or v_cache.dtype != k_cache.dtype:
        raise InvalidArgument(f"attnsel.{func}: k_cache and v_cache must both be [num_pages, page_size, kv_heads, "
                              f"head_dim] of one dtype, got {tuple(ks)} {k_cache.dtype} and "
                              f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if len(ts) != 2 or ts[0] != qs[0]:  # its dtype, and cache_seqlens', are checked where a plan is made
        raise InvalidArgument(f"attnsel.{func}: page_table must be int32 [batch, max_pages] with batch {qs[0]}, got "
                              f"{page_table.dtype} {tuple(ts)}")
    if (k is None) != (v is None):
        raise InvalidArgument(f"attnsel.{func}: give both k and v (new tokens) or neither")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        unit_stride(func, q=q, k_cache=k_cache, v_cache=v_cache)
    batch = qs[0]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    scales = cache_scales(func, q, k_cache, k, v, k_descale, v_descale)
    if k is not None and (k.device != q.device or v.device != q.device):  # before anything is written
        raise InvalidArgument(f"attnsel.{func}: k and v (new tokens) must be on q's device {q.device}, got {k.device} "
                              f"and {v.device}")
    if k is not None and (k.dtype != k_cache.dtype or v.dtype != k_cache.dtype):
        raise InvalidArgument(f"attnsel.{func}: k/v ({k.dtype}/{v.dtype}) must have the cache's dtype {k_cache.dtype}")
    if k is not None and (k.shape != (batch, 1, ks[2], ks[3]) or v.shape != k.shape):
        raise UnsupportedArgument(f"attnsel.{func}: k and v must be [batch, 1, kv_heads, head_dim] = "
                                  f"[{batch}, 1, {ks[2]}, {ks[3]}] (one new token per "
                                  f"sequence), got {tuple(k.shape)} and {tuple(v.shape)}")
    extra = sinks_kwargs(func, sinks, qs[2]) if sinks is not None else {}  # checked before the cache is written
    _, window, cap = (True, None, None) if window_size == (-1, -1) and softcap == 0.0 else spec_masks(
        func, causal, window_size, softcap, one_query=True)
    return cache_seqlens, scales, extra, window, cap


def cache_scales(func: str, q, k_cache, k, v, k_descale, v_descale) -> dict:
    """The run's descale kwargs for the cache's dtype: none for a cache in q's dtype (descales given: refused), one-
    element k_scale/v_scale for a float8_e4m3fn cache (new tokens k/v into it: refused); raises on anything else."""
    if k_cache.dtype != q.dtype:
        if k_cache.dtype != torch.float8_e4m3fn:
            raise InvalidArgument(f"attnsel.{func}: the KV cache's dtype {k_cache.dtype} differs from q's {q.dtype}; "
                                  "allowed: q's dtype, or torch.float8_e4m3fn with k_descale/v_descale")
        if k_descale is None or v_descale is None or k_descale.numel() != 1 or v_descale.numel() != 1:
            raise UnsupportedArgument(
                f"attnsel.{func}: a {k_cache.dtype} cache needs k_descale and v_descale of one element each "
                f"(per-tensor scales); got k_descale={show(k_descale)}, v_descale={show(v_descale)}")
        if k is not None:
            unsupported(func, {"k": k, "v": v})  # quantising new tokens into an fp8 cache: write them yourself
        return {"k_scale": scale_tensor(k_descale), "v_scale": scale_tensor(v_descale)}
    if k_cache.dtype == torch.float8_e4m3fn:  # q fp8 too
        raise InvalidArgument(f"attnsel.{func}: q's dtype {q.dtype} is not served: q must be bfloat16, float16 or "
                              "float32 (an fp8 cache takes q in one of them with k_descale/v_descale)")
    if k_descale is not None or v_descale is not None:
        given = ", ".join(f"{n}={show(x)}" for n, x in (("k_descale", k_descale), ("v_descale", v_descale))
                          if x is not None)
        raise UnsupportedArgument(f"attnsel.{func}: {given}: descale factors apply only to a torch.float8_e4m3fn "
                                  f"cache; this cache is {k_cache.dtype} (leave them None)")
    return {}


def varlen_offsets(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   rows_q: int, rows_k: int) -> None:
    """flash_attn_varlen_func's offsets against q's and k's rows and the max_seqlen bounds: one host read per plan
    (as flash_attn_with_kvcache reads its lengths). A kernel trusts them: Triton's grid covers max_seqlen_q rows of
    each sequence (rows past it stay unwritten), offsets past q's rows make it write past out. ValueError naming the
    argument and what is allowed (dtypes and devices checked before; other shapes are the plan's errors)."""
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
        return
    parts = []
    for cu in (cu_seqlens_q, cu_seqlens_k):
        steps = cu[1:] - cu[:-1]
        parts += [cu[0], cu[-1], steps.min(), steps.argmin(), steps.max(), steps.argmax()]
    got = torch.stack([p.long() for p in parts]).tolist()
    func = "attnsel.flash_attn_varlen_func"
    for name, (first, last, low, at_low, high, at_high), bound_name, bound, rows, holder in (
            ("cu_seqlens_q", got[:6], "max_seqlen_q", max_seqlen_q, rows_q, "q holds"),
            ("cu_seqlens_k", got[6:], "max_seqlen_k", max_seqlen_k, rows_k, "k and v hold")):
        if first < 0:
            raise ValueError(f"{func}: {name}[0] is {first}; allowed: offsets >= 0 (0: the first sequence starts at "
                             "the first row)")
        if low < 0:
            raise ValueError(f"{func}: {name} runs backwards: sequence {at_low} has {low} tokens; allowed: "
                             "non-decreasing offsets")
        if high > bound:
            raise ValueError(f"{func}: {bound_name}={bound} but sequence {at_high} has {high} tokens by {name}; "
                             f"allowed: {bound_name} >= every sequence's tokens (an upper bound is fine)")
        if last > rows:
            raise ValueError(f"{func}: {name}[-1] is {last} but {holder} {rows} rows; allowed: {name}[-1] <= "
                             f"{rows} (rows after it are padding)")
