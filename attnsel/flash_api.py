"""FlashAttention-3-compatible entry points: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``.

Same argument names, defaults, layouts and return values as FA3's ``flash_attn_interface`` for what attnsel serves;
any other argument given a value other than its default raises ``UnsupportedArgument`` naming it (never ignored).
Mapped onto the spec: ``causal`` / ``window_size`` -> ``causal`` / ``sliding_window`` as FA3 masks
(``flash_masks``: ``left + 1`` keys up to the diagonal; with one query per sequence every window is causal),
``softcap`` -> ``softcap``, ``sinks`` -> ``sinks``, an fp8 e4m3 paged cache with ``k_descale``/``v_descale`` (one
element each) -> ``kv_dtype="fp8_e4m3"``.

The state (options, selections, the call memo, plans) lives in a ``FlashAttention`` object, which an engine may hold
(one per model, say); the module's functions are the methods of one default instance (``default()``). The spec is
inferred from the tensors; the backend selection runs once per (spec, device) per instance (same rules and persistent
cache as ``attnsel.select``; ``$ATTNSEL_PREFILL_BACKEND`` / ``$ATTNSEL_DECODE_BACKEND`` or ``configure()`` choose
explicit backends). A call plans on the selected backend and runs; the plan is reused while
the metadata tensors (cu_seqlens, or cache_seqlens and page_table) are the same tensor objects at the same version
counter and the host sizes are equal, so the layers of one step share one plan. Checks that depend only on a
call's dtypes, head shapes, options and devices run once per combination of them (a plain decode call; calls that
write new tokens or read an fp8 cache are checked in full every time); the metadata's dtypes and shapes are checked
when a plan is made, and outside capture its values are read once per plan (offsets against q's and k's rows and
max_seqlen_q/k; lengths against the page table): a ValueError, not a kernel reading or writing past a tensor.
Rewriting metadata in a way torch does not count needs ``reset()``: numpy views, DLPack, ``.data`` (also one that
changes a dtype: the metadata's dtypes are checked when a plan is made), ``untyped_storage()`` copies, Triton
kernels and custom ops that write into them, and CUDA graph replays (a graph's writes move no version counter).
Metadata tensors made under ``torch.inference_mode()`` have no version counter: their plans are never reused (one
plan per call, logged once); allocate them outside inference mode to share a plan across layers.

CUDA graphs: the first call of a spec selects (outside capture). During capture every call plans afresh (a plan made
outside the capture would replay stale device metadata) and plans get host bounds instead of device values
(``page_table.shape[1] * page_size`` for the longest context, ``q.shape[0]`` for the tokens); the backend's plan
itself must not sync (the torch backend's does: it is a CPU fallback).
Plans made during capture are kept for the life of the process: a graph replays its plan's buffers (e.g. the Triton
decode's split buffers), so they must outlive every graph (one plan per captured call: layers x graphs). FlashInfer's
plan syncs with the host, so a FlashInfer selection cannot be captured here.

Decode plans take q in FA3's ``[batch, 1, H, D]`` (``Selection.plan_decode(q_layout="b1hd")``): FA3 and Triton runs
take that layout as it comes; other backends get q viewed as ``[batch, H, D]`` and out viewed back (two views, a few
microseconds of host time). Calls with more than one query or new token per sequence, varlen queries over the cache
and the paged varlen form go to ``flash_extend`` (``Selection.plan_extend``).
"""
from __future__ import annotations

import functools
import itertools
import logging
import math

import torch

from . import kv_append
from .flash_extend import ExtendCalls
from .backends.support import capturing as _capturing  # module attribute: the timing script stubs it
from .flash_checks import (
    KVCACHE_OPTIONAL,
    host_int,
    kvcache_inputs,
    non_tensor,
    plain,
    scale_error,
    scale_value,
    sinks_kwargs,
    speed_hints,
    unit_stride,
    unsupported,
    varlen_masks,
    varlen_offsets,
)
from .flash_masks import UnsupportedArgument
from .graph_selection import GRAPH, check_may_select
from .selection import Selection, announce, backend_settings, select
from .settings import Settings
from .spec import AttentionSpec, SpecError, dtype_name

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16  # page_size of the spec used for varlen calls (they have no pages)


