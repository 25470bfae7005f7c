"""transformers integration: tiny random models (no downloads) generate the same tokens as sdpa."""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig, StaticCache  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache import (  # noqa: E402
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
)

from attnsel.integrations import hf  # noqa: E402

# The selections the models make validate in a worker thread (tests/fixtures/inproc_worker.py).
pytestmark = pytest.mark.usefixtures("inproc_worker")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24]]
NEW_TOKENS = 32


def tiny(kind: str, **extra):
    common = dict(vocab_size=256, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":  # GQA 7:1 like Qwen2-7B's 28/4 heads
        cfg = transformers.Qwen2Config(hidden_size=224, num_attention_heads=28, num_key_value_heads=4,
                                       use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.MistralConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                         sliding_window=extra.pop("sliding_window", None), **common)
        cls = transformers.MistralForCausalLM
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cls, cfg


@pytest.fixture
def saved(tmp_path):
    def make(kind, **extra):
        cls, cfg = tiny(kind, **extra)
        torch.manual_seed(0)
        cls(cfg).eval().save_pretrained(tmp_path / kind)
        return cls, str(tmp_path / kind)

    return make


def padded_batch():
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    return ids, (ids != 0).long()


def dense_pair(cls, path, dtype=torch.float32):
    ref = cls.from_pretrained(path, attn_implementation="sdpa", dtype=dtype).eval()
    ours = cls.from_pretrained(path, attn_implementation="attnsel", dtype=dtype).eval()
    return ref, ours


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("attnsel-cache")


@pytest.fixture(autouse=True)
def _registered(shared_cache, monkeypatch):
    """One validation per spec for the whole file (the tests here are about the integration, not the cache)."""
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(shared_cache))
    hf.register(policy="priority")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_generation_matches_sdpa(saved, kind, caplog):
    cls, path = saved(kind)
    ref, ours = dense_pair(cls, path)
    ids, mask = padded_batch()
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with caplog.at_level(logging.INFO, logger="attnsel"):
        expected = ref.generate(input_ids=ids, attention_mask=mask, **gen)
        got = ours.generate(input_ids=ids, attention_mask=mask, **gen)
    assert torch.equal(expected, got)
    assert "prefill: torch, decode: torch, extend: torch" in caplog.text  # the selection is logged (CPU: torch wins)
    assert hf.fallbacks() == {} and "handing the call back" not in caplog.text
    la = ref(input_ids=ids, attention_mask=mask).logits
    lb = ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(lb[real], la[real], rtol=1e-4, atol=1e-4)


def test_triton_kernels_in_the_dense_path(saved, monkeypatch):
    """The dense path on the Triton kernels (interpreted on CPU), fp16: logits of a prefill and a decode step."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU run")
    hf.register(prefill="triton", decode="triton", policy="priority")
    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path, dtype=torch.float16)
    ids, mask = padded_batch()
    out = ref(input_ids=ids, attention_mask=mask, use_cache=True)
    ours_out = ours(input_ids=ids, attention_mask=mask, use_cache=True)
    real = mask.bool()
    torch.testing.assert_close(ours_out.logits[real].float(), out.logits[real].float(), rtol=2e-2, atol=2e-2)
    step = torch.tensor([[3], [4], [5]])
    mask2 = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    a = ref(input_ids=step, attention_mask=mask2, past_key_values=out.past_key_values).logits
    b = ours(input_ids=step, attention_mask=mask2, past_key_values=ours_out.past_key_values).logits
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
    assert any(p.decode for p in hf.default().dense_steps.plans.values())  # the one-token step used the paged decode API
    assert hf.fallbacks() == {}


def test_static_cache_generate_and_forward_match_sdpa(saved):
    """StaticCache: generate(cache_implementation="static") failed at its first decode step, and a forward with a
    StaticCache and no mask attended over the empty static slots (logits off by 7.3)."""
    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path)
    ids, mask = padded_batch()
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, **gen),
                       ref.generate(input_ids=ids, attention_mask=mask, **gen))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        outs = [m(input_ids=prompt, past_key_values=StaticCache(config=m.config, max_cache_len=40))
                for m in (ref, ours)]
        steps = [m(input_ids=torch.tensor([[3]]), past_key_values=o.past_key_values).logits
                 for m, o in zip((ref, ours), outs)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-4, atol=1e-4)
    assert hf.fallbacks() == {}


@pytest.mark.parametrize("name", ["attn_bias_scale", "tokenizer"])
def test_unknown_argument_is_handed_back_to_transformers(saved, caplog, name):
    """An argument attnsel does not know (here a model-level keyword that reaches every attention call) hands the
    call back to transformers' own attention, named once in the log, never dropped; so does a tensor under the name
    of one of generate's own objects (not the object generate passes: a model's input of that name)."""
    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path)
    ids, mask = padded_batch()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="attnsel"):
        got = ours(input_ids=ids, attention_mask=mask, **{name: torch.ones(1)}).logits
        again = ours(input_ids=ids, attention_mask=mask, **{name: torch.ones(1)}).logits
    expected = ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, got)
    reason = f"argument {name}=tensor[1] (not implemented by attnsel)"
    assert hf.fallbacks() == {reason: 4}  # 2 layers x 2 calls
    assert caplog.text.count(reason) == 1


def word_tokenizer():
    """A WordLevel tokenizer over the tiny models' 256 ids; "abcdef" is a word (StopStringCriteria tokenizes it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "<unk>", "abcdef"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(256 - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>")


