"""FlashAttention-3-compatible entry points: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``.

Same argument names, defaults, layouts and return values as FA3's ``flash_attn_interface`` for what attnsel serves;
any other argument given a value other than its default raises ``UnsupportedArgument`` naming it (never ignored).
Mapped onto the spec: ``causal`` / ``window_size`` -> ``causal`` / ``sliding_window`` as FA3 masks
(``flash_masks``: ``left + 1`` keys up to the diagonal; with one query per sequence every window is causal),
``softcap`` -> ``softcap``, ``sinks`` -> ``sinks``, an fp8 e4m3 paged cache with ``k_descale``/``v_descale`` (one
element each) -> ``kv_dtype="fp8_e4m3"``.

The spec is inferred from the tensors; the backend selection runs once per (spec, device) in this process (same rules
and persistent cache as ``attnsel.select``; ``$ATTNSEL_PREFILL_BACKEND`` / ``$ATTNSEL_DECODE_BACKEND`` or
``configure()`` choose explicit backends). A call plans on the selected backend and runs; the plan is reused while
the metadata tensors (cu_seqlens, or cache_seqlens and page_table) are the same tensor objects at the same version
counter and the host sizes are equal, so the layers of one step share one plan. Checks that depend only on a
call's dtypes, head shapes, options and devices run once per combination of them (a plain decode call; calls that
write new tokens or read an fp8 cache are checked in full every time); the metadata's dtypes and shapes are checked
when a plan is made. Rewriting metadata in a way torch does not count needs ``reset()``: numpy views, DLPack,
``.data`` (also one that changes a dtype: the metadata's dtypes are checked when a plan is made),
``untyped_storage()`` copies, Triton kernels and custom ops that write into them, and CUDA graph replays (a graph's
writes move no version counter). Metadata tensors made under ``torch.inference_mode()`` have no version counter:
their plans are never reused (one plan per call, logged once); allocate them outside inference mode to share a plan
across layers.

CUDA graphs: the first call of a spec selects (outside capture). During capture every call plans afresh (a plan made
outside the capture would replay stale device metadata) on a selection made in mode "graph" (``graph_selection``),
from host bounds instead of device values (``page_table.shape[1] * page_size`` for the longest context, ``q.shape[0]``
for the tokens). Plans made during capture are kept for the life of the process: a graph replays its plan's buffers
(e.g. the Triton decode's split buffers), so they must outlive every graph (one per captured call).

Decode plans take q in FA3's ``[batch, 1, H, D]`` (``Selection.plan_decode(q_layout="b1hd")``): FA3 and Triton runs
take that layout as it comes; other backends get q viewed as ``[batch, H, D]`` and out viewed back (two views, 2-4 us
of host time on the H200's host).
"""
from __future__ import annotations

import itertools
import logging
import math
import numbers
import operator
import os

import torch

from . import kv_append
from .backends.support import capturing as _capturing  # module attribute: the timing script stubs it
from .flash_masks import UnsupportedArgument, spec_masks
from .graph_selection import GRAPH, check_may_select
from .selection import Selection, select
from .spec import AttentionSpec, SpecError, dtype_name

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16  # page_size of the spec used for varlen calls (they have no pages)
ENV_PREFILL, ENV_DECODE = "ATTNSEL_PREFILL_BACKEND", "ATTNSEL_DECODE_BACKEND"


_options: dict = {}
_selections: dict = {}
_specs: dict = {}
# A call's raw facts (dtypes, shapes but the token/batch counts, options as given with softmax_scale's type: True
# and 1.0 hash alike; only plain Python options: a tensor given as causal, softcap or a window bound hashes by
# identity and could change in place, such calls are checked in full every time; devices) -> the (spec, selection,
# number) its checks gave: a call whose facts were seen before skips the checks that depend on them only (0.6-0.9 us
# less host time per call on a CPU here). The metadata's dtypes and shapes are checked when a plan is made (a reused
# plan was made from those very tensors).
_calls: dict = {}
_generation = 0  # reset() counts up: a check that straddles a reset does not store into the memo
_REALS = (float, int)  # softcap types memoised by value (a tensor option hashes by identity: checked every call)
_plans: dict = {}
_numbers = itertools.count()  # names specs in _plans' slots; never restarts (a reset racing a call cannot reuse one)
_no_versions_logged: list = []
_captured: list = []  # plans made during CUDA-graph capture: kept for good (configure() does not drop them)