class FlashAttention:
    """``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` with their state: the selection options, the
    selections per (spec, device), the call memo and the plans (module docstring). ``prefill``/``decode``/
    ``select_options``: as ``configure``."""

    def __init__(self, prefill: str | None = None, decode: str | None = None, **select_options):
        self._options: dict = {}
        self._selections: dict = {}
        # the facts a spec is made from (_resolve) -> (spec, selection, number naming it in _plans. slots)
        self._specs: dict = {}
        # A call's raw facts (dtypes, shapes but the token/batch counts, options as given with softmax_scale's type:
        # True and 1.0 hash alike; only plain Python options: a tensor given as causal, softcap or a window bound
        # hashes by identity and could change in place, such calls are checked in full every time; devices) -> the
        # (spec, selection, number) its checks gave: a call whose facts were seen before skips the checks that depend
        # on them only. The metadata's dtypes and shapes are checked when a plan is made (a reused plan was made from
        # those very tensors).
        self._calls: dict = {}
        self._generation = 0  # reset() counts up: a check that straddles a reset does not store into the memo
        self._plans: dict = {}
        self._numbers = itertools.count()  # never restarts (a reset racing a call cannot reuse a number)
        self._no_versions_logged = False
        self._captured: list = []  # plans made during CUDA-graph capture: kept for good (configure() keeps them)
        self._extend = ExtendCalls(self, lambda t: _capturing(t))  # ragged queries over the paged cache
        self.configure(prefill, decode, **select_options)

    @property
    def options(self) -> dict:
        """The selection options in force (a copy)."""
        return dict(self._options)

    def configure(self, prefill: str | None = None, decode: str | None = None, **select_options) -> None:
        """Options of the selection these functions run (``attnsel.select``'s: policy, mode, priorities, timeout,
        cache_dir, use_cache, extend: "auto" or a backend name for flash_extend's calls); prefill/decode: "auto" or a
        backend name (default: the environment, else auto).
        Forgets earlier selections and plans."""
        self._options.clear()
        self._options.update(select_options)
        self._options.update({k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None})
        self.reset()

    def reset(self) -> None:
        """Forget selections and plans (the persistent result cache stays)."""
        self._generation += 1
        self._selections.clear()
        self._specs.clear()
        self._calls.clear()
        self._plans.clear()
        self._extend.clear()

    def selection_for(self, spec: AttentionSpec, device: torch.device | str, mode: str | None = None) -> Selection:
        """The Selection for a spec on a device (mode None: the configured one; "graph": see graph_selection), made
        on first use and kept for the process."""
        key = (spec, device, mode)
        sel = self._selections.get(key)
        if sel is None:
            env = Settings.from_env()
            opts = {**backend_settings(env, self._options),
                    **self._options,
                    **({"mode": mode} if mode else {})}
            if not spec.causal:  # only varlen calls make non-causal specs; extend calls resolve causal specs
                opts["extend"] = "auto"  # a backend named for extend serves those, not these (none can: causal only)
            check_may_select(spec, mode)
            announce(spec, device, opts.get("cache_dir"))
            sel = select(spec, opts.pop("prefill"), opts.pop("decode"), extend=opts.pop("extend"), device=str(device),
                         **opts)
            log.info("attnsel for %s on %s (%s): prefill: %s, decode: %s, extend: %s", spec.describe(), device,
                     sel.mode, sel.prefill, sel.decode, sel.extend)
            self._selections[key] = sel
        return sel  # keyed by the device object as given (str or torch.device): no str() per call

    def _resolve(self, func: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qs: torch.Size, ks: torch.Size,
                 page_size: int, softmax_scale, causal: bool, window: int | None, softcap: float | None, sinks: bool
                 ) -> tuple[AttentionSpec, Selection, int]:
        """The AttentionSpec of the call, its Selection and an int naming it in the plan cache (unique for the process),
        memoised on the cheap facts they are made from (hashing a spec per call would cost a microsecond). qs, ks: q's
        and k's shapes (read once per call). k and v (or the caches) must be on q's device: checked when a key is new
        (the devices are part of it)."""
        softmax_scale = scale_value(softmax_scale)
        kv_dtype = k.dtype
        key = (q.dtype, kv_dtype, qs[-2], ks[-2], qs[-1], ks[-1], page_size, softmax_scale, causal, window, softcap,
               sinks, q.device, k.device, v.device)
        found = self._specs.get(key)
        if found is None:
            head_dim = qs[-1]
            kn, vn = ("k", "v") if func == "flash_attn_varlen_func" else ("k_cache", "v_cache")  # the caller's names
            if key[-2] != key[-3] or key[-1] != key[-3]:
                raise ValueError(f"attnsel.{func}: q, {kn} and {vn} must be on one device, got q on {q.device}, "
                                 f"{kn} on {k.device}, {vn} on {v.device}")
            scale = None
            if softmax_scale is not None and (not math.isfinite(softmax_scale) or softmax_scale <= 0):
                raise scale_error(softmax_scale)
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
            found = self._specs.setdefault(key, (spec, self.selection_for(spec, q.device), next(self._numbers)))
        return found

    def _known(self, key: tuple):
        """The (spec, selection, number) remembered for a call's facts, or None (also for facts that cannot be hashed,
        e.g. a list as window_size: such calls take the checked path every time)."""
        try:
            return self._calls.get(key)
        except TypeError:
            return None

    def _remember(self, key: tuple, found: tuple, generation: int) -> None:
        """Keep found for key unless reset() ran since the checks that gave it began (generation: the count then); a
        selection forgotten by configure() must not come back through the memo. reset() counts up before it clears: a
        store before the count is cleared by it, one after is taken back here."""
        if generation != self._generation:
            return
        try:
            if len(self._calls) >= 4096:  # bounded: facts such as a fresh float softmax_scale per call must not grow it
                self._calls.clear()
            self._calls[key] = found
        except TypeError:
            return
        if generation != self._generation:
            self._calls.pop(key, None)

    def _versions(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
        """The version counters of the metadata tensors; None for tensors made under torch.inference_mode(), which have
        none: a change to them cannot be seen, so their plans are never reused (logged once)."""
        try:
            return a._version, b._version
        except RuntimeError:
            if not self._no_versions_logged:
                self._no_versions_logged = True
                log.warning("attnsel: metadata tensors made under torch.inference_mode() have no version counter, "
                            "so attnsel cannot tell whether they changed and plans every call; allocate cu_seqlens / "
                            "cache_seqlens / page_table outside inference mode (or use torch.no_grad()) to share one "
                            "plan across the layers of a step")
            return None

    def _cached_plan(self, slot: tuple, a: torch.Tensor, b: torch.Tensor, host: tuple, capturing: bool):
        """The plan stored for ``slot`` (phase, spec number) if it was made outside capture from these very metadata
        tensors a, b at their current versions and these host values, and is still current (a plan made since by anyone
        on the same backend state, e.g. a plugin with one plan per wrapper, makes it stale); else None.
        An entry is (a, b, a's version, b's version, host, the run's ``current`` check or None, plan); the versions are
        None for a plan made during capture or from tensors without version counters: never reused."""
        e = self._plans.get(slot)
        if (e is not None and e[0] is a and e[1] is b and e[2] is not None and not capturing and e[2] == a._version
                and e[3] == b._version and e[4] == host and (e[5] is None or e[5]())):
            return e[6]
        return None

    def _store_plan(self, slot: tuple, a: torch.Tensor, b: torch.Tensor, versions: tuple[int, int] | None,
                    host: tuple, capturing: bool, plan):
        """Keep a new plan for ``slot`` with the metadata's versions read before planning (holding the tensors keeps
        their ids unique) and return it."""
        va, vb = (None, None) if capturing or versions is None else versions
        run = plan[1] if isinstance(plan, tuple) else plan
        current = getattr(run, "current", None)
        self._plans[slot] = (a, b, va, vb, host, (lambda: bool(current())) if current is not None else None, plan)
        if capturing:  # a CUDA graph replays this plan's buffers: keep the plan as long as the process (and graphs)
            self._captured.append(plan)
        return plan

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None,
                               q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                               softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False, sinks=None, page_table=None):
        """Ragged attention, FA3's signature: q ``[total_q, H, D]``, k/v ``[total_k, KVH, D]`` (bf16/fp16/fp32),
        cu_seqlens_q/k int32 ``[batch + 1]`` on q's device, max_seqlen_q/k host ints (upper bounds are fine).
        Causal masking is bottom-right aligned (sequences with fewer queries than keys). Returns out
        ``[total_q, H, D]``. Not served (UnsupportedArgument when not default): seqused_q/k, qv, q/k/v_descale,
        attention_chunk, deterministic, sm_margin, return_attn_probs. num_splits and pack_gqa are speed hints: checked,
        ignored (flash_checks.speed_hints). With ``page_table``
        (FA3's paged varlen form) k/v are paged caches and ``seqused_k`` their lengths: ``flash_extend``."""
        if page_table is not None:
            return self._extend.varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             seqused_q, seqused_k, softmax_scale, causal, qv, q_descale, k_descale,
                                             v_descale, window_size, attention_chunk, softcap, num_splits, pack_gqa,
                                             deterministic, sm_margin, return_attn_probs, sinks, page_table)
        try:
            if type(num_splits) is not int or pack_gqa is not None:  # FA3's speed hints: checked, ignored
                speed_hints("flash_attn_varlen_func", num_splits, pack_gqa)
            if (seqused_q is not None or seqused_k is not None or qv is not None or q_descale is not None
                    or k_descale is not None or v_descale is not None or attention_chunk != 0
                    or deterministic or sm_margin != 0 or return_attn_probs):
                given = dict(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale, k_descale=k_descale,
                             v_descale=v_descale)
                given = {n: x for n, x in given.items() if x is not None}
                given.update({n: x for n, x, d in (("attention_chunk", attention_chunk, 0),
                                                   ("deterministic", deterministic, False), ("sm_margin", sm_margin, 0),
                                                   ("return_attn_probs", return_attn_probs, False)) if x != d})
                unsupported("flash_attn_varlen_func", given)
            qs, ks = q.shape, k.shape
            key = found = None
            if len(qs) == 3 and len(ks) == 3 and v.shape == ks:  # the facts the checks below depend on, but the strides
                key = (q.dtype, k.dtype, v.dtype, qs[1], qs[2], ks[1], ks[2], softmax_scale, type(softmax_scale),
                       causal, type(causal), window_size, type(window_size), softcap, type(softcap), sinks is None,
                       q.device, k.device, v.device)
                found = self._known(key)
            if found is not None:
                if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
                    unit_stride("flash_attn_varlen_func", q=q, k=k, v=v)
                spec, sel, number = found
            else:
                generation = self._generation
                spec, sel, number = self._resolve(
                    "flash_attn_varlen_func", q, k, v, qs, ks, DEFAULT_PAGE_SIZE, softmax_scale,
                    *varlen_masks(q, k, v, cu_seqlens_q, cu_seqlens_k, qs, ks, causal, window_size, softcap, sinks),
                    sinks is not None)
                if key is not None and plain(causal, window_size, softcap):
                    self._remember(key, (spec, sel, number), generation)
            host = (max_seqlen_q if type(max_seqlen_q) is int else host_int("max_seqlen_q", max_seqlen_q),
                    max_seqlen_k if type(max_seqlen_k) is int else host_int("max_seqlen_k", max_seqlen_k), qs[0], ks[0])
            slot, capturing = ("prefill", number), _capturing(q)
            run = self._cached_plan(slot, cu_seqlens_q, cu_seqlens_k, host, capturing)
            sel = self.selection_for(spec, q.device, GRAPH) if run is None and capturing and sel.mode != GRAPH else sel
            if run is None:  # the metadata's checks: a reused plan was made from these very tensors at these versions
                non_tensor("flash_attn_varlen_func", ("sinks",), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, sinks=sinks)  # numpy arrays have a shape and a dtype
                if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
                    raise ValueError(f"attnsel.flash_attn_varlen_func: cu_seqlens_q/cu_seqlens_k must be int32, got "
                                     f"{cu_seqlens_q.dtype}/{cu_seqlens_k.dtype}")
                if cu_seqlens_q.device != q.device or cu_seqlens_k.device != q.device:
                    raise ValueError(f"attnsel.flash_attn_varlen_func: cu_seqlens_q/cu_seqlens_k must be on q's device "
                                     f"{q.device}, got {cu_seqlens_q.device}/{cu_seqlens_k.device}")
                versions = self._versions(cu_seqlens_q, cu_seqlens_k)
                if not capturing:  # one host read per plan: the offsets every kernel trusts
                    varlen_offsets(cu_seqlens_q, cu_seqlens_k, *host)
                run = self._store_plan(slot, cu_seqlens_q, cu_seqlens_k, versions, host, capturing,
                                       sel.plan_prefill(cu_seqlens_q, cu_seqlens_k, host[0], host[1], total_q=host[2],
                                                        total_k=host[3], checked=False))
            if sinks is None:
                return run(q, k, v)
            return run(q, k, v, **sinks_kwargs("flash_attn_varlen_func", sinks, qs[1]))
        except AttributeError:  # a list, number or None where a tensor goes: name it, else the error stands
            non_tensor("flash_attn_varlen_func", ("sinks",), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, sinks=sinks)
            raise

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
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
        effect with one query token. More than one query or new token per sequence, and the varlen form
        (cu_seqlens_q, cu_seqlens_k_new): ``flash_extend``. Not served (UnsupportedArgument when not default): qv,
        rotary_cos/sin/seqlens, cache_batch_idx, cache_leftpad, q_descale, attention_chunk, rotary_interleaved,
        sm_margin, return_softmax_lse; a cache without page_table. scheduler_metadata, num_splits and pack_gqa are
        speed hints: checked, ignored (flash_checks.speed_hints)."""
        try:
            if (type(num_splits) is not int or pack_gqa is not None
                    or scheduler_metadata is not None):  # FA3's speed hints: checked, ignored (host time per call)
                speed_hints("flash_attn_with_kvcache", num_splits, pack_gqa, scheduler_metadata)
            if (qv is not None or rotary_cos is not None or rotary_sin is not None or cache_batch_idx is not None
                    or cache_leftpad is not None or rotary_seqlens is not None or q_descale is not None
                    or attention_chunk != 0 or not rotary_interleaved or sm_margin != 0 or return_softmax_lse):
                given = dict(qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                             cache_leftpad=cache_leftpad, rotary_seqlens=rotary_seqlens, q_descale=q_descale)
                given = {n: x for n, x in given.items() if x is not None}
                given.update({n: x for n, x, d in (("attention_chunk", attention_chunk, 0),
                                                   ("rotary_interleaved", rotary_interleaved, True),
                                                   ("sm_margin", sm_margin, 0),
                                                   ("return_softmax_lse", return_softmax_lse, False)) if x != d})
                unsupported("flash_attn_with_kvcache", given)
            func = "flash_attn_with_kvcache"
            if page_table is None:
                raise UnsupportedArgument(f"attnsel.{func}: page_table=None (a contiguous [batch, seqlen, kv_heads, "
                                          "head_dim] cache) is not served: attnsel needs a paged cache [num_pages, "
                                          "page_size, kv_heads, head_dim] and an int32 page_table [batch, max_pages]")
            if cache_seqlens is None:
                raise ValueError(f"attnsel.{func}: cache_seqlens is required (tokens already in each sequence's cache)")
            qs, ks, ts = q.shape, k_cache.shape, page_table.shape  # each read once: a shape costs ~0.2 us
            if (cu_seqlens_q is not None or len(qs) != 4 or qs[1] != 1
                    or k is not None and (cu_seqlens_k_new is not None or k.dim() != 4 or k.shape[1] != 1)):
                return self._extend.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q,
                                                 cu_seqlens_k_new, max_seqlen_q, k_descale, v_descale,
                                                 softmax_scale, causal, window_size, softcap, sinks)
            key = found = None
            if (k is None and v is None and k_descale is None and v_descale is None and len(qs) == 4 and len(ks) == 4
                    and len(ts) == 2 and ts[0] == qs[0] and v_cache.shape == ks
                    and not isinstance(cache_seqlens, (int, bool))):
                # the facts the checks below depend on, but the strides and the metadata (checked when a plan is made)
                key = (q.dtype, k_cache.dtype, v_cache.dtype, qs[1], qs[2], qs[3], ks[1], ks[2], ks[3], softmax_scale,
                       type(softmax_scale), causal, type(causal), window_size, type(window_size), softcap,
                       type(softcap), sinks is None, q.device, k_cache.device, v_cache.device)
                found = self._known(key)
            if found is not None:
                if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
                    unit_stride(func, q=q, k_cache=k_cache, v_cache=v_cache)
                spec, sel, number = found
                batch, page_size, scales = qs[0], ks[1], {}
                extra = sinks_kwargs(func, sinks, qs[2]) if sinks is not None else {}
            else:
                generation = self._generation
                cache_seqlens, scales, extra, window, cap = kvcache_inputs(
                    q, k_cache, v_cache, k, v, cache_seqlens, page_table, qs, ks, ts, k_descale, v_descale, causal,
                    window_size, softcap, sinks)
                batch, page_size = qs[0], ks[1]
                # One query token: causal or not is the same attention; the spec says causal so that one selection
                # serves both. The spec's checks, and the caches on q's device; the run is the backend's own
                # (checked=False): these checks are its.
                spec, sel, number = self._resolve(func, q, k_cache, v_cache, qs, ks, page_size, softmax_scale, True,
                                                  window, cap, sinks is not None)
                if key is not None and plain(causal, window_size, softcap):
                    self._remember(key, (spec, sel, number), generation)
            append = k is not None
            host = (append, ts[1])
            slot, capturing = ("decode", number), _capturing(q)
            plan = self._cached_plan(slot, cache_seqlens, page_table, host, capturing)
            sel = self.selection_for(spec, q.device, GRAPH) if plan is None and capturing and sel.mode != GRAPH else sel
            if plan is None:  # the metadata's checks: a reused plan was made from these very tensors at these versions
                non_tensor(func, KVCACHE_OPTIONAL, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                           cache_seqlens=cache_seqlens, page_table=page_table, k_descale=k_descale,
                           v_descale=v_descale, sinks=sinks)  # numpy arrays have a shape and a dtype
                if page_table.dtype != torch.int32:
                    raise ValueError(f"attnsel.{func}: page_table must be int32 [batch, max_pages] with batch "
                                     f"{batch}, got {page_table.dtype} {tuple(ts)}")
                if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
                    raise ValueError(f"attnsel.{func}: cache_seqlens must be an int or int32 [{batch}], got "
                                     f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
                if page_table.device != q.device or cache_seqlens.device != q.device:
                    raise ValueError(f"attnsel.{func}: page_table and cache_seqlens must be on q's device "
                                     f"{q.device}, got {page_table.device} and {cache_seqlens.device}")
                versions = self._versions(cache_seqlens, page_table)
                plan = self._store_plan(slot, cache_seqlens, page_table, versions, host, capturing,
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
            non_tensor("flash_attn_with_kvcache", KVCACHE_OPTIONAL, q=q, k_cache=k_cache, v_cache=v_cache, k=k,
                       v=v, cache_seqlens=cache_seqlens, page_table=page_table, k_descale=k_descale,
                       v_descale=v_descale, sinks=sinks)
            raise


@functools.cache
def default() -> FlashAttention:
    """The instance the module's functions belong to (the only module-level state)."""
    return FlashAttention()