def test_generate_with_a_tokenizer_is_served(saved, caplog):
    """generate(tokenizer=tok, stop_strings=[...]) (and transformers' server, which always passes its tokenizer):
    generate's decoding loop forwards the tokenizer to every forward and the model to every attention call. It does
    not change the attention: every call is served by attnsel (it was handed back to the model's eager attention,
    with the same tokens), counted per spec."""
    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path)
    ids, mask = padded_batch()
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, tokenizer=word_tokenizer(),
               stop_strings=["w40 w41", "abcdef"])
    with caplog.at_level(logging.INFO, logger="attnsel"):
        expected = ref.generate(input_ids=ids, attention_mask=mask, **gen)
        got = ours.generate(input_ids=ids, attention_mask=mask, **gen)
    assert torch.equal(expected, got)
    assert hf.fallbacks() == {} and "handing the call back" not in caplog.text
    forwards = got.shape[1] - ids.shape[1]  # one forward per new token: 2 layers each
    assert {s.describe(): n for s, n in hf.served().items()} == {"4/2 heads, head_dim 16, fp32, page 16": 2 * forwards}


def test_generate_only_arguments_are_those_transformers_generate_takes():
    """hf_calls.GENERATE_ONLY is what transformers' generate takes for its decoding loop (and may forward to the
    model): the keys of GenerationMixin._extract_generation_mode_kwargs with every one given."""
    from transformers.generation.utils import GenerationMixin

    from attnsel.integrations import hf_calls

    kwargs = {"tokenizer": object(), "assistant_tokenizer": object(), "max_new_tokens": 3}
    taken = GenerationMixin._extract_generation_mode_kwargs(None, None, kwargs, synced_gpus=False,
                                                            assistant_model=object(), streamer=object())
    assert set(taken) == hf_calls.GENERATE_ONLY
    assert kwargs == {"max_new_tokens": 3}  # the rest go to the model as its own arguments


def test_mask_pattern_attnsel_does_not_serve_is_handed_back(saved):
    """Packed sequences (position ids restarting, no mask, no cache) make transformers' mask block-diagonal: the
    mask function returns transformers' own 4D mask and the calls are handed back, not served as one causal row."""
    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path)
    ids = torch.tensor([[5, 6, 7, 8, 20, 21, 22]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        expected = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        separate = ref(input_ids=ids[:, 4:], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:, 4:], separate, rtol=1e-4, atol=1e-4)  # the second sequence saw only itself
    assert list(hf.fallbacks()) == ["a 4D attention mask (a custom mask, or a mask pattern attnsel does not serve: "
                                    "chunked, packed sequences, bidirectional, overlays)"]


@pytest.mark.skipif(hf.paged_unsupported() is not None, reason="paged path needs transformers 5.17")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_continuous_batching_matches_paged_sdpa(saved, kind, monkeypatch):
    """Also with NaN in every cache slot no sequence has written (transformers allocates the paged cache with
    torch.empty: this test was flaky when such garbage was read and multiplied by a zero weight)."""
    if not torch.cuda.is_available():
        # transformers sizes the paged cache from free GPU memory and finds none on a CPU machine
        monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)
    real_init = PagedAttentionCache.__init__

    def nan_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        for cache in (*self.key_cache, *self.value_cache):  # all but the zeroed read-trash block
            cache.view(self.num_blocks + 2, self.block_size, *cache.shape[1:])[: self.num_blocks].fill_(float("nan"))

    monkeypatch.setattr(PagedAttentionCache, "__init__", nan_init)
    calls = []
    real_page_table = hf.paged_page_table
    monkeypatch.setattr(hf, "paged_page_table", lambda *a: calls.append(1) or real_page_table(*a))
    cls, path = saved(kind)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=256)  # decode spans pages
    outs = {}
    for name in ("paged|sdpa", "paged|attnsel"):
        model = cls.from_pretrained(path, attn_implementation=name).eval()
        res = model.generate_batch(inputs=PROMPTS, generation_config=gen, continuous_batching_config=cb)
        outs[name] = [[int(t) for t in res[k].generated_tokens] for k in sorted(res)]
    assert outs["paged|attnsel"] == outs["paged|sdpa"]
    assert all(len(t) == NEW_TOKENS for t in outs["paged|attnsel"])
    assert calls, "decode steps never took the in-place paged decode path"