def configure(prefill: str | None = None, decode: str | None = None, **select_options) -> None:
    """Options of the selection these functions run (``attnsel.select``'s: policy, mode, priorities, timeout,
    cache_dir, use_cache); prefill/decode: "auto" or a backend name (default: the environment, else auto).
    Forgets earlier selections and plans."""
    _options.clear()
    _options.update(select_options)
    _options.update({k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None})
    reset()


def reset() -> None:
    """Forget selections and plans (the persistent result cache stays)."""
    global _generation
    _generation += 1
    _selections.clear()
    _specs.clear()
    _calls.clear()
    _plans.clear()


def selection_for(spec: AttentionSpec, device: torch.device | str, mode: str | None = None) -> Selection:
    """The Selection for a spec on a device (mode None: the configured one; "graph": see graph_selection), kept."""
    key = (spec, device, mode)
    sel = _selections.get(key)
    if sel is None:
        opts = {"prefill": os.environ.get(ENV_PREFILL, "auto"), "decode": os.environ.get(ENV_DECODE, "auto"),
                **_options, **({"mode": mode} if mode else {})}
        check_may_select(spec, mode)
        sel = select(spec, opts.pop("prefill"), opts.pop("decode"), device=str(device), **opts)
        log.info("attnsel for %s on %s (%s): prefill: %s, decode: %s", spec.describe(), device, sel.mode,
                 sel.prefill, sel.decode)
        _selections[key] = sel
    return sel  # keyed by the device object as given (str or torch.device): no str() per call


def _unsupported(func: str, given: dict) -> None:
    names = ", ".join(f"{k}={_show(v)}" for k, v in given.items())
    raise UnsupportedArgument(f"attnsel.{func}: {names}: not supported by attnsel (leave at FlashAttention's default)")


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def _resolve(func: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qs: torch.Size, ks: torch.Size,
             page_size: int, softmax_scale, causal: bool, window: int | None, softcap: float | None, sinks: bool
             ) -> tuple[AttentionSpec, Selection, int]:
    """The AttentionSpec of the call, its Selection and an int naming it in the plan cache (unique for the process),
    memoised on the cheap facts they are made from (hashing a spec per call would cost a microsecond). qs, ks: q's
    and k's shapes (read once per call). k and v (or the caches) must be on q's device: checked when a key is new
    (the devices are part of it)."""
    softmax_scale = _scale_value(softmax_scale)
    kv_dtype = k.dtype
    key = (q.dtype, kv_dtype, qs[-2], ks[-2], qs[-1], ks[-1], page_size, softmax_scale, causal, window, softcap, sinks,
           q.device, k.device, v.device)
    found = _specs.get(key)
    if found is None:
        head_dim = qs[-1]
        kn, vn = ("k", "v") if func == "flash_attn_varlen_func" else ("k_cache", "v_cache")  # the caller's names
        if key[-2] != key[-3] or key[-1] != key[-3]:
            raise ValueError(f"attnsel.{func}: q, {kn} and {vn} must be on one device, got q on {q.device}, {kn} on "
                             f"{k.device}, {vn} on {v.device}")
        scale = None
        if softmax_scale is not None and (not math.isfinite(softmax_scale) or softmax_scale <= 0):
            raise _scale_error(softmax_scale)
        if softmax_scale is not None and not math.isclose(softmax_scale, head_dim ** -0.5, rel_tol=1e-6):
            scale = float(softmax_scale)
        kv_name = "fp8_e4m3" if kv_dtype != q.dtype else None  # the callers refused any other KV dtype
        if ks[-1] != head_dim:
            raise SpecError(f"attnsel.{func}: q has head_dim {head_dim} but {kn} has {ks[-1]} (they must be equal)")
        try:
            spec = AttentionSpec(num_q_heads=qs[-2], num_kv_heads=ks[-2], head_dim=head_dim,
                                 dtype=dtype_name(q.dtype), page_size=page_size, causal=causal, softmax_scale=scale,
                                 sliding_window=window, softcap=softcap, sinks=sinks, kv_dtype=kv_name)
        except SpecError as exc:  # in the caller's terms: which tensors the fields came from
            raise SpecError(f"attnsel.{func}: q {tuple(qs)} and {kn} {tuple(ks)} give no valid spec: {exc}",
                            exc.field) from None
        # setdefault: of two threads making the first call of a key at once, both use the first one's entry
        found = _specs.setdefault(key, (spec, selection_for(spec, q.device), next(_numbers)))
    return found


