"""Hugging Face configs read as AttentionSpec fields: the attention fields every layer shares, which layers slide,
and per-layer fields; refused, naming the config key, where the spec cannot express the attention.

``attnsel.spec`` builds the specs from these fields (``AttentionSpec.from_hf_config``, ``layer_specs``)."""
from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Literal

from .errors import SpecError

# Spellings found in Hugging Face configs (`torch_dtype` / `dtype`), also accepted by the CLI's --dtype.
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
               "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}

# Layer kinds, named as transformers' `layer_types` names them.
LayerKind = Literal["full_attention", "sliding_attention"]
LAYER_KINDS: tuple[LayerKind, ...] = ("full_attention", "sliding_attention")
# Other names of the standard keys (transformers' attribute_map of GPT-2 / GPT-J / GPT-BigCode...).
# (n_positions, GPT-2's max_position_embeddings, does not change attention: not read.)
_ALIASES = {"num_attention_heads": ("n_head",), "hidden_size": ("n_embd",), "num_hidden_layers": ("n_layer",)}
# transformers' (5.17) defaults for attention fields that real config.json files leave out, per model_type;
# "sliding_window_pattern": every p-th layer (p, 2p, ...) is full, the others sliding.
_QWEN = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_HF_DEFAULTS: dict[str, dict] = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "sliding_window": 4096,
               "sliding_window_pattern": 2},
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 26,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
    "gpt_oss": {"sliding_window": 128, "sliding_window_pattern": 2},
    "cohere2": {"sliding_window": 4096, "sliding_window_pattern": 4},
    "mistral": {"sliding_window": 4096},
    "qwen2": _QWEN, "qwen2_moe": _QWEN, "qwen3": _QWEN, "qwen3_moe": {**_QWEN, "max_window_layers": 0},
    "gemma4_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 30,
                    "sliding_window": 512, "sliding_window_pattern": 6},
}
_LAST_LAYER_FULL = {"gemma4", "gemma4_text"}  # transformers forces the last layer to full attention
# Model types whose attention the reader does not describe (with what is missing): refused, not guessed.
_REFUSED_MODEL_TYPES = {"diffusion_gemma": "a bidirectional (diffusion) decoder with softmax scale 1",
                        "diffusion_gemma_text": "a bidirectional (diffusion) decoder with softmax scale 1"}
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "gemma3n": "gemma3n_text"}
# (multimodal model_type -> its text_config's)
_SINKS_MODEL_TYPES = {"gpt_oss"}  # learned per-head sink logits (a parameter, no config field)
# Softmax scale 1 (q and k are RMS-normed; transformers 5.17 sets `self.scaling = 1.0`, no config field).
_UNIT_SCALE_MODEL_TYPES = {"gemma3n", "gemma3n_text", "gemma4", "gemma4_text"}
# Per-layer attention fields (Gemma 4's full-attention layers: `global_head_dim`, `num_global_key_value_heads`
# saved as per_layer_config {"layer index": {...}}), as the spec's fields.
_PER_LAYER_FIELDS = {"head_dim": "head_dim", "num_key_value_heads": "num_kv_heads", "num_attention_heads": "num_q_heads"}
# Fields whose presence means an attention AttentionSpec cannot express (with what they mean).
_REFUSED = {"kv_lora_rank": "multi-head latent attention", "q_lora_rank": "multi-head latent attention",
            "qk_rope_head_dim": "multi-head latent attention", "qk_nope_head_dim": "multi-head latent attention",
            "attention_chunk_size": "chunked attention", "alibi": "ALiBi position biases",
            "scale_attn_by_inverse_layer_idx": "a softmax scale that differs per layer",
            "use_bidirectional_attention": "bidirectional (non-causal) attention"}


def _as_dict(config: dict | str | Path) -> dict:
    return config if isinstance(config, dict) else load_config_file(config)