def test_paged_name_without_cache_is_a_clear_error(saved):
    cls, path = saved("llama")
    if hf.paged_unsupported():
        pytest.skip(hf.paged_unsupported())
    model = cls.from_pretrained(path, attn_implementation="paged|attnsel").eval()
    with pytest.raises(ValueError, match="paged\\|attnsel was called without a paged attention cache"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_select_for_model_selects_what_the_calls_ask(saved):
    """select_for_model runs the selection for the spec the attention calls have (heads, head dim and dtype of the
    tensors), at the page size asked, and leaves a paged model's implementation as it was."""
    cls, path = saved("qwen2")
    names = ["attnsel"] + ([] if hf.paged_unsupported() else ["paged|attnsel"])
    for name in names:
        model = cls.from_pretrained(path, attn_implementation=name).eval()
        sel = hf.select_for_model(model, page_size=32)
        assert (sel.spec.num_q_heads, sel.spec.num_kv_heads, sel.spec.head_dim, sel.spec.dtype,
                sel.spec.page_size) == (28, 4, 8, "fp32", 32)
        assert model.config._attn_implementation == name
    assert hf.fallbacks() == {}


def test_model_spec_from_the_config():
    cls, cfg = tiny("qwen2")
    spec = hf.model_spec(cfg, torch.bfloat16, 256)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.page_size) == (28, 4, 8, "bf16", 256)
    with pytest.raises(ValueError, match="dtype must be one of"):
        hf.model_spec(cfg, torch.int8, 16)


def test_static_generate_under_transformers_auto_compile(saved):
    """On CUDA, generate with a StaticCache compiles the model's forward; attnsel's host-side planning must run
    eagerly inside it (dynamo failed tracing it). Dynamo with the eager backend, forced on the CPU."""
    from transformers.generation.configuration_utils import CompileConfig

    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path)
    ids, mask = padded_batch()
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static",
               compile_config=config)
    with torch.no_grad():
        assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, **gen),
                           ref.generate(input_ids=ids, attention_mask=mask, **gen))
    assert hf.fallbacks() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_static_generate_on_gpu_with_default_auto_compile(saved):
    """On CUDA transformers compiles static-cache generation by default (inductor, CUDA graphs): attnsel's calls run
    eagerly between the compiled regions and give sdpa's tokens (float32: the backends attnsel selects for it)."""
    cls, path = saved("llama")
    ref, ours = (m.to("cuda") for m in dense_pair(cls, path))
    ids, mask = (t.cuda() for t in padded_batch())
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, **gen),
                           ref.generate(input_ids=ids, attention_mask=mask, **gen))
    assert hf.fallbacks() == {}


