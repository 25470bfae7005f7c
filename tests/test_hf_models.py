"""transformers model families through attnsel: served exactly (no hand-back) or handed back to transformers' own
attention, never silently different. Tiny random models (no downloads), float32 on the CPU, eager as the reference
(transformers' SDPA ignores sinks and softcap)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler  # noqa: E402

from attnsel import SelectionError  # noqa: E402
from attnsel.integrations import hf  # noqa: E402

# The selections the models make validate in a worker thread (tests/fixtures/inproc_worker.py).
pytestmark = pytest.mark.usefixtures("inproc_worker")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24]]
COMMON = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=None, initializer_range=0.2)
SMALL = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def family(kind: str):
    """(config, model class) of a tiny model of one family; windows shorter than the longest prompt (11 tokens).
    Gemma's tied, scaled embeddings make a tiny random model repeat its last token whatever the attention computes:
    untied here, so that greedy tokens depend on the attention."""
    if kind == "mistral":  # one window for every layer, shorter than the prompt
        return transformers.MistralConfig(sliding_window=6, **SMALL, **COMMON), transformers.MistralForCausalLM
    if kind == "gemma2":  # softcap, alternating window, query_pre_attn_scalar scale
        return (transformers.Gemma2Config(head_dim=16, sliding_window=4, attn_logit_softcapping=1.0,
                                          query_pre_attn_scalar=24, tie_word_embeddings=False, **SMALL, **COMMON),
                transformers.Gemma2ForCausalLM)
    if kind == "gemma3":  # sliding and full layers
        return (transformers.Gemma3TextConfig(head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                              layer_types=["sliding_attention", "full_attention"],
                                              tie_word_embeddings=False, **SMALL, **COMMON),
                transformers.Gemma3ForCausalLM)
    if kind == "gpt_oss":  # attention sinks (s_aux), alternating window
        return (transformers.GptOssConfig(head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                          **SMALL, **COMMON),
                transformers.GptOssForCausalLM)
    if kind == "deepseek_v3":  # MLA: config head_dim 8, q/k head dim 24, v head dim 16
        return (transformers.DeepseekV3Config(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                              num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None,
                                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                              first_k_dense_replace=1, head_dim=8, **COMMON),
                transformers.DeepseekV3ForCausalLM)
    raise ValueError(kind)


def pair(kind: str, reference: str = "eager"):
    """The same random weights twice: transformers' reference implementation and attnsel (separate configs: the
    attention implementation lives on the config)."""
    cfg, cls = family(kind)
    torch.manual_seed(0)
    ref = cls(copy.deepcopy(cfg)).eval()
    ours = cls(copy.deepcopy(cfg)).eval()
    ours.load_state_dict(ref.state_dict())
    ref.set_attn_implementation(reference)
    ours.set_attn_implementation("attnsel")
    return ref, ours


def padded_batch():
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    return ids, (ids != 0).long()


def assert_same_model_outputs(ref, ours, static: bool = True):
    """Logits of a padded prefill and of decode steps within float32 tolerance; greedy tokens identical (dynamic
    cache, and StaticCache when ``static``)."""
    ids, mask = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=ref.config))
        b = ours(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=ours.config))
        torch.testing.assert_close(b.logits[real], a.logits[real], rtol=1e-4, atol=1e-4)
        step, mask2 = torch.tensor([[3], [4], [5]]), torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        sa = ref(input_ids=step, attention_mask=mask2, past_key_values=a.past_key_values).logits
        sb = ours(input_ids=step, attention_mask=mask2, past_key_values=b.past_key_values).logits
        torch.testing.assert_close(sb, sa, rtol=1e-4, atol=1e-4)
        gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, **gen),
                           ref.generate(input_ids=ids, attention_mask=mask, **gen))
        if static:
            assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **gen),
                               ref.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **gen))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("attnsel-cache")


@pytest.fixture(autouse=True)
def _registered(shared_cache, monkeypatch):
    """One validation per spec for the whole file (the tests here are about the integration, not the cache)."""
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(shared_cache))
    hf.register(policy="priority")


@pytest.fixture
def no_backend_serves_features(monkeypatch):
    """Selection fails for any spec with a feature (window, softcap, sinks), as before the backends had them."""
    real = hf.select

    def select(spec, *args, **kwargs):
        if spec.features():
            raise SelectionError(f"no backend can serve prefill: {', '.join(spec.features())} (test)")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(hf, "select", select)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3", "gpt_oss"])
def test_family_is_served_exactly(kind):
    """Sliding windows, softcap, query_pre_attn_scalar and sinks reach the backends: no attention call is handed
    back, and the model computes what eager computes."""
    ref, ours = pair(kind)
    assert_same_model_outputs(ref, ours)
    assert hf.fallbacks() == {}
    kinds = {(s.sliding_window, s.softcap, s.sinks, s.softmax_scale) for s, _ in hf.default().selections}
    assert len(kinds) == (1 if kind == "mistral" else 2)  # one spec per layer kind


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_features_no_backend_serves_are_handed_back(kind, no_backend_serves_features):
    """A tiny gpt-oss (sinks via s_aux) and Gemma 2 (softcap) ran through attnsel with logits off by 0.65-4.25
    before: arguments attnsel could not serve were dropped. Now their calls go to the model's own eager attention."""
    ref, ours = pair(kind)
    assert_same_model_outputs(ref, ours, static=False)
    reasons = hf.fallbacks()
    assert reasons and all("no attnsel backend serves" in r for r in reasons), reasons
    assert any(("attention sinks" if kind == "gpt_oss" else "softcap 1") in r for r in reasons), reasons


