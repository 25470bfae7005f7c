"""AttentionSpec: the attention shape of one model, the input of selection and part of the cache key."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Spellings found in Hugging Face configs (`torch_dtype` / `dtype`).
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
              "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


class SpecError(ValueError):
    """A spec field or config file is invalid; the message names the field and what is allowed."""


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Attention shape of a model: what every backend is checked and validated against.

    dtype is one of "bf16", "fp16", "fp32". softmax_scale None means 1/sqrt(head_dim).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    page_size: int = 16
    causal: bool = True
    softmax_scale: float | None = None

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