def load_config_file(path: str | Path) -> dict:
    """A config.json as a dict; a directory means its config.json. SpecError naming the path otherwise."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"config: {path} is a directory without a config.json")
        path = path / "config.json"
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"config: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"config: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise SpecError(f"config: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _text_config(config: dict) -> dict:
    """The language model's part of a config: multimodal configs keep it in `text_config` (their dtype and
    model_type at the top level apply to it unless it says otherwise)."""
    text = config.get("text_config")
    if not isinstance(text, dict) or any(k in config for k in ("num_attention_heads", "n_head")):
        return config
    inherited = {k: config[k] for k in ("torch_dtype", "dtype") if k in config}
    model_type = config.get("model_type")
    if model_type is not None:
        inherited["model_type"] = _TEXT_MODEL_TYPES.get(model_type, model_type)
    return {**inherited, **text}


def _get(config: dict, key: str):
    """(the key as the config spells it, its value or transformers' default for the model_type; None if absent).
    An explicit null is a value (Mistral v0.3's "sliding_window": null means no window), not a missing key."""
    names = (key, *_ALIASES.get(key, ()))
    for name in names:
        if config.get(name) is not None:
            return name, config[name]
    for name in names:
        if name in config:
            return name, None
    default = _HF_DEFAULTS.get(config.get("model_type"), {}).get(key)
    return key, default


def _positive_int(key: str, value, field: str | None = None, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        what = "a non-negative" if zero else "a positive"
        raise SpecError(f"config: {key} must be {what} integer, got {value!r}", field)
    return value


def _positive_number(key: str, value, field: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise SpecError(f"config: {key} must be a positive number, got {value!r}", field)
    return float(value)


def _refuse_inexpressible(config: dict) -> None:
    found = [f"{key} {config[key]!r}" for key in _REFUSED if config.get(key) not in (None, False)]
    attn = config.get("attn_config")
    if isinstance(attn, dict) and attn.get("alibi"):
        found.append(f"attn_config.alibi {attn['alibi']!r}")
    if config.get("model_type") == "bloom":
        found.append("model_type 'bloom'")
    if config.get("model_type") in _REFUSED_MODEL_TYPES:
        raise SpecError(f"config: model_type {config['model_type']!r}: "
                        f"{_REFUSED_MODEL_TYPES[config['model_type']]}, which attnsel's config reader does not "
                        "describe; give the spec's fields yourself (AttentionSpec(...), or --num-heads etc. "
                        "without --config)")
    if found:
        meaning = sorted({_REFUSED.get(f.split()[0], "ALiBi position biases") for f in found})
        raise SpecError(f"config: {', '.join(found)}: {' and '.join(meaning)}, which AttentionSpec cannot express "
                        f"(model_type {config.get('model_type')!r}); attnsel cannot serve this model's attention")


def _read_fields(config: dict) -> tuple[dict, dict[str, SpecError]]:
    """Spec fields a config gives, shared by every layer, and the error of each field it gives wrongly."""
    _refuse_inexpressible(config)
    fields: dict = {}
    errors: dict[str, SpecError] = {}
    key, heads = _get(config, "num_attention_heads")
    try:
        if heads is None:
            model_type = config.get("model_type")
            hint = f" (model_type {model_type!r} has no default for it here)" if model_type else ""
            raise SpecError(f"config: num_attention_heads is missing (needed for num_q_heads){hint}", "num_q_heads")
        fields["num_q_heads"] = heads = _positive_int(key, heads, "num_q_heads")
    except SpecError as exc:
        errors["num_q_heads"], heads = exc, None
    try:
        kv_key, kv = _get(config, "num_key_value_heads")
        if kv is None and config.get("multi_query") and config.get("model_type") in ("gpt_bigcode", "falcon") \
                and not config.get("new_decoder_architecture"):
            kv_key, kv = "multi_query", 1
        if kv is None and config.get("model_type") == "falcon" and config.get("num_kv_heads") is not None:
            kv_key, kv = "num_kv_heads", config["num_kv_heads"]
        if kv is not None:
            fields["num_kv_heads"] = kv = _positive_int(kv_key, kv, "num_kv_heads")
            if heads is not None and heads % kv:
                raise SpecError(f"config: {key} ({heads}) must be a multiple of {kv_key} ({kv})", "num_kv_heads")
    except SpecError as exc:
        errors["num_kv_heads"] = exc
    try:
        hd_key, head_dim = _get(config, "head_dim")
        if head_dim is None:
            hidden_key, hidden = _get(config, "hidden_size")
            if hidden is None:
                raise SpecError("config: neither head_dim nor hidden_size is present (needed for head_dim)",
                                "head_dim")
            hidden = _positive_int(hidden_key, hidden, "head_dim")
            if heads is None:
                raise SpecError(f"config: head_dim is not given and {key} is missing or invalid (head_dim is "
                                f"{hidden_key} / {key})", "head_dim")
            if hidden % heads:
                raise SpecError(f"config: {hidden_key} ({hidden}) must be a multiple of {key} ({heads})", "head_dim")
            head_dim = hidden // heads
        fields["head_dim"] = _positive_int(hd_key, head_dim, "head_dim")
    except SpecError as exc:
        errors["head_dim"] = exc
    v_head_dim = config.get("v_head_dim")
    if v_head_dim is not None and v_head_dim != fields.get("head_dim"):
        raise SpecError(f"config: v_head_dim {v_head_dim!r} differs from head_dim {fields.get('head_dim')}: "
                        "AttentionSpec has one head_dim for queries, keys and values")
    raw_dtype = config.get("torch_dtype") or config.get("dtype")
    if raw_dtype is not None:
        name = str(raw_dtype).replace("torch.", "")
        if name in DTYPE_NAMES:
            fields["dtype"] = DTYPE_NAMES[name]
        else:
            dtype_key = "torch_dtype" if config.get("torch_dtype") else "dtype"
            errors["dtype"] = SpecError(f"config: {dtype_key} {raw_dtype!r} is not supported; allowed: "
                                        f"{', '.join(sorted(DTYPE_NAMES))}", "dtype")
    try:
        fields["softmax_scale"] = _read_scale(config)
    except SpecError as exc:
        errors["softmax_scale"] = exc
    try:
        cap = _get(config, "attn_logit_softcapping")[1]
        fields["softcap"] = None if cap is None else _positive_number("attn_logit_softcapping", cap, "softcap")
    except SpecError as exc:
        errors["softcap"] = exc
    fields["sinks"] = config.get("model_type") in _SINKS_MODEL_TYPES
    return fields, errors


def _read_scale(config: dict) -> float | None:
    """The softmax scale when the config sets one: Gemma's query_pre_attn_scalar (scale = its -1/2 power),
    Granite's attention_multiplier (the scale itself), GPT-2's scale_attn_weights false (scale 1)."""
    if config.get("model_type") in _UNIT_SCALE_MODEL_TYPES:
        return 1.0
    scalar = _get(config, "query_pre_attn_scalar")[1]
    if scalar is not None:
        return _positive_number("query_pre_attn_scalar", scalar, "softmax_scale") ** -0.5
    if config.get("attention_multiplier") is not None:
        return _positive_number("attention_multiplier", config["attention_multiplier"], "softmax_scale")
    if config.get("scale_attn_weights") is False:
        return 1.0
    return None


def _normalized(fields: dict) -> dict:
    """softmax_scale None when it equals 1/sqrt(head_dim): the same attention gets the same spec (and cache key)."""
    scale, head_dim = fields.get("softmax_scale"), fields.get("head_dim")
    if scale is not None and isinstance(head_dim, int) and head_dim > 0 \
            and math.isclose(scale, head_dim ** -0.5, rel_tol=1e-9):
        return {**fields, "softmax_scale": None}
    return fields


def hf_fields(config: dict, skip: Collection[str] = ()) -> dict:
    """AttentionSpec fields shared by every layer of a Hugging Face config dict (multimodal: its `text_config`):
    num_q_heads, num_kv_heads, head_dim, dtype (when the config gives it), softmax_scale, softcap, sinks.

    Fields in ``skip`` (given by the caller instead) are neither required nor checked. SpecError naming the config
    key for a missing or wrong value, and for attention the spec cannot express (MLA, ALiBi, chunked attention...).
    Per-layer fields (sliding_window) come from ``layer_specs``."""
    config = _text_config(config)
    fields, errors = _read_fields(config)
    for field, exc in errors.items():
        if field not in skip:
            raise exc
    if "num_kv_heads" not in fields and "num_q_heads" in fields:
        fields["num_kv_heads"] = fields["num_q_heads"]  # absent: one KV head per query head (transformers' default)
    return _normalized({k: v for k, v in fields.items() if k not in skip})


def _layer_kinds(config: dict) -> tuple[list[LayerKind] | None, int | None]:
    """(the kind of every layer, or None when all layers are alike; the window of the sliding layers or None)."""
    window = _get(config, "sliding_window")[1]
    if window is not None:
        window = _positive_int("sliding_window", window, "sliding_window")
    use = _get(config, "use_sliding_window")[1]
    if use is False:  # Qwen2/3: sliding_window is ignored unless use_sliding_window
        window = None
    n_key, n = _get(config, "num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not layer_types:
            raise SpecError(f"config: layer_types must be a list of layer kinds, got {layer_types!r}")
        for i, kind in enumerate(layer_types):
            if kind not in LAYER_KINDS:
                raise SpecError(f"config: layer_types[{i}] is {kind!r}, which AttentionSpec cannot express; "
                                f"allowed: {', '.join(LAYER_KINDS)}")
        if n is not None and n != len(layer_types):
            raise SpecError(f"config: layer_types has {len(layer_types)} entries but {n_key} is {n!r}")
        if "sliding_attention" in layer_types and window is None:
            raise SpecError("config: layer_types has sliding_attention layers but sliding_window is not set"
                            + (" (use_sliding_window is false)" if use is False else ""), "sliding_window")
        return list(layer_types), window
    if window is None:
        return None, None
    mwl = _get(config, "max_window_layers")[1]
    pattern = _get(config, "sliding_window_pattern")[1] or config.get("_sliding_window_pattern")
    if use is not None and mwl is not None:  # Qwen2/3: the first max_window_layers layers are full
        mwl = _positive_int("max_window_layers", mwl, zero=True)
        if mwl == 0:
            return None, window
        n = _positive_int(n_key, n) if n is not None else _missing_layers(n_key, "max_window_layers")
        return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)], window
    if pattern is not None:
        pattern = _positive_int("sliding_window_pattern", pattern)
        n = _positive_int(n_key, n) if n is not None else _missing_layers(n_key, "sliding_window_pattern")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)], window
    return None, window  # Mistral and others: every layer sliding


def _missing_layers(n_key: str, why: str):
    raise SpecError(f"config: {n_key} is missing (needed to tell which layers are sliding, from {why})")


def _decided_by(config: dict) -> str:
    """The config fields that say which layers are sliding (for messages)."""
    keys = [k for k in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
                        "sliding_window_pattern") if config.get(k) is not None]
    model_type = config.get("model_type")
    if model_type in _HF_DEFAULTS and "layer_types" not in keys:
        keys.append(f"model_type {model_type!r}")
    return ", ".join(keys)