def configure(prefill: str | None = None, decode: str | None = None, **select_options) -> None:
    """``default().configure``: the options of the selection the module's functions run."""
    default().configure(prefill, decode, **select_options)


def reset() -> None:
    """``default().reset``: forget selections and plans (the persistent result cache stays)."""
    default().reset()


def selection_for(spec: AttentionSpec, device: torch.device | str, mode: str | None = None) -> Selection:
    """``default().selection_for``: the Selection the module's functions use for a spec on a device."""
    return default().selection_for(spec, device, mode)


# The FA-compatible functions are the default instance's own methods: a function delegating to them would add a frame
# and a repacking of some 25 arguments to every call (about a microsecond, on calls of a few).
flash_attn_varlen_func = default().flash_attn_varlen_func
flash_attn_with_kvcache = default().flash_attn_with_kvcache


def _plan_decode(sel: Selection, page_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int,
                 append: bool, capturing: bool) -> tuple[kv_append.Slots | None, object]:
    """(cache slots of the new tokens or None, run function) of a flash_attn_with_kvcache plan: with new tokens the
    query attends to cache_seqlens + 1 tokens, the last one written at position cache_seqlens.

    Outside capture the plan reads cache_seqlens' extremes and sum on the host once (one sync per plan, i.e. per
    step: the layers share it): the sum keys the dispatch (the batch's mean context), and a length past what the
    page table holds (or below 0) is a ValueError, not a kernel reading
    other sequences' pages or, with new tokens, a write over a cached token (the slot would be clamped to the
    table's last page); so are the new tokens' page ids (kv_append.write refuses one outside the caches). During
    capture nothing is read (no sync is allowed); the write stays clamped to the table."""
    capacity = page_table.shape[1] * page_size
    max_len, context = capacity, None  # during capture: the table's capacity (graph mode keys on the batch alone)
    slots = kv_append.plan_slots(page_table, cache_seqlens, page_size) if append else None
    if not capturing and cache_seqlens.numel():
        lens64 = cache_seqlens.long()
        low, high, total, *pages = torch.stack((lens64.min(), lens64.max(), lens64.sum(),
                                                *(kv_append.page_extremes(slots) if append else ()))).tolist()
        if low < 0 or high + append > capacity:
            what = (f"page_table {tuple(page_table.shape)} holds {capacity} tokens per sequence ({page_table.shape[1]} "
                    f"pages of {page_size}), too few for {high} cached{' + 1 new' if append else ''} (the largest "
                    "cache_seqlens)" if low >= 0 else f"cache_seqlens holds a negative length {low}")
            raise ValueError(f"attnsel.flash_attn_with_kvcache: {what}; allowed: 0 <= cache_seqlens"
                             f"{' + 1' if append else ''} <= page_table.shape[1] * page_size")
        # the dispatch's context from the same read: the batch's tokens (each row's new one included), not the
        # table's width (an engine sizes its table for the longest context it serves)
        max_len, context = high + append, total + append * cache_seqlens.shape[0]
        slots = slots._replace(pages=tuple(pages)) if append else slots
    lens = cache_seqlens + 1 if append else cache_seqlens
    # q and out in FA3's [batch, 1, H, D]: FA3 and Triton take it as it is, other backends get views
    # outside capture max_len is the exact longest row (the ragged buckets read it); during capture no context
    return slots, sel.plan_decode(page_table, lens, max_seq_len=max_len, context_tokens=context,
                                  longest=max_len if context is not None else None, q_layout="b1hd", checked=False)
