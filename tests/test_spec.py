import json

import pytest
import torch

from attnsel.spec import DTYPES, AttentionSpec, SpecError


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


# ---- Hugging Face configs: every field that changes attention is read, or the config is refused ------------------
from pathlib import Path  # noqa: E402

from attnsel.spec import layer_specs  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
# google/gemma-3-4b-it's config.json (vision part left out): its text_config leaves the heads to transformers'
# defaults for gemma3_text, and the dtype sits at the top level.
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024}}


def _kinds(config, **overrides):
    return {kind: (spec, layers) for kind, spec, layers in layer_specs(config, **overrides)}


def test_gemma2_scale_softcap_and_alternating_window():
    kinds = _kinds(CONFIGS / "gemma-2-27b.json")
    assert list(kinds) == ["sliding_attention", "full_attention"]
    sliding, sliding_layers = kinds["sliding_attention"]
    full, full_layers = kinds["full_attention"]
    assert sliding_layers == list(range(0, 46, 2)) and full_layers == list(range(1, 46, 2))
    for spec in (sliding, full):  # query_pre_attn_scalar 144, head_dim 128: the scale is 1/12, not 1/sqrt(128)
        assert spec.scale == pytest.approx(144 ** -0.5) and spec.softcap == 50.0 and spec.head_dim == 128
        assert (spec.num_q_heads, spec.num_kv_heads, spec.dtype) == (32, 16, "fp32")
    assert (sliding.sliding_window, full.sliding_window) == (4096, None)


def test_one_spec_refused_when_layers_differ():
    with pytest.raises(SpecError) as exc:
        AttentionSpec.from_hf_config(CONFIGS / "gemma-2-27b.json")
    assert str(exc.value) == (
        "config: layers differ (sliding_window, model_type 'gemma2': 23 sliding_attention layers (window 4096), "
        "23 full_attention layers); one AttentionSpec cannot describe them: use attnsel.spec.layer_specs(config) "
        "for one spec per layer kind")


def test_gemma3_five_sliding_layers_per_global_one():
    kinds = _kinds(CONFIGS / "gemma-3-1b.json")
    assert kinds["full_attention"][1] == [5, 11, 17, 23]
    assert len(kinds["sliding_attention"][1]) == 22 and kinds["sliding_attention"][0].sliding_window == 512
    assert kinds["full_attention"][0].softmax_scale is None  # query_pre_attn_scalar 256 == head_dim: the default
    assert kinds["full_attention"][0].softcap is None


def test_gemma3_multimodal_config_with_transformers_defaults():
    kinds = _kinds(GEMMA3_4B)
    spec = kinds["sliding_attention"][0]
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (8, 4, 256, "bf16")
    assert spec.sliding_window == 1024 and kinds["full_attention"][1] == [5, 11, 17, 23, 29]


def test_gpt_oss_sinks_in_every_layer_and_alternating_window():
    kinds = _kinds(CONFIGS / "gpt-oss-20b.json")
    assert [spec.sinks for spec, _ in kinds.values()] == [True, True]
    assert kinds["sliding_attention"][0].sliding_window == 128 and kinds["sliding_attention"][1][:3] == [0, 2, 4]
    assert (kinds["full_attention"][0].num_q_heads, kinds["full_attention"][0].head_dim) == (64, 64)


def test_mistral_every_layer_sliding_is_one_spec():
    spec = AttentionSpec.from_hf_config(CONFIGS / "mistral-7b-v0.1.json")
    assert spec.sliding_window == 4096 and spec.describe().endswith("sliding window 4096")
    assert [len(layers) for _, _, layers in layer_specs(CONFIGS / "mistral-7b-v0.1.json")] == [32]