def _known(key: tuple):
    """The (spec, selection, number) remembered for a call's facts, or None (also for facts that cannot be hashed,
    e.g. a list as window_size: such calls take the checked path every time)."""
    try:
        return _calls.get(key)
    except TypeError:
        return None


def _plain(causal, window_size, softcap) -> bool:
    """Whether a call's options are plain Python values that the memo may key on: a bool, a tuple of two ints, a
    float or int. A tensor option hashes by identity and could change in place; a call with one is never
    remembered, so it is checked in full every time (the memo's key holds each option's type beside its value, so
    a lookup cannot match a remembered call through equal values of another type)."""
    return (type(causal) is bool and type(softcap) in _REALS and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int)


def _remember(key: tuple, found: tuple, generation: int) -> None:
    """Keep found for key unless reset() ran since the checks that gave it began (generation: _generation then);
    a selection forgotten by configure() must not come back through the memo. reset() counts up before it clears:
    a store before the count is cleared by it, one after is taken back here."""
    if generation != _generation:
        return
    try:
        if len(_calls) >= 4096:  # bounded: facts such as a fresh float softmax_scale per call must not grow it
            _calls.clear()
        _calls[key] = found
    except TypeError:
        return
    if generation != _generation:
        _calls.pop(key, None)


def _unit_stride(func: str, **tensors: torch.Tensor) -> None:
    """Every tensor's last dimension is contiguous (the kernels index it with stride 1): ValueError naming the first
    that is not. Called when one of them is not contiguous (the cheap common case is checked inline)."""
    for arg, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"attnsel.{func}: {arg}'s last dimension must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}; pass {arg}.contiguous()")


def _versions(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """The version counters of the metadata tensors; None for tensors made under torch.inference_mode(), which have
    none: a change to them cannot be seen, so their plans are never reused (logged once)."""
    try:
        return a._version, b._version
    except RuntimeError:
        if not _no_versions_logged:
            _no_versions_logged.append(True)
            log.warning("attnsel: metadata tensors made under torch.inference_mode() have no version counter, so "
                        "attnsel cannot tell whether they changed and plans every call; allocate cu_seqlens / "
                        "cache_seqlens / page_table outside inference mode (or use torch.no_grad()) to share one plan "
                        "across the layers of a step")
        return None


def _cached_plan(slot: tuple, a: torch.Tensor, b: torch.Tensor, host: tuple, capturing: bool):
    """The plan stored for ``slot`` (phase, spec number) if it was made outside capture from these very metadata
    tensors a, b at their current versions and these host values, and is still current (a plan made since by anyone
    on the same backend state, e.g. a plugin with one plan per wrapper, makes it stale); else None.
    An entry is (a, b, a's version, b's version, host, the run's ``current`` check or None, plan); the versions are
    None for a plan made during capture or from tensors without version counters: never reused."""
    e = _plans.get(slot)
    if (e is not None and e[0] is a and e[1] is b and e[2] is not None and not capturing and e[2] == a._version
            and e[3] == b._version and e[4] == host and (e[5] is None or e[5]())):
        return e[6]
    return None


def _store_plan(slot: tuple, a: torch.Tensor, b: torch.Tensor, versions: tuple[int, int] | None, host: tuple,
                capturing: bool, plan):
    """Keep a new plan for ``slot`` with the metadata's versions read before planning (holding the tensors keeps
    their ids unique) and return it."""
    va, vb = (None, None) if capturing or versions is None else versions
    run = plan[1] if isinstance(plan, tuple) else plan
    current = getattr(run, "current", None)
    _plans[slot] = (a, b, va, vb, host, (lambda: bool(current())) if current is not None else None, plan)
    if capturing:  # a CUDA graph replays this plan's buffers: keep the plan as long as the process (graphs included)
        _captured.append(plan)
    return plan


def _scale_tensor(t: torch.Tensor) -> torch.Tensor:
    """A descale factor as the run functions take it (float32 [1]): the caller's own tensor when it already is one, so
    that backends reading it on the host (FlashInfer) read it once per tensor and version, not on every call."""
    if t.dtype == torch.float32 and t.dim() == 1:
        return t
    return t.reshape(1).float()


def _scale_value(softmax_scale):
    """softmax_scale as a Python float (None stays None): FA3 takes any real number; tensors and bools are refused
    (a tensor would need a host sync per call, and never compares equal in the spec memo)."""
    if softmax_scale is None or type(softmax_scale) is float:
        return softmax_scale
    if isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool):
        return float(softmax_scale)
    raise _scale_error(softmax_scale)


