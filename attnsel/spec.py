"""AttentionSpec: the attention shape of one model, the input of selection and part of the cache key."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dtypes of a paged KV cache besides the activation dtype: fp8 e4m3 with per-tensor float32 k/v scales
# (stored value = real value / scale), as vLLM and SGLang store it.
KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn}
# Spellings found in Hugging Face configs (`torch_dtype` / `dtype`).
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
              "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


class SpecError(ValueError):
    """A spec field or config file is invalid; the message names the field and what is allowed."""


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Attention of one kind of model layer: what every backend is checked and validated against.

    - dtype: activations (q, k, v, out): "bf16", "fp16" or "fp32".
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
    dtype: str = "bf16"
    page_size: int = 16
    causal: bool = True
    softmax_scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        for field in ("num_q_heads", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"{field} must be a positive integer, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise SpecError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                            f"({self.num_kv_heads})")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.softmax_scale is not None and not (self.softmax_scale > 0 and math.isfinite(self.softmax_scale)):
            raise SpecError(f"softmax_scale must be a positive finite number or None, got {self.softmax_scale!r}")
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
        """Spec from a Hugging Face config (a dict, or the path of a config.json); overrides that are not None win."""
        if not isinstance(config, dict):
            config = load_config_file(config)
        fields = hf_fields(config)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
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


def hf_fields(config: dict) -> dict:
    """AttentionSpec fields read from a Hugging Face config dict (multimodal configs: the `text_config`)."""
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    fields: dict = {}
    heads = config.get("num_attention_heads")
    if heads is None:
        raise SpecError("config: num_attention_heads is missing (needed for num_q_heads)")
    fields["num_q_heads"] = heads
    fields["num_kv_heads"] = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = config.get("hidden_size")
        if hidden is None:
            raise SpecError("config: neither head_dim nor hidden_size is present (needed for head_dim)")
        if not isinstance(heads, int) or heads <= 0 or hidden % heads:
            raise SpecError(f"config: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads
    fields["head_dim"] = head_dim
    raw_dtype = config.get("torch_dtype") or config.get("dtype")
    if raw_dtype is not None:
        name = str(raw_dtype).replace("torch.", "")
        if name not in _HF_DTYPES:
            raise SpecError(f"config: torch_dtype {raw_dtype!r} is not supported; allowed: "
                            f"{', '.join(sorted(_HF_DTYPES))}")
        fields["dtype"] = _HF_DTYPES[name]
    return fields


def dtype_name(dtype: torch.dtype) -> str:
    """The spec's name for a torch dtype; SpecError for dtypes attnsel does not serve."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise SpecError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