def test_qwen2_sliding_layers_after_max_window_layers():
    kinds = _kinds(CONFIGS / "qwen2-7b-sliding.json")
    assert kinds["full_attention"][1] == list(range(21)) and kinds["sliding_attention"][1] == list(range(21, 28))
    assert kinds["sliding_attention"][0].sliding_window == 4096
    # use_sliding_window false (the published Qwen2 configs): the sliding_window field is ignored
    data = json.loads((CONFIGS / "qwen2-7b-sliding.json").read_text())
    assert AttentionSpec.from_hf_config({**data, "use_sliding_window": False}).sliding_window is None
    assert AttentionSpec.from_hf_config(CONFIGS / "qwen2-7b.json").sliding_window is None


@pytest.mark.parametrize("name", ["gemma-2-27b", "gemma-3-1b", "gpt-oss-20b", "mistral-7b-v0.1", "qwen2-7b-sliding",
                                  "qwen2-7b", "llama-3-8b", "gpt2"])
def test_layer_specs_agree_with_transformers(name):
    """An independent reading: transformers' own config class (its defaults, layer_types and window per layer)."""
    _agree_with_transformers(json.loads((CONFIGS / f"{name}.json").read_text()))


@pytest.mark.parametrize("name, key", [("mistral-7b-v0.1", "sliding_window"), ("gemma-2-27b", "attn_logit_softcapping")])
def test_an_explicit_null_is_a_value_not_a_missing_key(name, key):
    """Mistral v0.3's "sliding_window": null means no window, as transformers reads it, not the default 4096."""
    data = json.loads((CONFIGS / f"{name}.json").read_text())
    data[key] = None
    _agree_with_transformers(data)


def _agree_with_transformers(data: dict) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if k != "model_type"})
    n, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scale = getattr(cfg, "query_pre_attn_scalar", None)
    scale = scale ** -0.5 if scale else head_dim ** -0.5
    seen = set()
    for kind, spec, layers in layer_specs(data):
        for i in layers:
            seen.add(i)
            assert types[i] == kind
            assert spec.sliding_window == (window if kind == "sliding_attention" else None)
        assert (spec.num_q_heads, spec.num_kv_heads) == (heads, getattr(cfg, "num_key_value_heads", None) or heads)
        assert spec.head_dim == head_dim and spec.scale == pytest.approx(scale)
        assert spec.softcap == getattr(cfg, "attn_logit_softcapping", None)
    assert seen == set(range(n))


def test_gpt2_names():
    spec = AttentionSpec.from_hf_config(CONFIGS / "gpt2.json")
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (12, 12, 64)
    assert layer_specs(CONFIGS / "gpt2.json")[0][2] == list(range(12))
    assert AttentionSpec.from_hf_config({"n_head": 4, "n_embd": 256, "scale_attn_weights": False}).scale == 1.0
    with pytest.raises(SpecError, match="scale_attn_by_inverse_layer_idx True: a softmax scale that differs per "
                                        "layer"):
        AttentionSpec.from_hf_config({"n_head": 4, "n_embd": 256, "scale_attn_by_inverse_layer_idx": True})


def test_deepseek_v3_mla_is_refused_naming_the_fields():
    with pytest.raises(SpecError) as exc:
        layer_specs(CONFIGS / "deepseek-v3.json")
    assert str(exc.value) == (
        "config: kv_lora_rank 512, q_lora_rank 1536, qk_rope_head_dim 64, qk_nope_head_dim 128: multi-head latent "
        "attention, which AttentionSpec cannot express (model_type 'deepseek_v3'); attnsel cannot serve this "
        "model's attention")
    with pytest.raises(SpecError, match="v_head_dim 96 differs from head_dim 128"):
        AttentionSpec.from_hf_config({"num_attention_heads": 8, "head_dim": 128, "v_head_dim": 96})


