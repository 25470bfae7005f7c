"""Per-call checks of the run functions a plan returns: the tensors against the spec and the plan (host metadata
only, no sync), the plan's metadata arguments, the FlashAttention layout view and a plan's ``current()``."""
from __future__ import annotations

import logging
import numbers

import torch

from . import metadata_values
from .backends import RunFn
from .errors import InvalidArgument
from .spec import DTYPES, KV_DTYPES, AttentionSpec

log = logging.getLogger(__name__)

_NAMES = {**DTYPES, **KV_DTYPES}  # a tensor's dtype in the spec's words, in messages


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return "None" if t is None else type(t).__name__
    dt = next((n for n, d in _NAMES.items() if d == t.dtype), str(t.dtype).replace("torch.", ""))
    return f"[{', '.join(map(str, t.shape))}] {dt} on {t.device}"


def _expect(arg: str, t, shape: tuple, dtype: torch.dtype, device: int) -> ValueError:
    dims = ", ".join("*" if d is None else str(d) for d in shape)
    dt = next((n for n, d in _NAMES.items() if d == dtype), str(dtype))
    where = "cpu" if device < 0 else f"cuda:{device}"
    return ValueError(f"{arg}: expected [{dims}] {dt} on {where}, got {_describe(t)}")


def _check_features(spec: AttentionSpec, kwargs: dict, phase: str) -> None:
    """The run-time feature inputs against the spec (reached only when the spec has features or kwargs are given)."""
    unknown = set(kwargs) - {"sinks", "k_scale", "v_scale"}
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s) {', '.join(sorted(unknown))}; allowed: sinks, "
                        "k_scale, v_scale")
    sinks = kwargs.get("sinks")
    if spec.sinks and not (isinstance(sinks, torch.Tensor) and sinks.shape == (spec.num_q_heads,)
                           and sinks.dtype == torch.float32):
        raise ValueError(f"sinks: expected [{spec.num_q_heads}] fp32 (the spec has attention sinks), got "
                         f"{_describe(sinks)}")
    if not spec.sinks and sinks is not None:
        raise ValueError("sinks: given, but the spec has no attention sinks (AttentionSpec(sinks=True))")
    scaled = spec.kv_dtype is not None and phase != "prefill"  # prefill takes k/v in spec.dtype either way
    for name in ("k_scale", "v_scale"):
        scale = kwargs.get(name)
        if scaled and not (isinstance(scale, torch.Tensor) and scale.numel() == 1
                                  and scale.dtype == torch.float32):
            raise ValueError(f"{name}: expected a one-element fp32 tensor (the spec's KV cache is {spec.kv_dtype}), "
                             f"got {_describe(scale)}")
        if not scaled and scale is not None:
            why = ("prefill takes k/v in the activation dtype" if spec.kv_dtype
                   else f"the spec's KV cache is {spec.dtype}")
            raise ValueError(f"{name}: given, but {why} (no scales)")


_INDEX_DTYPES = (torch.int32,)  # as FlashAttention: an int64 copy made at plan time would not see in-place updates


