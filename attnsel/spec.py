"""AttentionSpec: the attention shape of one model, the input of selection and part of the cache key."""
from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Literal

import torch

from .errors import SpecError
from .hf_config import (DTYPE_NAMES, LAYER_KINDS, LayerKind, hf_fields, layer_fields, layers_differ,  # noqa: F401
                        load_config_file)

DtypeName = Literal["bf16", "fp16", "fp32"]
KvDtypeName = Literal["fp8_e4m3"]
DTYPES: dict[DtypeName, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dtypes of a paged KV cache besides the activation dtype: fp8 e4m3 with per-tensor float32 k/v scales
# (stored value = real value / scale), as vLLM and SGLang store it.
KV_DTYPES: dict[KvDtypeName, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn}


def short_dtype_name(text: str) -> str:
    """A dtype named as torch or transformers name it (bfloat16, float16, half, float32, any case) in our short
    form (bf16, fp16, fp32); any other text unchanged, for the caller's check to refuse with the allowed list."""
    return DTYPE_NAMES.get(text.lower(), text)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Attention of one kind of model layer: what every backend is checked and validated against.

    - dtype: activations (q, k, v, out): "bf16", "fp16" or "fp32" (torch's names and dtypes are taken and stored
      as these).
    - softmax_scale: None means 1/sqrt(head_dim).
    - sliding_window: None, or w > 0 tokens: query at absolute position i attends to keys j with i - w < j <= i
      (w keys, itself included; FlashAttention's ``window_size=(w - 1, 0)``, FlashInfer's ``window_left=w - 1``,
      transformers' ``sliding_window=w``).
    - softcap: None, or c > 0: scores become ``c * tanh(scores / c)`` (after the softmax scale; Gemma 2).
    - sinks: the layer has learned per-head sink logits (gpt-oss); they are passed to ``run`` as ``sinks``, a float32
      ``[num_q_heads]`` tensor, and join the softmax denominator only (a sink has no value).
    - kv_dtype: None (the paged cache holds ``dtype``) or "fp8_e4m3": the decode cache is fp8 and ``run`` receives
      ``k_scale``/``v_scale`` (float32 tensors of one element; real value = stored value * scale). Prefill takes
      its k/v in ``dtype`` either way.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: DtypeName = "bf16"
    page_size: int = 16
    causal: bool = True
    softmax_scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    kv_dtype: KvDtypeName | None = None

    def __post_init__(self) -> None:
        for field in ("num_q_heads", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"{field} must be a positive integer, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise SpecError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                            f"({self.num_kv_heads})")
        if isinstance(self.dtype, torch.dtype) and self.dtype in DTYPES.values():  # as the CLI: one short name
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        elif isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", short_dtype_name(self.dtype))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {', '.join(DTYPES)} (or torch's name or dtype for one: bfloat16, "
                            f"float16/half, float32/float), got {self.dtype!r}")
        if not isinstance(self.causal, bool):  # "False" is truthy: a string would mean causal
            raise SpecError(f"causal must be True or False, got {self.causal!r}")
        scale = self.softmax_scale
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                                  or not (scale > 0 and math.isfinite(scale))):
            raise SpecError(f"softmax_scale must be a positive finite number or None, got {scale!r}")
        if scale is not None:  # numpy's float32 too: one spec and cache key per value, stored as JSON
            object.__setattr__(self, "softmax_scale", float(scale))
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise SpecError(f"sliding_window must be None or a positive integer (tokens), got {window!r}")
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float))
                                         or not (self.softcap > 0 and math.isfinite(self.softcap))):
            raise SpecError(f"softcap must be None or a positive finite number, got {self.softcap!r}")
        if not isinstance(self.sinks, bool):
            raise SpecError(f"sinks must be True or False, got {self.sinks!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise SpecError(f"kv_dtype must be None (same as dtype) or one of {', '.join(KV_DTYPES)}, "
                            f"got {self.kv_dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, num_q_heads for MQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The paged cache's dtype (decode)."""
        return KV_DTYPES[self.kv_dtype] if self.kv_dtype else self.torch_dtype

    def features(self) -> list[str]:
        """The optional attention features this spec uses, in words (for reasons and reports)."""
        out = []
        if self.sliding_window is not None:
            out.append(f"sliding window {self.sliding_window}")
        if self.softcap is not None:
            out.append(f"softcap {self.softcap:g}")
        if self.sinks:
            out.append("attention sinks")
        if self.kv_dtype:
            out.append(f"{self.kv_dtype} KV cache")
        if not self.causal:
            out.append("non-causal")
        return out

    def describe(self) -> str:
        """One line for logs, reports and errors: '32/8 heads, head_dim 128, bf16, page 16[, features]'."""
        text = (f"{self.num_q_heads}/{self.num_kv_heads} heads, head_dim {self.head_dim}, {self.dtype}, "
                f"page {self.page_size}")
        if self.softmax_scale is not None:
            text += f", scale {self.softmax_scale:.4g}"
        return ", ".join([text, *self.features()])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionSpec":
        return cls(**data)

    @classmethod
    def from_hf_config(cls, config: dict | str | Path, **overrides) -> "AttentionSpec":
        """Spec from a Hugging Face config (a dict, a config.json or its directory); overrides that are not None win.

        One spec for the whole model: SpecError (naming the config fields) when its layers differ (Gemma 2/3,
        gpt-oss, Qwen2 with sliding layers...): use ``layer_specs`` for one spec per layer kind."""
        kinds = layer_specs(config, **overrides)
        if len(kinds) > 1:
            raise SpecError(layers_differ(config, [(kind, s.sliding_window, layers) for kind, s, layers in kinds]))
        return kinds[0][1]


def dtype_name(dtype: torch.dtype) -> DtypeName:
    """The spec's name for a torch dtype; SpecError for dtypes attnsel does not serve."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise SpecError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")


def layer_specs(config: dict | str | Path, **overrides) -> list[tuple[LayerKind, AttentionSpec, list[int]]]:
    """One spec per distinct layer kind of a Hugging Face config (dict, config.json or its directory).

    Returns ``[(kind, spec, layer indices), ...]`` ordered by first layer; kind is "full_attention" or
    "sliding_attention". The indices are empty when the config does not give num_hidden_layers (then every layer is
    of the one kind). Overrides (AttentionSpec fields; None means not given) apply to every layer and win over the
    config, whose value of an overridden field is not checked (``sliding_window=w``: every layer slides by w).
    Which layers slide: `layer_types`; Qwen2/3's `use_sliding_window` + `max_window_layers`;
    `sliding_window_pattern`; transformers' defaults for Gemma 2/3, gpt-oss, Cohere 2; otherwise a
    `sliding_window` applies to every layer (Mistral). The config is read by ``attnsel.hf_config``."""
    names = [f.name for f in dataclasses.fields(AttentionSpec)]
    return [(kind, AttentionSpec(**fields), layers)
            for kind, fields, layers in layer_fields(config, names, **overrides)]