@pytest.mark.parametrize("config, message", [
    ({"num_attention_heads": 32, "num_key_value_heads": 0, "head_dim": 128},
     "config: num_key_value_heads must be a positive integer, got 0"),
    ({"num_attention_heads": 32, "num_key_value_heads": "32", "head_dim": 128},
     "config: num_key_value_heads must be a positive integer, got '32'"),
    ({"num_attention_heads": "32", "hidden_size": 4096}, "config: num_attention_heads must be a positive integer, "
                                                        "got '32'"),
    ({"num_attention_heads": 32, "num_key_value_heads": 5, "head_dim": 128},
     "config: num_attention_heads (32) must be a multiple of num_key_value_heads (5)"),
    ({"num_attention_heads": 32, "hidden_size": 4100}, "config: hidden_size (4100) must be a multiple of "
                                                       "num_attention_heads (32)"),
    ({"num_attention_heads": 8, "head_dim": 64, "sliding_window": "4k"},
     "config: sliding_window must be a positive integer, got '4k'"),
    ({"num_attention_heads": 8, "head_dim": 64, "attn_logit_softcapping": -1},
     "config: attn_logit_softcapping must be a positive number, got -1"),
    ({"num_attention_heads": 8, "head_dim": 64, "num_hidden_layers": 2,
      "layer_types": ["chunked_attention", "full_attention"]},
     "config: layer_types[0] is 'chunked_attention', which AttentionSpec cannot express; allowed: full_attention, "
     "sliding_attention"),
    ({"num_attention_heads": 8, "head_dim": 64, "num_hidden_layers": 3, "sliding_window": 64,
      "layer_types": ["sliding_attention", "full_attention"]},
     "config: layer_types has 2 entries but num_hidden_layers is 3"),
    ({"num_attention_heads": 8, "head_dim": 64, "attention_chunk_size": 8192},
     "config: attention_chunk_size 8192: chunked attention, which AttentionSpec cannot express"),
    ({"num_attention_heads": 8, "head_dim": 64, "alibi": True}, "config: alibi True: ALiBi position biases"),
    ({"num_attention_heads": 8, "head_dim": 64, "torch_dtype": "float8_e4m3fn"},
     "config: torch_dtype 'float8_e4m3fn' is not supported; allowed: bf16, bfloat16"),
])
def test_bad_config_values_name_the_key(config, message):
    with pytest.raises(SpecError) as exc:
        layer_specs(config)
    assert str(exc.value).startswith(message)


def test_overrides_win_and_skip_the_config_value():
    fp8 = {"num_attention_heads": 8, "head_dim": 64, "torch_dtype": "float8_e4m3fn"}
    assert AttentionSpec.from_hf_config(fp8, dtype="bf16").dtype == "bf16"
    bad_heads = {"num_attention_heads": "32", "head_dim": 64}
    assert AttentionSpec.from_hf_config(bad_heads, num_q_heads=32).num_kv_heads == 32  # absent kv: one per q head
    # one window for every layer: the two kinds of Gemma 2 become one
    [(kind, spec, layers)] = layer_specs(CONFIGS / "gemma-2-27b.json", sliding_window=1024)
    assert (kind, spec.sliding_window, layers) == ("sliding_attention", 1024, list(range(46)))
    with pytest.raises(SpecError, match="unknown AttentionSpec field.s. window; allowed: num_q_heads"):
        layer_specs(CONFIGS / "gemma-2-27b.json", window=1024)


def test_config_directory(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3-8b.json").read_text())
    assert AttentionSpec.from_hf_config(tmp_path).num_kv_heads == 8
    with pytest.raises(SpecError, match=f"config: {tmp_path / 'empty'} is a directory without a config.json"):
        (tmp_path / "empty").mkdir()
        AttentionSpec.from_hf_config(tmp_path / "empty")


@pytest.mark.parametrize("config, kv_heads", [
    ({"model_type": "gpt_bigcode", "n_head": 48, "n_embd": 6144, "multi_query": True}, 1),  # StarCoder
    ({"model_type": "falcon", "num_attention_heads": 71, "hidden_size": 4544, "multi_query": True}, 1),  # Falcon 7B
    ({"model_type": "falcon", "num_attention_heads": 128, "hidden_size": 8192, "num_kv_heads": 8,
      "new_decoder_architecture": True, "multi_query": True}, 8),  # Falcon 40B
])
def test_multi_query_configs(config, kv_heads):
    assert AttentionSpec.from_hf_config(config).num_kv_heads == kv_heads


TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128)
BUILT = {
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(global_head_dim=32, sliding_window=8,
                                                             hidden_size_per_layer_input=8,
                                                             vocab_size_per_layer_input=128)),
    "gemma4-k-eq-v": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(global_head_dim=32, sliding_window=8,
                                                                    attention_k_eq_v=True,
                                                                    num_global_key_value_heads=1,
                                                                    hidden_size_per_layer_input=8,
                                                                    vocab_size_per_layer_input=128)),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                dict(layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=8,
                     num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                     laurel_rank=4, activation_sparsity_pattern=[0.0] * 6)),
    "gemma4-7-layers-bare": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(global_head_dim=32, sliding_window=8,
                                                                           num_hidden_layers=7,
                                                                           hidden_size_per_layer_input=8,
                                                                           vocab_size_per_layer_input=128)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=8, query_pre_attn_scalar=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=8, attn_logit_softcapping=30.0)),
}