def test_step_plans_make_a_replaced_plan_again():
    """Within a step, each layer kind keeps its plan; on a backend with one plan per phase (a plugin) the sliding
    layers' plan replaces the global layers' one, so the next global layer must plan again instead of calling a
    stale run function (which raises). Plans that are still current are reused."""
    cuda = torch.device("cuda")  # the plans are per step on CUDA only; nothing here touches the device
    steps, live, made = hf._StepPlans(), [0], []

    def make(kind):
        def plan():
            live[0] += 1
            mine = live[0]
            run = lambda: kind  # noqa: E731
            run.current = lambda: live[0] == mine
            made.append(kind)
            return run
        return plan

    for layer, kind in enumerate(["global", "sliding", "global", "global", "sliding"]):
        assert steps.get(layer, kind, make(kind), cuda)() == kind
    assert made == ["global", "sliding", "global", "sliding"]  # layer 3 reused layer 2's plan


@pytest.mark.parametrize("how", ["config", "argument"])
def test_non_causal_call_without_mask_is_handed_back_bidirectional(saved, how):
    """A non-causal call (config.is_causal False, or is_causal=False passed down) with no attention mask is handed
    back, and transformers' path must then attend both ways, as the sdpa model does (it was computed as causal)."""
    cls, path = saved("llama")
    ref, ours = dense_pair(cls, path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]])
    extra = {"is_causal": False} if how == "argument" else {}
    if how == "config":
        for m in (ref, ours):
            m.config.is_causal = False
            for layer in m.model.layers:
                layer.self_attn.is_causal = False
    with torch.no_grad():
        got = ours(input_ids=ids, use_cache=False, **extra).logits
        expected = ref(input_ids=ids, use_cache=False, **extra).logits
        causal = ref(input_ids=ids, use_cache=False).logits if how == "argument" else None
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if causal is not None:  # the argument really changes the answer (else the test would prove nothing)
        assert (expected - causal).abs().max() > 1e-2
    assert list(hf.fallbacks()) == ["non-causal attention"]


def test_attention_mask_of_another_batch_size_is_refused(saved):
    """A [1, S] mask for a batch of 2 left row 1 without queries (its output silently zero): a clear error now."""
    cls, path = saved("llama")
    _, ours = dense_pair(cls, path)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    for rows in (1, 3):
        with torch.no_grad(), pytest.raises(ValueError, match=rf"attention mask of shape \[{rows}, 4\] for a batch "
                                                             r"of 2, .*expected \[2, n\]"):
            ours(input_ids=ids, attention_mask=torch.ones(rows, 4, dtype=torch.long), use_cache=False)


def test_no_continuous_batching_route_is_a_warning_not_an_error(monkeypatch, caplog):
    """On a transformers whose lazy flash import has a signature the flash route does not know (and which refuses
    paged|attnsel), register() keeps the dense path, registers nothing for continuous batching and warns why; it
    does not raise RuntimeError (it did: hf_kernels.register's refusal came through)."""
    import transformers
    from transformers import modeling_flash_attention_utils as mfau

    from attnsel.integrations import hf_kernels

    monkeypatch.setattr(hf_kernels, "kernel_unsupported", lambda: "not in this test")  # no local kernel repository
    monkeypatch.setattr(transformers, "__version__", "5.30.0")
    original = getattr(mfau._lazy_imports, "_attnsel_original", mfau._lazy_imports)
    monkeypatch.setattr(mfau, "_lazy_imports", lambda implementation, extra=None: original(implementation))
    with caplog.at_level(logging.WARNING, logger="attnsel"):
        assert hf.register(policy="priority") == ["attnsel"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no continuous batching" in m and "5.30.0" in m and "is not the known" in m for m in warned), warned
    with pytest.raises(RuntimeError, match="is not the known"):
        hf_kernels.register()


def test_registration_state_lives_in_an_object():
    """No mutable state at module level: options, selections, counts and step plans belong to an HFAttention; the
    registered functions use the default instance, which register() configures (and counts from zero again)."""
    assert mutable_globals(hf) == []
    state = hf.default()
    hf.register("torch", "torch", policy="priority")
    assert hf.default() is state and state.options == {"policy": "priority", "prefill": "torch", "decode": "torch"}
    state.counts.fall_back("a reason")
    assert hf.fallbacks() == {"a reason": 1}
    generation = state.generation
    hf.register()
    assert hf.fallbacks() == {} and state.options == {} and state.generation == generation + 1
    assert hf.HFAttention().options == {} and hf.HFAttention().counts is not state.counts


def mutable_globals(module) -> list[str]:
    """The names a module assigns at its top level to a dict, list or set (imported names are not its state)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    names = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
    return [n for n in names if isinstance(getattr(module, n), (dict, list, set))]