def layer_fields(config: dict | str | Path, spec_fields: Collection[str],
                 **overrides) -> list[tuple[LayerKind, dict, list[int]]]:
    """The AttentionSpec fields of each distinct layer kind of a Hugging Face config (dict, config.json or its
    directory), as ``[(kind, fields, layer indices), ...]`` ordered by first layer (see ``attnsel.spec.layer_specs``,
    which builds the specs). ``spec_fields``: the names overrides may use."""
    config = _text_config(_as_dict(config))
    unknown = sorted(set(overrides) - set(spec_fields))
    if unknown:
        raise SpecError(f"unknown AttentionSpec field(s) {', '.join(unknown)}; allowed: {', '.join(spec_fields)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    base = hf_fields(config, skip=given)
    kinds, window = (None, given["sliding_window"]) if "sliding_window" in given else _layer_kinds(config)
    if kinds and kinds[-1] != "full_attention" and config.get("model_type") in _LAST_LAYER_FULL:
        kinds = [*kinds[:-1], "full_attention"]
    n_key, n = _get(config, "num_hidden_layers")
    indices_known = kinds is not None or n is not None
    if kinds is None:
        kind: LayerKind = "sliding_attention" if window is not None else "full_attention"
        kinds = [kind] * (_positive_int(n_key, n) if n is not None else 1)
    per_layer = _per_layer_fields(config, kinds)
    groups: dict[str, tuple[dict, list[int]]] = {}
    firsts: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        if kind not in groups:
            fields = {**base, **({"sliding_window": window} if kind == "sliding_attention" else {}),
                      **per_layer.get(i, {}), **given}
            fields.setdefault("num_kv_heads", fields.get("num_q_heads"))
            groups[kind], firsts[kind] = (_normalized(fields), []), i
        elif per_layer.get(i, {}) != per_layer.get(firsts[kind], {}):
            raise SpecError(f"config: per_layer_config gives layer {i} ({kind}) {per_layer.get(i, {})} but layer "
                            f"{firsts[kind]} of the same kind {per_layer.get(firsts[kind], {})}: attnsel serves one "
                            "spec per layer kind (full_attention, sliding_attention)")
        if indices_known:
            groups[kind][1].append(i)
    return [(kind, fields, layers) for kind, (fields, layers) in groups.items()]


def layers_differ(config: dict | str | Path, kinds: Iterable[tuple[str, int | None, list[int]]]) -> str:
    """The message for a config whose layers differ where one spec was asked for; kinds: (kind, sliding window,
    layer indices)."""
    text = ", ".join(f"{len(layers)} {kind} layers" + (f" (window {window})" if window else "")
                     for kind, window, layers in kinds)
    return (f"config: layers differ ({_decided_by(_text_config(_as_dict(config)))}: {text}); one AttentionSpec "
            "cannot describe them: use attnsel.spec.layer_specs(config) for one spec per layer kind")


def _per_layer_fields(config: dict, kinds: list[str]) -> dict[int, dict]:
    """Spec fields a config sets for single layers (Gemma 4's per_layer_config: {"5": {"head_dim": 512}}), by layer
    index; SpecError for a key attnsel does not know (it could change the attention). A Gemma 4 config without
    per_layer_config gets transformers' (5.17): every full-attention layer has global_head_dim (default 512) and,
    with attention_k_eq_v, num_global_key_value_heads KV heads."""
    layers = len(kinds)
    raw = config.get("per_layer_config")
    if raw is None and config.get("model_type") in ("gemma4", "gemma4_text"):
        full = {"head_dim": config.get("global_head_dim", 512)}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        raw = {str(i): full for i, kind in enumerate(kinds) if kind == "full_attention"}
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"config: per_layer_config must be an object of layer index -> fields, got {raw!r}")
    found: dict[int, dict] = {}
    for index, fields in raw.items():
        try:
            i = int(index)
        except (TypeError, ValueError):
            i = -1
        if not 0 <= i < layers or not isinstance(fields, dict):
            raise SpecError(f"config: per_layer_config[{index!r}] must map a layer index below {layers} to an "
                            f"object, got {fields!r}")
        unknown = sorted(set(fields) - set(_PER_LAYER_FIELDS))
        if unknown:
            raise SpecError(f"config: per_layer_config[{index!r}] sets {', '.join(unknown)}, which attnsel does not "
                            f"read (known: {', '.join(_PER_LAYER_FIELDS)})")
        found[i] = {_PER_LAYER_FIELDS[k]: _positive_int(f"per_layer_config[{index!r}].{k}", v, _PER_LAYER_FIELDS[k])
                    for k, v in fields.items()}
    return found