def _host_int(value) -> bool:
    """An integer on the host (int, numpy integer; not bool, not a tensor: reading one would sync)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_longest(longest: int, max_seq_len: int | None, pages: int, page_size: int, rows: int,
                  context_tokens: int | None, noun: str) -> None:
    """plan_decode's and plan_extend's ``longest`` against their other host ints: within the bound on every row
    (``max_seq_len``, else the page table's reach: ``pages`` of ``page_size``), at least the mean context;
    ``noun``: what the rows are called."""
    bound = max_seq_len if max_seq_len is not None else pages * page_size
    if longest > bound:
        what = (f"max_seq_len={max_seq_len}" if max_seq_len is not None
                else f"the page table's reach {bound} ({pages} pages of {page_size})")
        raise InvalidArgument(f"longest={longest} is more than {what}, which bounds every row's context; allowed: "
                              f"longest <= {'max_seq_len' if max_seq_len is not None else bound}")
    if context_tokens is not None and rows and longest * rows < context_tokens:
        raise InvalidArgument(f"longest={longest} is less than the mean context {-(-context_tokens // rows)} "
                              f"(context_tokens={context_tokens} over {rows} {noun}); allowed: longest >= "
                              f"context_tokens / {noun} (the longest row holds at least the mean)")


def check_prefill_metadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Host-side checks of a prefill plan's arguments (shapes, dtypes, devices; never their values: no sync)."""
    for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 1 or cu.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{arg}: expected a 1-D int32 tensor of batch + 1 offsets, got {_describe(cu)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape or cu_seqlens_k.device != cu_seqlens_q.device:
        raise ValueError(f"cu_seqlens_k: expected the shape and device of cu_seqlens_q {_describe(cu_seqlens_q)}, "
                         f"got {_describe(cu_seqlens_k)}")
    for arg, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _host_int(value) or value < 0:
            raise ValueError(f"{arg}: expected a non-negative Python int (a host-side size), got {value!r}")


def check_decode_metadata(page_table, seq_lens, max_seq_len) -> None:
    """Host-side checks of a decode plan's arguments (shapes, dtypes, devices; never their values: no sync)."""
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"seq_lens: expected a 1-D int32 tensor [batch], got {_describe(seq_lens)}")
    if (not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.dtype not in _INDEX_DTYPES
            or page_table.shape[0] != seq_lens.shape[0] or page_table.device != seq_lens.device):
        raise ValueError(f"page_table: expected an int32 tensor [{seq_lens.shape[0]}, max_pages] on "
                         f"{seq_lens.device} (one row per sequence of seq_lens), got {_describe(page_table)}")
    if max_seq_len is not None and (not _host_int(max_seq_len) or max_seq_len < 0):
        raise ValueError(f"max_seq_len: expected None or a non-negative Python int, got {max_seq_len!r}")


def check_extend_metadata(cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len) -> None:
    """Host-side checks of an extend plan's arguments (shapes, dtypes, devices; never their values: no sync)."""
    check_decode_metadata(page_table, seq_lens, max_seq_len)
    batch = seq_lens.shape[0]
    if (not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in
            _INDEX_DTYPES or cu_seqlens_q.shape[0] != batch + 1 or cu_seqlens_q.device != seq_lens.device):
        raise ValueError(f"cu_seqlens_q: expected a 1-D int32 tensor of {batch + 1} offsets (batch + 1, one row per "
                         f"sequence of seq_lens) on {seq_lens.device}, got {_describe(cu_seqlens_q)}")
    if not _host_int(max_seqlen_q) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q: expected a non-negative Python int (a host-side bound on each row's "
                         f"queries), got {max_seqlen_q!r}")


def check_tensor(arg: str, t, shape: tuple, dtype: torch.dtype, device: int) -> tuple:
    """The one check of a run function's tensor, as FlashInfer's ``_check_shape_dtype_device``: its shape (``None``:
    any size on that axis), dtype, device index (-1: CPU) and a contiguous last dimension (kernels index it with
    stride 1). ValueError naming ``arg``, what was expected and what it got (a non-tensor too). Returns its shape."""
    try:
        got = t.shape
        bad = len(got) != len(shape) or t.dtype is not dtype or t.get_device() != device
        if not bad:
            for want, size in zip(shape, got):
                if want is not None and want != size:
                    bad = True
                    break
        if not bad and got[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{arg}: its last dimension must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}; pass {arg}.contiguous()")
    except (AttributeError, TypeError):  # not a tensor: None, a list, an object with a shape but no device
        bad = True
    if bad:
        raise _expect(arg, t, shape, dtype, device)
    return got


def checked_prefill(run: RunFn, spec: AttentionSpec, device: int, total_q: int | None,
                    total_k: int | None, seen: tuple[int, int] | None = None) -> RunFn:
    """run(q, k, v, **features) with the tensors checked against the spec and plan: host metadata only, no sync.
    ``device``: the plan's device index (-1: CPU). ``seen``: the last offsets a value-checked plan read
    (``ATTNSEL_CHECK_METADATA``): q and k must hold at least that many rows (rows after them are padding)."""
    hq, hk, d, dt = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.torch_dtype
    plain = not spec.sinks

    def checked(q, k, v, **kwargs):
        tq = check_tensor("q", q, (total_q, hq, d), dt, device)[0]
        tk = check_tensor("k", k, (total_k, hk, d), dt, device)[0]
        check_tensor("v", v, (tk, hk, d), dt, device)
        if seen is not None:
            for arg, rows, least in (("q", tq, seen[0]), ("k", tk, seen[1])):
                if rows < least:
                    raise ValueError(f"{arg} has {rows} tokens but cu_seqlens_{arg}[-1] is {least} "
                                     f"(${metadata_values.ENV} found this); allowed: at least cu_seqlens_{arg}"
                                     f"[-1] rows (rows after it are padding)")
        if kwargs or not plain:
            _check_features(spec, kwargs, "prefill")
        return run(q, k, v, **kwargs)

    _keep_current(checked, run)
    return checked


def checked_decode(run: RunFn, spec: AttentionSpec, device: int, batch: int, b1hd: bool = False,
                   pages_needed: int | None = None) -> RunFn:
    """run(q, k_cache, v_cache, **features) with the tensors checked against the spec and plan (no sync). With
    ``b1hd`` q must be ``[batch, 1, heads, head_dim]`` (run takes that layout, natively or through
    ``viewed_b1hd``). ``pages_needed``: from a value-checked plan (``ATTNSEL_CHECK_METADATA``), the pages the caches
    must hold."""
    hq, d, dt = spec.num_q_heads, spec.head_dim, spec.torch_dtype
    plain = not (spec.sinks or spec.kv_dtype)
    q_shape = (batch, 1, hq, d) if b1hd else (batch, hq, d)

    def checked(q, k_cache, v_cache, **kwargs):
        check_tensor("q", q, q_shape, dt, device)
        if _check_caches(spec, k_cache, v_cache, device) == 0 and batch:  # backends gather page 0 for empty rows
            raise ValueError(f"k_cache/v_cache hold 0 pages ({list(k_cache.shape)}); allowed: at least one page "
                             "(a batch of padding rows still needs a page for its page ids to point at)")
        if pages_needed is not None:
            metadata_values.check_decode_run(pages_needed, k_cache)
        if kwargs or not plain:
            _check_features(spec, kwargs, "decode")
        return run(q, k_cache, v_cache, **kwargs)

    _keep_current(checked, run)
    return checked


def _check_caches(spec: AttentionSpec, k_cache, v_cache, device: int) -> int:
    """The paged caches against the spec; returns their pages."""
    shape = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    pages = check_tensor("k_cache", k_cache, (None, *shape), spec.kv_torch_dtype, device)[0]
    check_tensor("v_cache", v_cache, (pages, *shape), spec.kv_torch_dtype, device)
    return pages


def checked_extend(run: RunFn, spec: AttentionSpec, device: int, total_q: int | None,
                   pages_needed: int | None = None) -> RunFn:
    """run(q, k_cache, v_cache, **features) of an extend plan with the tensors checked against the spec and plan (no
    sync): q ``[total_q, heads, head_dim]`` (any number of rows when ``total_q`` is None), the caches as decode's
    (``pages_needed`` too)."""
    hq, d, dt = spec.num_q_heads, spec.head_dim, spec.torch_dtype
    plain = not (spec.sinks or spec.kv_dtype)

    def checked(q, k_cache, v_cache, **kwargs):
        check_tensor("q", q, (total_q, hq, d), dt, device)
        if _check_caches(spec, k_cache, v_cache, device) == 0:
            raise ValueError(f"k_cache/v_cache hold 0 pages ({list(k_cache.shape)}); allowed: at least one page")
        if pages_needed is not None:
            metadata_values.check_decode_run(pages_needed, k_cache)
        if kwargs or not plain:
            _check_features(spec, kwargs, "extend")
        return run(q, k_cache, v_cache, **kwargs)

    _keep_current(checked, run)
    return checked


def _pages_checked(run: RunFn, pages_needed: int) -> RunFn:
    """An unchecked decode or extend run (the FA-compatible calls check the rest) that still holds the caches to the
    pages its value-checked plan reads (``ATTNSEL_CHECK_METADATA``)."""
    def check_pages(k_cache):
        metadata_values.check_decode_run(pages_needed, k_cache)

    def pages_checked(q, k_cache, v_cache, **kwargs):
        check_pages(k_cache)
        return run(q, k_cache, v_cache, **kwargs)

    _keep_current(pages_checked, run)
    pages_checked.check_pages = check_pages  # for a caller that writes into the caches before the run (new k/v)
    return pages_checked


def viewed_b1hd(run: RunFn) -> RunFn:
    """A [batch, heads, head_dim] decode run taking and returning FlashAttention's [batch, 1, heads, head_dim]."""
    def viewed(q, k_cache, v_cache, **kwargs):
        return run(q.squeeze(1), k_cache, v_cache, **kwargs).unsqueeze(1)

    _keep_current(viewed, run)
    return viewed


def _keep_current(checked: RunFn, run: RunFn) -> None:
    """Carry the backend's optional ``run.current()`` (False once a later plan replaced this one) to the wrapper."""
    current = getattr(run, "current", None)
    if current is not None:
        checked.current = current


def plan_is_current(run: RunFn) -> bool:
    """Whether a run function may still be called: False once its backend replaced the plan (a backend with one plan
    per handle; attnsel's FlashInfer backend gives every live run function its own wrapper, so its runs stay
    current). A caller that caches run functions re-plans when this is False."""
    current = getattr(run, "current", None)
    return current is None or bool(current())


def planned(phase: str, name: str, source: str, shape, plan, *args) -> RunFn:
    """``plan(*args)``, the backend's plan function; when it raises, the error goes on to the caller (the backend is
    not replaced behind its back) with a note (Python 3.11+) and a logged error naming the backend, the phase, the
    batch and what picked it (``source``: the phase's, "auto" or "explicit"): with automatic dispatch the caller
    cannot tell which backend served a batch. ``shape``: a function giving the batch's text, called on failure only
    (the plan path formats nothing)."""
    try:
        return plan(*args)
    except Exception as exc:
        how = "chosen explicitly" if source == "explicit" else "chosen automatically for this shape"
        what = (f"attnsel: {phase} backend {name!r} ({how}) failed to plan a batch of {shape()}: "
                f"{type(exc).__name__}: {exc}; it was not replaced by another backend")
        log.error("%s", what)
        if hasattr(exc, "add_note"):
            exc.add_note(what)
        raise
