import json

import pytest

from attnsel.spec import AttentionSpec, SpecError


def test_from_hf_config_reads_heads_head_dim_and_dtype(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
                                "torch_dtype": "bfloat16"}))
    spec = AttentionSpec.from_hf_config(path)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (28, 4, 128, "bf16")
    assert spec.group_size == 7
    assert AttentionSpec.from_hf_config(path, dtype="fp16", page_size=32).page_size == 32


def test_explicit_head_dim_and_missing_kv_heads():
    spec = AttentionSpec.from_hf_config({"num_attention_heads": 8, "head_dim": 256, "hidden_size": 1024})
    assert (spec.num_kv_heads, spec.head_dim) == (8, 256)


def test_text_config_of_multimodal_models():
    spec = AttentionSpec.from_hf_config({"text_config": {"num_attention_heads": 16, "num_key_value_heads": 8,
                                                         "head_dim": 64}})
    assert spec.num_kv_heads == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_q_heads=0, num_kv_heads=1, head_dim=64), "num_q_heads must be a positive integer, got 0"),
    (dict(num_q_heads=8, num_kv_heads=3, head_dim=64), "num_q_heads (8) must be a multiple of num_kv_heads (3)"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=-1), "head_dim must be a positive integer, got -1"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, dtype="fp8"), "dtype must be one of bf16, fp16, fp32"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, page_size=0), "page_size must be a positive integer"),
])
def test_bad_fields_name_the_field(kwargs, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AttentionSpec(**kwargs)


def test_bad_configs(tmp_path):
    with pytest.raises(SpecError, match="config: cannot read"):
        AttentionSpec.from_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SpecError, match="is not valid JSON"):
        AttentionSpec.from_hf_config(bad)
    with pytest.raises(SpecError, match="num_attention_heads is missing"):
        AttentionSpec.from_hf_config({"hidden_size": 10})
    with pytest.raises(SpecError, match="torch_dtype 'int8' is not supported"):
        AttentionSpec.from_hf_config({"num_attention_heads": 2, "head_dim": 8, "torch_dtype": "int8"})