@pytest.mark.parametrize("name", list(BUILT))
def test_layer_specs_agree_with_the_model_transformers_builds(name, tmp_path):
    """The reader against the attention modules transformers builds from the same config.json, layer by layer:
    head_dim, KV heads, softmax scale, window (Gemma 4's full-attention layers have their own head_dim and KV heads
    in per_layer_config, and Gemma 3n/4 attend with scale 1: was read as one head_dim and 1/sqrt(head_dim))."""
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra = BUILT[name]
    if not hasattr(transformers, config_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {config_cls}")
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    config.save_pretrained(tmp_path)
    if name.endswith("-bare"):  # a hand-written config.json: transformers derives layer kinds and head dims itself
        data = json.loads((tmp_path / "config.json").read_text())
        for key in ("layer_types", "per_layer_config"):
            data.pop(key)
        (tmp_path / "config.json").write_text(json.dumps(data))
        config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = getattr(transformers, model_cls)(config)
    by_layer = {i: spec for _, spec, layers in layer_specs(tmp_path) for i in layers}
    assert sorted(by_layer) == list(range(len(model.model.layers)))
    for i, layer in enumerate(model.model.layers):
        attn, spec = layer.self_attn, by_layer[i]
        assert spec.head_dim == attn.head_dim, i
        assert spec.num_kv_heads == config.num_attention_heads // attn.num_key_value_groups, i
        assert spec.scale == pytest.approx(attn.scaling), i
        assert spec.sliding_window == getattr(attn, "sliding_window", None), i
        assert spec.softcap == getattr(attn, "attn_logit_softcapping", None), i


def test_a_diffusion_gemma_config_is_refused():
    """diffusion_gemma's decoder attends both ways with scale 1: the reader does not describe it (it read a causal
    spec with 1/sqrt(head_dim)); refused with the model type named."""
    with pytest.raises(SpecError, match="model_type 'diffusion_gemma_text': a bidirectional"):
        layer_specs({"model_type": "diffusion_gemma_text", "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "num_hidden_layers": 2})


@pytest.mark.parametrize("given,stored", [("bfloat16", "bf16"), ("Float16", "fp16"), ("half", "fp16"),
                                          ("float", "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_dtype_takes_torchs_names_and_dtypes_as_the_cli_does(given, stored):
    """A dtype as torch names it (or the torch dtype itself) is stored in the short form: one spec, one cache key."""
    spec = AttentionSpec(8, 2, 64, dtype=given)
    assert spec.dtype == stored and spec == AttentionSpec(8, 2, 64, dtype=stored)
    assert spec.torch_dtype == DTYPES[stored]


@pytest.mark.parametrize("given", ["bf8", "int8", torch.float8_e4m3fn, torch.int32, 16, ["bf16"], None])
def test_a_dtype_attnsel_does_not_serve_names_the_allowed_ones(given):
    with pytest.raises(SpecError, match=r"dtype must be one of bf16, fp16, fp32 \(or torch's name"):
        AttentionSpec(8, 2, 64, dtype=given)