def _scale_error(softmax_scale) -> ValueError:
    return ValueError(f"softmax_scale must be None (1/sqrt(head_dim)) or a positive finite Python float, got "
                      f"{_show(softmax_scale)}")


def _sinks_kwargs(func: str, sinks: torch.Tensor | None, heads: int) -> dict:
    if sinks is None:
        return {}
    if sinks.shape != (heads,):
        raise ValueError(f"attnsel.{func}: sinks must have shape ({heads},) (one per query head), got "
                         f"{tuple(sinks.shape)}")
    return {"sinks": sinks if sinks.dtype == torch.float32 else sinks.float()}


def _non_tensor(func: str, optional: tuple[str, ...], **args) -> None:
    """Raises TypeError naming the first argument that is not a tensor (None only where ``optional`` names it;
    cache_seqlens may be an int). Numpy arrays have a shape and a dtype: they are named here too."""
    for name, x in args.items():
        if isinstance(x, torch.Tensor) or (x is None and name in optional):
            continue
        if name == "cache_seqlens" and isinstance(x, int) and not isinstance(x, bool):
            continue
        allowed = "an int or an int32 torch.Tensor" if name == "cache_seqlens" else "a torch.Tensor"
        raise TypeError(f"attnsel.{func}: {name} must be {allowed}, got {type(x).__name__}")


_KVCACHE_OPTIONAL = ("k", "v", "k_descale", "v_descale", "sinks")


def _host_int(name: str, x) -> int:
    """A host integer argument (max_seqlen_q/k): an int, or what converts to one exactly (numpy ints); a float,
    text, a bool or None is a ValueError naming it (int() would truncate 2.7 or read "3")."""
    if type(x) is int:
        return x
    try:
        if isinstance(x, bool):
            raise TypeError
        return operator.index(x)
    except TypeError:
        raise ValueError(f"attnsel.flash_attn_varlen_func: {name} must be a Python int (the longest sequence's "
                         f"tokens, an upper bound is fine), got {x!r}") from None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, sinks=None):
    """Ragged attention, FA3's signature: q ``[total_q, H, D]``, k/v ``[total_k, KVH, D]`` (bf16/fp16/fp32),
    cu_seqlens_q/k int32 ``[batch + 1]`` on q's device, max_seqlen_q/k host ints (upper bounds are fine).
    Causal masking is bottom-right aligned (sequences with fewer queries than keys). Returns out ``[total_q, H, D]``.
    Not served (UnsupportedArgument when not default): seqused_q/k, qv, q/k/v_descale, attention_chunk, num_splits,
    pack_gqa, deterministic, sm_margin, return_attn_probs."""
    try:
        if (seqused_q is not None or seqused_k is not None or qv is not None or q_descale is not None
                or k_descale is not None or v_descale is not None or attention_chunk != 0 or num_splits != 1
                or pack_gqa is not None or deterministic or sm_margin != 0 or return_attn_probs):
            given = dict(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale, k_descale=k_descale,
                         v_descale=v_descale)
            given = {n: x for n, x in given.items() if x is not None}
            given.update({n: x for n, x, d in (("attention_chunk", attention_chunk, 0), ("num_splits", num_splits, 1),
                                               ("pack_gqa", pack_gqa, None), ("deterministic", deterministic, False),
                                               ("sm_margin", sm_margin, 0), ("return_attn_probs", return_attn_probs, False))
                          if x != d})
            _unsupported("flash_attn_varlen_func", given)
        qs, ks = q.shape, k.shape
        key = found = None
        if len(qs) == 3 and len(ks) == 3 and v.shape == ks:  # the facts the checks below depend on, but the strides
            key = (q.dtype, k.dtype, v.dtype, qs[1], qs[2], ks[1], ks[2], softmax_scale, type(softmax_scale), causal,
                   type(causal), window_size, type(window_size), softcap, type(softcap), sinks is None, q.device,
                   k.device, v.device)
            found = _known(key)
        if found is not None:
            if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
                _unit_stride("flash_attn_varlen_func", q=q, k=k, v=v)
            spec, sel, number = found
        else:
            generation = _generation
            spec, sel, number = _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, qs, ks, softmax_scale, causal,
                                                window_size, softcap, sinks)
            if key is not None and _plain(causal, window_size, softcap):
                _remember(key, (spec, sel, number), generation)
        host = (max_seqlen_q if type(max_seqlen_q) is int else _host_int("max_seqlen_q", max_seqlen_q),
                max_seqlen_k if type(max_seqlen_k) is int else _host_int("max_seqlen_k", max_seqlen_k), qs[0], ks[0])
        slot, capturing = ("prefill", number), _capturing(q)
        run = _cached_plan(slot, cu_seqlens_q, cu_seqlens_k, host, capturing)
        sel = selection_for(spec, q.device, GRAPH) if run is None and capturing and sel.mode != GRAPH else sel
        if run is None:  # the metadata's checks: a reused plan was made from these very tensors at these versions
            _non_tensor("flash_attn_varlen_func", ("sinks",), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, sinks=sinks)  # numpy arrays have a shape and a dtype
            if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
                raise ValueError(f"attnsel.flash_attn_varlen_func: cu_seqlens_q/cu_seqlens_k must be int32, got "
                                 f"{cu_seqlens_q.dtype}/{cu_seqlens_k.dtype}")
            if cu_seqlens_q.device != q.device or cu_seqlens_k.device != q.device:
                raise ValueError(f"attnsel.flash_attn_varlen_func: cu_seqlens_q/cu_seqlens_k must be on q's device "
                                 f"{q.device}, got {cu_seqlens_q.device}/{cu_seqlens_k.device}")
            versions = _versions(cu_seqlens_q, cu_seqlens_k)
            run = _store_plan(slot, cu_seqlens_q, cu_seqlens_k, versions, host, capturing,
                              sel.plan_prefill(cu_seqlens_q, cu_seqlens_k, host[0], host[1], total_q=host[2],
                                               total_k=host[3], checked=False))
        if sinks is None:
            return run(q, k, v)
        return run(q, k, v, **_sinks_kwargs("flash_attn_varlen_func", sinks, qs[1]))
    except AttributeError:  # a list, number or None where a tensor goes: name it, else the error stands
        _non_tensor("flash_attn_varlen_func", ("sinks",), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, sinks=sinks)
        raise