def test_mla_value_head_dim_is_handed_back():
    """DeepSeek-V3 (MLA): config head_dim 8, q/k 24, v 16; the spec used to come from the config and crashed."""
    ref, ours = pair("deepseek_v3")
    assert_same_model_outputs(ref, ours)
    assert list(hf.fallbacks()) == ["head dims differ: query 24, key 24, value 16 (no attnsel backend serves that)"]


# --- continuous batching (paged) ------------------------------------------------------------------------------------

def paged_tokens(model, new_tokens: int = 8) -> list[list[int]]:
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=256)
    res = model.generate_batch(inputs=PROMPTS, generation_config=gen, continuous_batching_config=cb)
    return [[int(t) for t in res[k].generated_tokens] for k in sorted(res)]


def eager_tokens(model, new_tokens: int = 8) -> list[list[int]]:
    """Greedy tokens of each prompt alone (no padding) with the model's eager attention: the paged reference."""
    with torch.no_grad():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.fixture
def cpu_paged_cache(monkeypatch):
    if hf.paged_unsupported():
        pytest.skip(hf.paged_unsupported())
    if not torch.cuda.is_available():  # transformers sizes the paged cache from free GPU memory
        monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3", "gpt_oss"])
def test_paged_family_is_served_exactly(kind, cpu_paged_cache):
    ref, ours = pair(kind)
    expected = eager_tokens(ref)
    ours.set_attn_implementation("paged|attnsel")
    assert paged_tokens(ours) == expected
    assert hf.fallbacks() == {}


def test_paged_features_no_backend_serves_are_handed_back(cpu_paged_cache, no_backend_serves_features):
    """Paged gpt-oss without a backend for sinks: the model's eager attention on the keys the paged cache gathers
    (transformers' paged|sdpa would drop the sinks)."""
    ref, ours = pair("gpt_oss")
    expected = eager_tokens(ref)
    ours.set_attn_implementation("paged|attnsel")
    assert paged_tokens(ours) == expected
    assert hf.fallbacks() and all(r.endswith("(paged)") for r in hf.fallbacks())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3", "gpt_oss"])
def test_family_on_gpu_in_bf16(kind, caplog):
    """The families on CUDA in bf16 through the automatically selected kernels: no call handed back, and logits as
    close to the float32 eager model as transformers' own bf16 eager attention is (x2 + 0.01). Policy priority
    (the autouse registration): the first valid backend per phase, validated on this GPU."""
    ref, ours = pair(kind)
    ref32 = ref.to("cuda")
    ids, mask = (t.cuda() for t in padded_batch())
    real = mask.bool()
    with torch.no_grad():
        exact = ref32(input_ids=ids, attention_mask=mask).logits[real].float()
        eager16 = ref32.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[real].float()
        with caplog.at_level("INFO", logger="attnsel"):
            got = ours.to("cuda", torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[real].float()
    budget = 2 * (eager16 - exact).abs().max().item() + 1e-2
    err = (got - exact).abs().max().item()
    print(f"{kind}: max |attnsel bf16 - eager fp32| = {err:.4f}, eager bf16: {budget / 2 - 5e-3:.4f}; "
          + "; ".join(line for line in caplog.text.splitlines() if "attnsel for" in line))
    assert hf.fallbacks() == {}
    assert err <= budget
