"""Hugging Face transformers integration: attention implementations ``"attnsel"`` and ``"paged|attnsel"``.

``register()`` once, before loading the model, then ``from_pretrained(..., attn_implementation="attnsel")`` for
``generate`` or ``"paged|attnsel"`` for continuous batching (``generate_batch``, transformers 5.17).

Serve exactly what the model asks, or hand the call back to transformers. Every attention call is inspected: its
tensors (query/key/value heads, head dims, dtype) and its keyword arguments (sliding_window, softcap, s_aux sinks,
scaling, is_causal, dropout, ...) give the call's ``AttentionSpec``; the selection runs once per distinct spec and
device (same options, environment and cache as the CLI; logged as ``prefill: X, decode: Y``). A call attnsel cannot
serve (an argument it does not implement, a mask pattern it does not serve, value head dim != query head dim, a spec
no backend supports) runs transformers' own implementation: the model's ``eager_attention_forward`` when the call
carries a feature plain SDPA ignores (sinks, softcap, anything unknown), else transformers' ``sdpa_attention_forward``,
with the 4D mask transformers' own mask builders make. Each reason is logged once and counted (``fallbacks()``);
the calls served are counted by spec (``served()``). Arguments that cannot change the attention (positions, output
flags, and generate's own objects such as the tokenizer it forwards to every call) are no reason to hand back
(``hf_calls`` says which and why).

Dense path: the registered mask function returns a 2D key mask ``[B, n]`` (padding; columns past n are empty static
cache slots; the queries are the last ``Sq`` of the n columns), unpadded into a ragged batch for prefill; one-token
steps go through the paged decode API (the dense cache rows are gathered into pages, left-aligned). Paged path
(transformers 5.17): steps of full-attention layers with a cached prefix write the new tokens into transformers' own
cache tensors and read them in place through a page table derived from its read index: decode-only steps through the
paged decode API, the others (chunked prefill, prefix sharing, decodes mixed with prefills) through the extend API
(``hf_extend``). Steps without a cached prefix (fresh prompts) and sliding layers go through the ragged prefill API
on the keys ``cache.update`` returns.

The state (options, selections, call counts, per-step plans) lives in an ``HFAttention`` object; the functions
registered with transformers delegate to one default instance, made on first use, which ``register()`` configures.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math

import torch
import torch.nn.functional as F

from .. import AttentionSpec, Selection, SelectionError, SpecError, select
from ..run_checks import plan_is_current
from ..settings import Settings
from ..graph_selection import check_may_select
from ..selection import announce, backend_settings
from ..spec import DTYPES, dtype_name
from . import hf_fallback
from .hf_extend import PrefixReads, paged_extend, paged_page_table
from .hf_calls import PAGED, CallCounts, is_causal, run_inputs, short, unimplemented
from .hf_fallback import NAME, key_mask

log = logging.getLogger(__name__)

PAGED_NAME = "paged|attnsel"
PAGED_VERSIONS = ("5.17",)  # custom paged implementations are accepted (5.19 refuses them; 5.18 changed the cache)
DENSE_PAGE_SIZE = 16


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


class HFAttention:
    """The state of attnsel's transformers attention functions: the selection options, the selections per (spec,
    device), the calls served and handed back (hf_calls), select_for_model's page size during its warm-up, the
    plans of the current step per path, the cached-prefix steps gathered anyway (hf_extend). ``configure`` is
    ``register``'s reset."""

    def __init__(self) -> None:
        self.options: dict = {}
        self.selections: dict = {}
        self.counts = CallCounts()
        self.generation = 0  # counts configure(): a module's memo of its calls' selections is keyed by it
        self.page_size_override: int | None = None
        self.dense_steps = _StepPlans()
        self.paged_steps = _StepPlans()
        self.prefix = PrefixReads()

    def configure(self, prefill: str | None = None, decode: str | None = None, **select_options) -> None:
        """New selection options (prefill/decode: "auto" or a backend name; None: the environment's, else auto):
        earlier selections and counts are forgotten."""
        self.options = {**select_options, **{k: v for k, v in (("prefill", prefill), ("decode", decode))
                                             if v is not None}}
        self.selections.clear()
        self.counts.clear()
        self.prefix.clear()
        self.generation += 1

    def selection_for(self, spec: AttentionSpec, device: torch.device, mode: str | None = None) -> Selection:
        """The Selection for a spec on a device, made once (the persistent cache makes later starts fast); mode
        "graph": the one a call made during CUDA-graph capture plans on (graph_selection)."""
        key = (spec, str(device)) if mode is None else (spec, str(device), mode)
        if key not in self.selections:
            env = Settings.from_env()
            opts = {**backend_settings(env, self.options),
                    **self.options,
                    **({"mode": mode} if mode else {})}
            check_may_select(spec, mode)
            announce(spec, device, opts.get("cache_dir"))
            sel = select(spec, opts.pop("prefill"), opts.pop("decode"), extend=opts.pop("extend"), device=str(device),
                         **opts)
            log.info("attnsel for %s on %s: %s", spec.describe(), device, sel.backends_line())
            self.selections[key] = sel
        return self.selections[key]

    def call_spec(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling, dropout: float,
                  kwargs: dict, page_size: int, plumbing: frozenset = frozenset()) -> tuple[Selection | None, str]:
        """(selection, "") when attnsel serves this call exactly, else (None, the reason). Remembered per module and
        call signature, so the hot path is a dict lookup after the first call of each kind."""
        name = unimplemented(kwargs, plumbing)
        if name is not None:
            return None, f"argument {name}={short(kwargs[name])} (not implemented by attnsel)"
        if kwargs.get("output_attentions"):
            return None, "output_attentions=True (attention weights)"
        if not is_causal(module, kwargs):
            return None, "non-causal attention"
        if dropout and module.training:
            return None, f"attention dropout {dropout} in training"
        window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
        for name, val in (("sliding_window", window), ("softcap", softcap)):
            if isinstance(val, bool) or (val is not None and not isinstance(val, (int, float))):
                return None, f"{name}={short(val)} (expected a number or None)"
        sig = (query.dtype, key.dtype, value.dtype, query.device, query.shape[1], key.shape[1], value.shape[1],
               query.shape[-1], key.shape[-1], value.shape[-1], scaling, window, softcap,
               None if sinks is None else (type(sinks), tuple(getattr(sinks, "shape", ()))), page_size,
               id(self), self.generation)
        memo = module.__dict__.setdefault("_attnsel_memo", {})
        if sig not in memo:
            memo[sig] = self._select_for_call(sig)
        reason, sel = memo[sig]
        return sel, reason

    def _select_for_call(self, sig: tuple) -> tuple[str, Selection | None]:
        """(reason, None) or ("", the Selection) for a call signature of ``call_spec``."""
        qdt, kdt, vdt, device, hq, hk, hv, dq, dk, dv, scaling, window, softcap, sinks, page_size, _, _ = sig
        if dk != dq or dv != dq:
            return f"head dims differ: query {dq}, key {dk}, value {dv} (no attnsel backend serves that)", None
        if kdt != qdt or vdt != qdt:
            return f"key/value dtype {kdt}/{vdt} differs from the query's {qdt}", None
        if qdt not in DTYPES.values():
            return f"dtype {qdt} (attnsel serves {', '.join(map(str, DTYPES.values()))})", None
        if hv != hk:
            return f"key has {hk} heads but value {hv}", None
        if sinks is not None and (not issubclass(sinks[0], torch.Tensor) or sinks[1] != (hq,)):
            return f"s_aux of type {sinks[0].__name__} and shape {sinks[1]} (expected a tensor [{hq}])", None
        scale = None if scaling is None or math.isclose(scaling, dq ** -0.5, rel_tol=1e-6) else float(scaling)
        try:
            spec = AttentionSpec(num_q_heads=hq, num_kv_heads=hk, head_dim=dq, dtype=dtype_name(qdt),
                                 page_size=page_size, softmax_scale=scale, sliding_window=window, softcap=softcap,
                                 sinks=sinks is not None)
        except SpecError as exc:
            return f"the call's attention is not a valid spec: {exc}", None
        try:
            return "", self.selection_for(spec, device)
        except SelectionError as exc:
            return f"no attnsel backend serves {spec.describe()}: {exc}", None

    def dense_fallback(self, module, query, key, value, attention_mask, scaling, dropout, kwargs, window, reason):
        """The call handed back to transformers (hf_fallback.dense), counted with its reason."""
        self.counts.fall_back(reason)
        return hf_fallback.dense(module, query, key, value, attention_mask, scaling, dropout, kwargs, window)

    def attention_forward(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """transformers attention function: query ``[B, H, Sq, D]``, key/value ``[B, KVH, Skv, D]``; out
        ``[B, Sq, H, D]``."""
        batch, _, len_q, _ = query.shape
        len_kv = key.shape[2]
        window = kwargs.get("sliding_window")
        mask_window = getattr(attention_mask, "_attnsel_window", window)
        if attention_mask is not None and attention_mask.dim() == 4:
            return self.dense_fallback(module, query, key, value, attention_mask, scaling, dropout, kwargs, window,
                                       "a 4D attention mask (a custom mask, or a mask pattern attnsel does not serve: "
                                       "chunked, packed sequences, bidirectional, overlays)")
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != batch
                                           or not len_q <= attention_mask.shape[1] <= len_kv):
            raise ValueError(f"{NAME}: attention mask of shape {list(attention_mask.shape)} for a batch of {batch}, "
                             f"{len_q} queries and {len_kv} keys; expected [{batch}, n] with {len_q} <= n <= {len_kv}")
        if mask_window != window:
            return self.dense_fallback(module, query, key, value, attention_mask, scaling, dropout, kwargs, mask_window,
                                       f"the mask's sliding window ({mask_window}) differs from the layer's ({window})")
        page_size = self.page_size_override or DENSE_PAGE_SIZE
        sel, why = self.call_spec(module, query, key, value, scaling, dropout, kwargs, page_size)
        if sel is None:
            return self.dense_fallback(module, query, key, value, attention_mask, scaling, dropout, kwargs, window, why)
        plan = self.dense_steps.get(getattr(module, "layer_idx", None),
                                    (id(attention_mask), batch, len_q, len_kv, id(sel)),
                                    lambda: _plan_dense(sel, attention_mask, batch, len_q, len_kv, query.device),
                                    query.device)
        if plan.why:
            return self.dense_fallback(module, query, key, value, attention_mask, scaling, dropout, kwargs, window,
                                       plan.why)
        self.counts.serve(sel.spec)
        features = run_inputs(kwargs)
        k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, Skv, KVH, D] views
        if plan.decode:
            rows, pos = plan.k_index
            kvh, d = k.shape[2:]
            k_pages = k[rows, pos].view(-1, sel.spec.page_size, kvh, d)
            v_pages = v[rows, pos].view(-1, sel.spec.page_size, kvh, d)
            out = plan.run(query[:, :, 0].contiguous(), k_pages, v_pages, **features)
            return out[:, None], None
        q_rows, q_pos = plan.q_index
        k_rows, k_pos = plan.k_index
        packed = plan.run(query.transpose(1, 2)[q_rows, q_pos], k[k_rows, k_pos], v[k_rows, k_pos], **features)
        out = query.new_zeros(batch, len_q, query.shape[1], query.shape[3])
        out[q_rows, q_pos] = packed
        return out, None

    def paged_attention_forward(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                                max_seqlen_q=None, max_seqlen_k=None, read_index=None, write_index=None,
                                scaling: float | None = None, dropout: float = 0.0,
                                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Continuous-batching attention: query ``[1, H, T, D]`` packed, key/value the new tokens; out
        ``[1, T, H, D]``."""
        if cache is None:
            raise ValueError(f"{PAGED_NAME} was called without a paged attention cache: load the model with "
                             f"attn_implementation='{NAME}' for plain forward/generate calls")
        if kwargs.get("block_table") is not None:
            raise ValueError(f"{PAGED_NAME} got a block_table (transformers' flash decode fast path); attnsel reads "
                             "the cache through read_index/write_index: turn the fast path off "
                             "(max_blocks_per_request=0)")
        cache_window = cache.sliding_windows[module.layer_idx]  # 1: a full-attention layer group
        layer_type = "sliding_attention" if cache_window > 1 else "full_attention"
        if isinstance(cu_seq_lens_k, dict):
            cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
        group, layer_in_group = cache.layer_index_to_group_indices[module.layer_idx]
        block = cache.block_size
        window = kwargs.get("sliding_window")
        sel, why = self.call_spec(module, query, key, value, scaling, dropout, kwargs, block, plumbing=PAGED)
        if sel is not None and (window or 1) != cache_window:
            sel, why = None, (f"the layer's sliding window ({window}) differs from its paged cache group's "
                              f"({cache_window})")
        if sel is None:
            self.counts.fall_back(f"{why} (paged)")
            return hf_fallback.paged(module, query, key, value, cache, cu_seq_lens_q, cu_seq_lens_k, read_index,
                                     write_index, cache_window, scaling, dropout, kwargs)
        self.counts.serve(sel.spec)
        features = run_inputs(kwargs)
        tokens = query.shape[2]
        batch = cu_seq_lens_q.numel() - 1
        q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
        if cache_window == 1 and max_seqlen_q == 1 and tokens == batch and read_index[group].numel() > 0:
            k_cache, v_cache = cache.key_cache[layer_in_group], cache.value_cache[layer_in_group]
            k_cache.index_copy_(0, write_index[group], key[0].transpose(0, 1))
            v_cache.index_copy_(0, write_index[group], value[0].transpose(0, 1))

            def plan_decode():
                page_table, lens = paged_page_table(read_index[group], cu_seq_lens_k, block, int(max_seqlen_k))
                return sel.plan_decode(page_table, lens, **_plan_args(sel.plan_decode, max_seq_len=int(max_seqlen_k),
                                                                      context_tokens=read_index[group].numel()))

            run = self.paged_steps.get(module.layer_idx, ("decode", group, id(sel)), plan_decode, query.device)
            kvh, d = k_cache.shape[-2:]
            out = run(q, k_cache.view(-1, block, kvh, d), v_cache.view(-1, block, kvh, d), **features)
            return out[None], None
        if cache_window == 1 and read_index[group].numel() > 0:  # a cached prefix, read in place (None: gather)
            out = paged_extend(self, sel, module.layer_idx, q, key, value, cache, group, layer_in_group,
                               cu_seq_lens_q, cu_seq_lens_k, max_seqlen_q, max_seqlen_k, read_index[group],
                               write_index[group], features)
            if out is not None:
                return out[None], None
        k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, read_index=read_index,
                            write_index=write_index)
        run = self.paged_steps.get(
            module.layer_idx, ("prefill", group, layer_type, id(sel)),
            lambda: sel.plan_prefill(cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), int(max_seqlen_q),
                                     int(max_seqlen_k),
                                     **_plan_args(sel.plan_prefill, total_q=tokens, total_k=k.shape[0])),
            query.device)
        return run(q, k.contiguous(), v.contiguous(), **features)[None], None


@functools.cache
def default() -> HFAttention:
    """The instance the registered functions use, made on first use (the only module-level state)."""
    return HFAttention()


def register(prefill: str | None = None, decode: str | None = None, **select_options) -> list[str]:
    """Register the attnsel attention implementations with transformers; returns the names registered.

    prefill/decode: "auto" or a backend name (default $ATTNSEL_PREFILL_BACKEND / $ATTNSEL_DECODE_BACKEND or auto);
    select_options go to ``attnsel.select`` (policy, mode, priorities, timeout, cache_dir, use_cache).
    transformers >= 5.25 with kernels: also ``"attnsel/flash-attn"`` (``hf_kernels.register_kernel``: writes a local
    kernel repository under attnsel's cache directory and sets ``LOCAL_KERNELS`` and ``ATTNSEL_KERNEL_OPTIONS``).
    """
    Settings.from_env()  # a bad ATTNSEL_* variable is named now, not at the first attention call
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise RuntimeError("attnsel.integrations.hf needs transformers >= 5.0 with AttentionInterface and "
                           f"AttentionMaskInterface ({exc})") from exc
    default().configure(prefill, decode, **select_options)
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, key_mask)
    from . import hf_kernels

    names = [NAME]
    reason = paged_unsupported()
    if reason is None:
        AttentionInterface.register(PAGED_NAME, paged_attention_forward)
        names.append(PAGED_NAME)
    elif (flash_reason := hf_kernels.unsupported()) is None:  # >= 5.18: the flash-named route (hf_kernels)
        log.info("attnsel: %s not registered: %s; use %s for continuous batching", PAGED_NAME, reason,
                 hf_kernels.NAME)
        names += hf_kernels.register(prefill, decode, **select_options)
    else:  # an unknown transformers: no route; the dense path still serves
        log.warning("attnsel: no continuous batching (generate_batch) on transformers %s: %s not registered (%s); "
                    "%s not registered (%s)", _transformers_version(), PAGED_NAME, reason, hf_kernels.NAME,
                    flash_reason)
    reason = hf_kernels.kernel_unsupported()
    if reason is None:  # transformers >= 5.25: the Hub-kernel name, which its server accepts
        try:
            names += hf_kernels.register_kernel(prefill, decode, **select_options)
        except (OSError, RuntimeError) as exc:  # e.g. a read-only cache: the other names still serve
            log.warning("attnsel: %s not registered: %s", hf_kernels.KERNEL_NAME, exc)
    else:
        log.info("attnsel: %s not registered: %s", hf_kernels.KERNEL_NAME, reason)
    return names


def fallbacks() -> dict[str, int]:
    """Attention calls handed back to transformers since ``register()``, by reason."""
    return dict(default().counts.fallbacks)


def served() -> dict[AttentionSpec, int]:
    """Attention calls attnsel served since ``register()`` (the dense and paged paths), by the call's spec. Counted
    in Python: the replays of a captured CUDA graph are not counted."""
    return dict(default().counts.served)


def call_summary() -> list[str]:
    """The calls served (by spec) and handed back (by reason) since ``register()``, as two log lines."""
    return default().counts.summary()


def model_spec(config, dtype: torch.dtype, page_size: int, scaling: float | None = None) -> AttentionSpec:
    """AttentionSpec of a transformers model config at the model's dtype (``AttentionSpec.from_hf_config``). The
    attention calls themselves select for the spec of their tensors and arguments, which can differ (MLA head dims,
    per-layer windows): use this for a first guess before the model runs (e.g. to print a selection at start-up)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    spec = AttentionSpec.from_hf_config(data, dtype=dtype_name(dtype), page_size=page_size)
    if scaling is not None and not math.isclose(scaling, spec.head_dim ** -0.5, rel_tol=1e-6):
        spec = dataclasses.replace(spec, softmax_scale=float(scaling))
    return spec


def selection_for(spec: AttentionSpec, device: torch.device) -> Selection:
    """The Selection for a spec on a device, made once per process (the persistent cache makes later starts fast)."""
    return default().selection_for(spec, device)


def select_for_model(model, page_size: int = DENSE_PAGE_SIZE) -> Selection | None:
    """Run the selections for a loaded model now instead of at its first attention calls: one forward pass of two
    tokens through attnsel's dense path selects for every kind of attention layer the model calls (specs come from
    the calls' tensors, as in generation), at ``page_size``. Returns the Selection of the first attention layer
    attnsel serves, or None when every layer is handed back to transformers (``fallbacks()`` says why)."""
    param = next(model.parameters())
    before = model.config._attn_implementation
    state = default()
    state.page_size_override = page_size
    try:
        if before != NAME:
            model.set_attn_implementation(NAME)
        with torch.no_grad():
            model(input_ids=torch.ones(1, 2, dtype=torch.long, device=param.device), use_cache=False)
    finally:
        state.page_size_override = None
        if before != NAME:
            model.set_attn_implementation(before)
    for mod in model.modules():
        for _, sel in mod.__dict__.get("_attnsel_memo", {}).values():
            if sel is not None:
                return sel
    return None


@torch.compiler.disable  # host-side planning and selection: runs eagerly inside compiled models
def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function of "attnsel" (HFAttention.attention_forward of the default instance)."""
    return default().attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


@torch.compiler.disable  # host-side planning and selection: runs eagerly inside compiled models
def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function of "paged|attnsel" (HFAttention.paged_attention_forward of the default
    instance)."""
    return default().paged_attention_forward(module, query, key, value, attention_mask, **kwargs)


# --- helpers ----------------------------------------------------------------------------------------------------------

def _plan_args(method, **host) -> dict:
    """The host-side sizes a Selection's plan method accepts (the dispatch table uses them to pick a backend
    without a device sync); Selections without these parameters (before the dispatch table) get none."""
    params = _params(getattr(method, "__func__", method))
    return {k: v for k, v in host.items() if k in params}


@functools.cache
def _params(func) -> frozenset:
    return frozenset(inspect.signature(func).parameters)


# --- dense path (generate) ------------------------------------------------------------------------------------------

class _StepPlans:
    """Plans of one forward step, by key: a step begins when a layer index does not exceed the previous call's
    (layers run in order). Tensor identity or version counters are not reliable for this: transformers refills
    static input buffers in ways that do not always bump a tensor's version.

    Off CUDA every call plans afresh: reusing a step's plan across layers gave NaN outputs for a CPU-resident model
    under torch 2.11 (CUDA runs were token-identical either way; the cause is not known). Planning is cheap next to
    CPU attention."""

    def __init__(self) -> None:
        self.layer: int | None = None
        self.plans: dict = {}

    def get(self, layer_idx: int | None, key, make, device: torch.device):
        if device.type != "cuda" or layer_idx is None or self.layer is None or layer_idx <= self.layer:
            self.plans = {}
        self.layer = layer_idx
        plan = self.plans.get(key)
        if plan is None or not plan_is_current(getattr(plan, "run", None) or plan):
            plan = self.plans[key] = make()  # a plan a backend replaced since (run.current()) is made again
        return plan


@dataclasses.dataclass
class _DensePlan:
    decode: bool
    run: object
    q_index: tuple  # (rows, positions) of the real query tokens
    k_index: tuple  # (rows, positions) of the real key tokens; decode: gather grid [B, padded length]
    why: str = ""  # non-empty: this step's masks cannot be served (the call is handed back)


def _plan_dense(sel: Selection, mask: torch.Tensor | None, batch: int, len_q: int, len_kv: int,
                device: torch.device) -> _DensePlan:
    n = len_kv if mask is None else mask.shape[1]
    kmask = torch.ones(batch, len_kv, dtype=torch.bool, device=device) if mask is None else mask.bool()
    if n < len_kv:  # empty static-cache slots
        kmask = F.pad(kmask, (0, len_kv - n), value=False)
    qmask = kmask[:, n - len_q:n]
    q_lens, k_lens = qmask.sum(1), kmask.sum(1)
    slot = torch.arange(len_kv, device=device)
    span = torch.where(kmask, slot, -1).amax(1) - torch.where(kmask, slot, len_kv).amin(1) + 1
    max_q, max_k, total_q, total_k, holes, not_one = torch.stack(
        [q_lens.max(), k_lens.max(), q_lens.sum(), k_lens.sum(), ((k_lens > 0) & (span != k_lens)).sum(),
         (q_lens != 1).sum()]).tolist()  # one host read per plan
    if holes and sel.spec.sliding_window:
        return _DensePlan(False, None, (), (), "a sliding window over a padding mask with holes (the window counts "
                                               "padded slots)")
    if len_q == 1 and not not_one:
        ps = sel.spec.page_size
        padded = max(1, math.ceil(max_k / ps)) * ps
        order = torch.argsort((~kmask).to(torch.int8), dim=1, stable=True)  # real positions first, in order
        if padded > len_kv:
            order = torch.cat([order, order[:, -1:].expand(batch, padded - len_kv)], 1)
        pos = order[:, :padded]
        rows = torch.arange(batch, device=device)[:, None].expand(batch, padded)
        pages = padded // ps
        page_table = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
        run = sel.plan_decode(page_table, k_lens.to(torch.int32),
                              **_plan_args(sel.plan_decode, max_seq_len=max_k, context_tokens=total_k, longest=max_k))
        return _DensePlan(True, run, (), (rows, pos))
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_q[1:], cu_k[1:] = torch.cumsum(q_lens, 0), torch.cumsum(k_lens, 0)
    run = sel.plan_prefill(cu_q, cu_k, max_q, max_k, **_plan_args(sel.plan_prefill, total_q=total_q, total_k=total_k))
    return _DensePlan(False, run, qmask.nonzero(as_tuple=True), kmask.nonzero(as_tuple=True))