def _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, qs, ks, softmax_scale, causal, window_size, softcap, sinks
                    ) -> tuple[AttentionSpec, Selection, int]:
    """flash_attn_varlen_func's argument checks and its (spec, selection, number) for a call whose facts were not
    seen before (or could not be memoised); raises on the first bad argument."""
    _non_tensor("flash_attn_varlen_func", ("sinks",), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    if len(qs) != 3 or len(ks) != 3 or v.shape != ks:
        raise ValueError(f"attnsel.flash_attn_varlen_func: q must be [total_q, heads, head_dim] and k, v "
                         f"[total_k, kv_heads, head_dim] alike; got q {tuple(qs)}, k {tuple(ks)}, "
                         f"v {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attnsel.flash_attn_varlen_func: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        _unit_stride("flash_attn_varlen_func", q=q, k=k, v=v)
    causal, window, cap = (bool(causal), None, None) if window_size == (-1, -1) and softcap == 0.0 else spec_masks(
        "flash_attn_varlen_func", causal, window_size, softcap, one_query=False)
    # the spec's checks, and k/v on q's device; the run is the backend's own (checked=False): these checks are its
    return _resolve("flash_attn_varlen_func", q, k, v, qs, ks, DEFAULT_PAGE_SIZE, softmax_scale, causal, window,
                    cap, sinks is not None)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, sinks=None):
    """Paged decode, FA3's signature: q ``[batch, 1, H, D]``; k_cache/v_cache ``[num_pages, page_size, KVH, D]``
    (q's dtype, or float8_e4m3fn with one-element float32 k_descale/v_descale); page_table int32
    ``[batch, max_pages]``; cache_seqlens int32 ``[batch]`` (or an int): tokens already in the cache. With k/v
    ``[batch, 1, KVH, D]`` the new token is written into the cache at position cache_seqlens (in place, as FA3
    does; strided caches too, e.g. kv[:, 0] / kv[:, 1]) and attended to; without them the query attends to the
    first cache_seqlens tokens. Returns out ``[batch, 1, H, D]``. ``causal`` and window_size's right bound have no
    effect with one query token. Not served (UnsupportedArgument when not default): qv, rotary_cos/sin/seqlens,
    cache_batch_idx, cache_leftpad, cu_seqlens_q, cu_seqlens_k_new, q_descale, attention_chunk, rotary_interleaved,
    scheduler_metadata, num_splits, pack_gqa, sm_margin, return_softmax_lse; a cache without page_table; more than one
    query or new token per sequence."""
    try:
        if (qv is not None or rotary_cos is not None or rotary_sin is not None or cache_batch_idx is not None
                or cache_leftpad is not None or cu_seqlens_q is not None or cu_seqlens_k_new is not None
                or rotary_seqlens is not None or q_descale is not None or attention_chunk != 0 or not rotary_interleaved
                or scheduler_metadata is not None or num_splits != 0 or pack_gqa is not None or sm_margin != 0
                or return_softmax_lse):
            given = dict(qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                         cache_leftpad=cache_leftpad, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
                         rotary_seqlens=rotary_seqlens, q_descale=q_descale, scheduler_metadata=scheduler_metadata)
            given = {n: x for n, x in given.items() if x is not None}
            given.update({n: x for n, x, d in (("attention_chunk", attention_chunk, 0),
                                               ("rotary_interleaved", rotary_interleaved, True),
                                               ("num_splits", num_splits, 0), ("pack_gqa", pack_gqa, None),
                                               ("sm_margin", sm_margin, 0),
                                               ("return_softmax_lse", return_softmax_lse, False)) if x != d})
            _unsupported("flash_attn_with_kvcache", given)
        func = "flash_attn_with_kvcache"
        if page_table is None:
            raise UnsupportedArgument(f"attnsel.{func}: page_table=None (a contiguous [batch, seqlen, kv_heads, head_dim] "
                                      "cache) is not served: attnsel needs a paged cache [num_pages, page_size, kv_heads, "
                                      "head_dim] and an int32 page_table [batch, max_pages]")
        if cache_seqlens is None:
            raise ValueError(f"attnsel.{func}: cache_seqlens is required (tokens already in each sequence's cache)")
        qs, ks, ts = q.shape, k_cache.shape, page_table.shape  # each read once: a shape costs ~0.2 us
        key = found = None
        if (k is None and v is None and k_descale is None and v_descale is None and len(qs) == 4 and len(ks) == 4
                and len(ts) == 2 and ts[0] == qs[0] and v_cache.shape == ks and not isinstance(cache_seqlens, (int, bool))):
            # the facts the checks below depend on, but the strides and the metadata (checked when a plan is made)
            key = (q.dtype, k_cache.dtype, v_cache.dtype, qs[1], qs[2], qs[3], ks[1], ks[2], ks[3], softmax_scale,
                   type(softmax_scale), causal, type(causal), window_size, type(window_size), softcap, type(softcap),
                   sinks is None, q.device, k_cache.device, v_cache.device)
            found = _known(key)
        if found is not None:
            if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
                _unit_stride(func, q=q, k_cache=k_cache, v_cache=v_cache)
            spec, sel, number = found
            batch, page_size, scales = qs[0], ks[1], {}
            extra = _sinks_kwargs(func, sinks, qs[2]) if sinks is not None else {}
        else:
            generation = _generation
            spec, sel, number, cache_seqlens, scales, extra = _kvcache_checked(
                q, k_cache, v_cache, k, v, cache_seqlens, page_table, qs, ks, ts, k_descale, v_descale, softmax_scale,
                causal, window_size, softcap, sinks)
            batch, page_size = qs[0], ks[1]
            if key is not None and _plain(causal, window_size, softcap):
                _remember(key, (spec, sel, number), generation)
        append = k is not None
        host = (append, ts[1])
        slot, capturing = ("decode", number), _capturing(q)
        plan = _cached_plan(slot, cache_seqlens, page_table, host, capturing)
        sel = selection_for(spec, q.device, GRAPH) if plan is None and capturing and sel.mode != GRAPH else sel
        if plan is None:  # the metadata's checks: a reused plan was made from these very tensors at these versions
            _non_tensor(func, _KVCACHE_OPTIONAL, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                        cache_seqlens=cache_seqlens, page_table=page_table, k_descale=k_descale, v_descale=v_descale,
                        sinks=sinks)  # numpy arrays have a shape and a dtype
            if page_table.dtype != torch.int32:
                raise ValueError(f"attnsel.{func}: page_table must be int32 [batch, max_pages] with batch {batch}, got "
                                 f"{page_table.dtype} {tuple(ts)}")
            if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
                raise ValueError(f"attnsel.{func}: cache_seqlens must be an int or int32 [{batch}], got "
                                 f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
            if page_table.device != q.device or cache_seqlens.device != q.device:
                raise ValueError(f"attnsel.{func}: page_table and cache_seqlens must be on q's device {q.device}, got "
                                 f"{page_table.device} and {cache_seqlens.device}")
            versions = _versions(cache_seqlens, page_table)
            plan = _store_plan(slot, cache_seqlens, page_table, versions, host, capturing,
                               _plan_decode(sel, page_table, cache_seqlens, page_size, append, capturing))
        if ks[0] == 0 and batch:  # the backends gather page 0 for rows with nothing to read
            raise ValueError(f"attnsel.{func}: k_cache/v_cache hold 0 pages ({tuple(ks)}); allowed: at least one "
                             "page (a batch of padding rows still needs a page for its page ids to point at)")
        slots, run = plan
        if append:
            check_pages = getattr(run, "check_pages", None)  # ATTNSEL_CHECK_METADATA: before the write, not after
            if check_pages is not None:
                check_pages(k_cache)
            kv_append.write(k_cache, v_cache, k, v, slots)  # in place, strided caches too
        if sinks is None and not scales:  # q stays [batch, 1, H, D]: the plan's layout is "b1hd"
            return run(q, k_cache, v_cache)
        return run(q, k_cache, v_cache, **extra, **scales)
    except AttributeError:  # a list, number or None where a tensor goes: name it, else the error stands
        _non_tensor("flash_attn_with_kvcache", _KVCACHE_OPTIONAL, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                    cache_seqlens=cache_seqlens, page_table=page_table, k_descale=k_descale, v_descale=v_descale,
                    sinks=sinks)
        raise


def _kvcache_checked(q, k_cache, v_cache, k, v, cache_seqlens, page_table, qs, ks, ts, k_descale, v_descale,
                     softmax_scale, causal, window_size, softcap, sinks) -> tuple:
    """flash_attn_with_kvcache's argument checks for a call whose facts were not seen before, or that writes new
    tokens or reads an fp8 cache (checked every call): (spec, selection, number, cache_seqlens as a tensor, the
    run's descale kwargs, its sinks kwargs); raises on the first bad argument."""
    func = "flash_attn_with_kvcache"
    _non_tensor(func, _KVCACHE_OPTIONAL, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                page_table=page_table, k_descale=k_descale, v_descale=v_descale, sinks=sinks)
    if len(qs) != 4 or qs[1] != 1:
        raise UnsupportedArgument(f"attnsel.{func}: q must be [batch, 1, heads, head_dim] (one query token per "
                                  f"sequence), got {tuple(qs)}; use flash_attn_varlen_func for more")
    if len(ks) != 4 or v_cache.shape != ks or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"attnsel.{func}: k_cache and v_cache must both be [num_pages, page_size, kv_heads, "
                         f"head_dim] of one dtype, got {tuple(ks)} {k_cache.dtype} and "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if len(ts) != 2 or ts[0] != qs[0]:  # its dtype, and cache_seqlens', are checked where a plan is made
        raise ValueError(f"attnsel.{func}: page_table must be int32 [batch, max_pages] with batch {qs[0]}, got "
                         f"{page_table.dtype} {tuple(ts)}")
    if (k is None) != (v is None):
        raise ValueError(f"attnsel.{func}: give both k and v (new tokens) or neither")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        _unit_stride(func, q=q, k_cache=k_cache, v_cache=v_cache)
    batch, page_size = qs[0], ks[1]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    scales = {}
    if k_cache.dtype != q.dtype:
        if k_cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"attnsel.{func}: the KV cache's dtype {k_cache.dtype} differs from q's {q.dtype}; "
                             "allowed: q's dtype, or torch.float8_e4m3fn with k_descale/v_descale")
        if k_descale is None or v_descale is None or k_descale.numel() != 1 or v_descale.numel() != 1:
            raise UnsupportedArgument(
                f"attnsel.{func}: a {k_cache.dtype} cache needs k_descale and v_descale of one element each "
                f"(per-tensor scales); got k_descale={_show(k_descale)}, v_descale={_show(v_descale)}")
        if k is not None:
            _unsupported(func, {"k": k, "v": v})  # quantising new tokens into an fp8 cache: write them yourself
        scales = {"k_scale": _scale_tensor(k_descale), "v_scale": _scale_tensor(v_descale)}
    elif k_cache.dtype == torch.float8_e4m3fn:  # q fp8 too
        raise ValueError(f"attnsel.{func}: q's dtype {q.dtype} is not served: q must be bfloat16, float16 or "
                         "float32 (an fp8 cache takes q in one of them with k_descale/v_descale)")
    elif k_descale is not None or v_descale is not None:
        given = ", ".join(f"{n}={_show(x)}" for n, x in (("k_descale", k_descale), ("v_descale", v_descale))
                          if x is not None)
        raise UnsupportedArgument(f"attnsel.{func}: {given}: descale factors apply only to a torch.float8_e4m3fn "
                                  f"cache; this cache is {k_cache.dtype} (leave them None)")
    if k is not None and (k.device != q.device or v.device != q.device):  # before anything is written
        raise ValueError(f"attnsel.{func}: k and v (new tokens) must be on q's device {q.device}, got {k.device} "
                         f"and {v.device}")
    if k is not None and (k.dtype != k_cache.dtype or v.dtype != k_cache.dtype):
        raise ValueError(f"attnsel.{func}: k/v ({k.dtype}/{v.dtype}) must have the cache's dtype {k_cache.dtype}")
    if k is not None and (k.shape != (batch, 1, ks[2], ks[3]) or v.shape != k.shape):
        raise UnsupportedArgument(f"attnsel.{func}: k and v must be [batch, 1, kv_heads, head_dim] = "
                                  f"[{batch}, 1, {ks[2]}, {ks[3]}] (one new token per "
                                  f"sequence), got {tuple(k.shape)} and {tuple(v.shape)}")
    extra = _sinks_kwargs(func, sinks, qs[2]) if sinks is not None else {}  # checked before the cache is written
    _, window, cap = (True, None, None) if window_size == (-1, -1) and softcap == 0.0 else spec_masks(
        func, causal, window_size, softcap, one_query=True)
    # One query token: causal or not is the same attention; the spec says causal so that one selection serves both.
    # The spec's checks, and the caches on q's device; the run is the backend's own (checked=False): these checks
    # are its.
    spec, sel, number = _resolve(func, q, k_cache, v_cache, qs, ks, page_size, softmax_scale, True, window, cap,
                                 sinks is not None)
    return spec, sel, number, cache_seqlens, scales, extra


def _plan_decode(sel: Selection, page_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int,
                 append: bool, capturing: bool) -> tuple[kv_append.Slots | None, object]:
    """(cache slots of the new tokens or None, run function) of a flash_attn_with_kvcache plan: with new tokens the
    query attends to cache_seqlens + 1 tokens, the last one written at position cache_seqlens.

    Outside capture the plan reads cache_seqlens' extremes and sum on the host once (one sync per plan, i.e. per
    step: the layers share it): the sum keys the dispatch (the batch's mean context), and a length past what the
    page table holds (or below 0) is a ValueError, not a kernel reading
    other sequences' pages or, with new tokens, a write over a cached token (the slot would be clamped to the
    table's last page). During capture nothing is read (no sync is allowed); the write stays clamped to the table."""
    capacity = page_table.shape[1] * page_size
    max_len, context = capacity, None  # during capture: the table's capacity (graph mode keys on the batch alone)
    if not capturing and cache_seqlens.numel():
        lens64 = cache_seqlens.long()
        low, high, total = torch.stack((lens64.min(), lens64.max(), lens64.sum())).tolist()
        if low < 0 or high + append > capacity:
            what = (f"page_table {tuple(page_table.shape)} holds {capacity} tokens per sequence ({page_table.shape[1]} "
                    f"pages of {page_size}), too few for {high} cached{' + 1 new' if append else ''} (the largest "
                    "cache_seqlens)" if low >= 0 else f"cache_seqlens holds a negative length {low}")
            raise ValueError(f"attnsel.flash_attn_with_kvcache: {what}; allowed: 0 <= cache_seqlens"
                             f"{' + 1' if append else ''} <= page_table.shape[1] * page_size")
        # the dispatch's context from the same read: the batch's tokens (each row's new one included), not the
        # table's width (an engine sizes its table for the longest context it serves)
        max_len, context = high + append, total + append * cache_seqlens.shape[0]
    slots = kv_append.plan_slots(page_table, cache_seqlens, page_size) if append else None
    lens = cache_seqlens + 1 if append else cache_seqlens
    # q and out in FA3's [batch, 1, H, D]: FA3 and Triton take it as it is, other backends get views
    # outside capture max_len is the exact longest row (the ragged buckets read it); during capture no context
    return slots, sel.plan_decode(page_table, lens, max_seq_len=max_len, context_tokens=context,
                                  longest=max_len if context is not None else None, q_layout="b1hd", checked=False)
