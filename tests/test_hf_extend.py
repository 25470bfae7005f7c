"""Continuous batching's steps with a cached prefix read it in place through the extend phase
(``Selection.plan_extend``): a prompt longer than the batch's token budget (chunked prefill) and a request whose
prompt starts with blocks another request already computed (prefix sharing). No step gathers the cache into
contiguous keys and values, no call is handed back to transformers, and the tokens are transformers' own sdpa's in
float32. transformers 5.17 ("paged|attnsel", hf_extend) and the flash route of 5.24 and later ("attnsel_flash",
"attnsel/flash-attn": hf_extend_hook; .ci/run runs this file on the newest, 5.25)."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache import PagedAttentionCache  # noqa: E402

import attnsel  # noqa: E402
from attnsel.integrations import hf, hf_extend, hf_extend_hook, hf_kernels  # noqa: E402
from tests.fixtures.tiny_llama import greedy_deficits, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("inproc_worker")

PAGED = hf.paged_unsupported() is None  # 5.17: "paged|attnsel", transformers' own "paged|sdpa" as reference
if PAGED:
    ROUTES, REFERENCE, SKIP = [hf.PAGED_NAME], "paged|sdpa", None
else:
    ROUTES, REFERENCE = [hf_kernels.NAME, hf_kernels.KERNEL_NAME], "sdpa"
    SKIP = hf_extend_hook.unsupported()
SHARED = list(range(10, 50))  # 40 tokens: two full pages of 16 are shareable
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _registered(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hf-extend-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    hf.register(policy="priority", extend="torch")
    yield


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory, 64, "llama")


@dataclasses.dataclass
class Seen:
    """What the run did: the rows of every plan_extend (query tokens, whole context), the plans per phase, the
    cached tokens each cache.update read back (a gather when > 0), the prefix-sharing hits."""

    extend_rows: list = dataclasses.field(default_factory=list)
    plans: dict = dataclasses.field(default_factory=lambda: {"prefill": 0, "decode": 0, "extend": 0})
    gathered: list = dataclasses.field(default_factory=list)
    prefix_hits: list = dataclasses.field(default_factory=list)


@pytest.fixture
def seen(monkeypatch):
    out = Seen()
    for phase in out.plans:
        real = getattr(attnsel.Selection, f"plan_{phase}")

        def plan(self, *args, _real=real, _phase=phase, **kwargs):
            out.plans[_phase] += 1
            if _phase == "extend":
                cu_q, lens = args[0].tolist(), args[2].tolist()
                out.extend_rows.append([(b - a, n) for a, b, n in zip(cu_q, cu_q[1:], lens)])
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(attnsel.Selection, f"plan_{phase}", plan)
    if PAGED:  # 5.17: the paged forward calls cache.update, which gathers a non-empty read index
        real_update = PagedAttentionCache.update

        def update(self, key_states, value_states, layer_idx, read_index, write_index):
            group = self.layer_index_to_group_indices[layer_idx][0]
            out.gathered.append(read_index[group].numel())
            return real_update(self, key_states, value_states, layer_idx, read_index, write_index)

        monkeypatch.setattr(PagedAttentionCache, "update", update)
    else:  # 5.24+: the full-attention allocator's update gathers a non-empty read index
        from transformers.generation.continuous_batching.cache_allocators.full_attention import (
            FullAttentionCacheAllocator,
        )

        real_update = FullAttentionCacheAllocator.update

        def update(self, key_states, value_states, layer_idx, read_index, write_index):
            out.gathered.append(read_index.numel())
            return real_update(self, key_states, value_states, layer_idx, read_index, write_index)

        monkeypatch.setattr(FullAttentionCacheAllocator, "update", update)
    real_search = PagedAttentionCache.search_prefix_match

    def search(self, *args, **kwargs):
        found = real_search(self, *args, **kwargs)
        out.prefix_hits.append(found)
        return found

    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", search)
    return out


def cb_config(max_batch_tokens: int, sharing: bool, **more) -> ContinuousBatchingConfig:
    size = "block_size" if PAGED else "page_size"  # 5.25 still takes block_size, with a deprecation warning
    return ContinuousBatchingConfig(**{size: 16}, num_blocks=64, max_batch_tokens=max_batch_tokens,
                                    allow_block_sharing=sharing, **more)


def load(path, implementation, dtype=torch.float32, device="cpu"):
    return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation=implementation, dtype=dtype,
                                                         use_kernels=False).to(device).eval()


def generate(path, implementation, prompts, config, dtype=torch.float32, device="cpu") -> list:
    model = load(path, implementation, dtype, device)
    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                        eos_token_id=None)
    out = model.generate_batch(prompts, generation_config=gen, progress_bar=False, continuous_batching_config=config)
    assert model.config._attn_implementation == implementation  # not swapped for another implementation
    return [list(out[r].generated_tokens) for r in sorted(out, key=lambda r: int(r.split("_")[-1]))]


def route(name: str):
    if SKIP is not None:
        pytest.skip(f"transformers {transformers.__version__}: {SKIP}")
    if name == hf_kernels.KERNEL_NAME and hf_kernels.kernel_unsupported() is not None:
        pytest.skip(hf_kernels.kernel_unsupported())
    return name


def gathers_of(name: str) -> dict:
    """The steps with a cached prefix that attnsel gathered anyway, by reason (none expected)."""
    return dict((hf.default().prefix if name == hf.PAGED_NAME else hf_extend_hook.default()).gathered)


@pytest.mark.parametrize("name", ROUTES)
def test_chunked_prefill_reads_the_cache_through_extend(llama, seen, name):
    """A 50-token prompt with a budget of 16 tokens a step: its later chunks attend to the chunks before them in the
    cache; a short prompt decodes meanwhile."""
    name = route(name)
    prompts = [list(range(3, 53)), [7, 8, 9, 10, 11]]
    config = cb_config(16, sharing=False)
    expected = generate(llama, REFERENCE, prompts, config)
    seen.gathered.clear()
    got = generate(llama, name, prompts, cb_config(16, sharing=False))
    assert got == expected and all(len(t) == NEW_TOKENS for t in got)
    chunks = [(q, n) for rows in seen.extend_rows for q, n in rows if 1 < q < n]
    assert chunks, f"no chunk over a cached prefix went through plan_extend: {seen.extend_rows}"
    assert seen.plans["extend"] > 0 and not any(seen.gathered), f"gathered: {seen.gathered}"
    assert gathers_of(name) == {} and hf.fallbacks() == {}


@pytest.mark.parametrize("name", ROUTES)
def test_shared_prefix_reads_the_cache_through_extend(llama, seen, name):
    """The second prompt shares its first 32 tokens (two pages) with the first, whose first step computes them: the
    second request starts from those pages and its prefill attends to them in place."""
    name = route(name)
    prompts = [SHARED + [60, 61, 62, 63, 64, 65, 66, 67], SHARED + [70, 71, 72, 73, 74]]
    expected = generate(llama, REFERENCE, prompts, cb_config(32, sharing=True))
    seen.gathered.clear()
    seen.prefix_hits.clear()
    got = generate(llama, name, prompts, cb_config(32, sharing=True))
    assert got == expected and all(len(t) == NEW_TOKENS for t in got)
    assert 32 in seen.prefix_hits, f"transformers shared no prefix: {seen.prefix_hits}"
    shared = [(q, n) for rows in seen.extend_rows for q, n in rows if n - q == 32 and q == len(prompts[1]) - 32]
    assert shared, f"the shared-prefix request's prefill did not go through plan_extend: {seen.extend_rows}"
    assert not any(seen.gathered), f"gathered: {seen.gathered}"
    assert gathers_of(name) == {} and hf.fallbacks() == {}


@pytest.mark.parametrize("name", ROUTES)
def test_decode_steps_read_the_cache_in_place(llama, seen, name):
    """Decode-only steps are served by the decode phase in place (5.17 did so already; 5.24+ gathered them)."""
    name = route(name)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24]]
    expected = generate(llama, REFERENCE, prompts, cb_config(256, sharing=False))
    seen.gathered.clear()
    assert generate(llama, name, prompts, cb_config(256, sharing=False)) == expected
    assert seen.plans["decode"] > 0 and not any(seen.gathered), f"gathered: {seen.gathered}"




@pytest.mark.parametrize("name", ROUTES)
def test_captured_steps_plan_on_a_graph_mode_selection(llama, seen, monkeypatch, name):
    """CUDA-graph capture stood in for on the CPU (every call of the run counts as captured): each extend plan is made
    afresh on a selection asked for in mode "graph" with the same options (a real one needs CUDA: here the CPU's
    eager selection labelled "graph"), the page tables and plans are kept for the process, and the tokens do not
    change. The GPU test below captures for real."""
    name = route(name)
    from attnsel import flash_api

    asked, owner = [], hf if PAGED else flash_api
    real_select = owner.select

    def select(spec, prefill, decode, **options):
        asked.append(options.get("mode", "eager"))
        mode = options.pop("mode", "eager")
        return dataclasses.replace(real_select(spec, prefill, decode, **options), mode=mode)

    monkeypatch.setattr(owner, "select", select)
    modes = []
    real_plan = attnsel.Selection.plan_extend
    monkeypatch.setattr(attnsel.Selection, "plan_extend",
                        lambda self, *a, **kw: modes.append(self.mode) or real_plan(self, *a, **kw))
    prompts = [list(range(3, 53)), [7, 8, 9, 10, 11]]
    expected = generate(llama, REFERENCE, prompts, cb_config(16, sharing=False))
    if PAGED:
        monkeypatch.setattr(hf_extend, "capturing_now", lambda: True)
    else:
        monkeypatch.setattr(hf_extend_hook, "capturing_now", lambda: True)
        monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    seen.gathered.clear()
    assert generate(llama, name, prompts, cb_config(16, sharing=False)) == expected
    assert modes and set(modes) == {"graph"} and "graph" in asked, (modes, asked)
    kept = (hf.default().prefix if PAGED else hf_extend_hook.default().reads).captured
    assert len(kept) >= len(seen.extend_rows), "plans or tables made during capture must live as long as the process"
    assert not any(seen.gathered)


def test_a_prefix_left_in_the_cache_must_reach_attnsels_attention(monkeypatch):
    """The flash route's hook returns a layer's new keys without its cached prefix: the attention call that follows
    must be attnsel's. A second cache update before it, or an attention call with other keys, is an error that says
    so (never an attention over the new keys alone)."""
    if PAGED or SKIP is not None:
        pytest.skip(f"transformers {transformers.__version__}: no cache-update hook ({SKIP or '5.17: paged path'})")
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    pages = torch.zeros(4, 16, 2, 8)
    allocator = object.__new__(FullAttentionCacheAllocator)  # the attributes the hook reads, nothing else
    allocator.index, allocator.tokens_per_page, allocator._kv_page_views = 0, 16, {0: (pages, pages.clone())}
    allocator.layer_type = "full_attention"
    cache = type("Cache", (), {})()
    cache.config = type("Config", (), {"_attn_implementation": hf_kernels.NAME})()
    cache.layer_to_allocator = {0: allocator, 1: allocator}

    def kwargs():
        return {"read_index": [torch.arange(20)], "write_index": [torch.arange(17, 20)],
                "cu_seq_lens_k": {"full_attention": torch.tensor([0, 20], dtype=torch.int32)},
                "max_length_k": {"full_attention": 20}}

    state = hf_extend_hook.default()
    original = lambda *a: pytest.fail("transformers' update must not run for this layer")  # noqa: E731
    new = torch.randn(1, 2, 3, 8)
    assert state.update(original, cache, new, new, 0, kwargs()) == (new, new)
    assert torch.equal(pages.view(-1, 2, 8)[17:20], new[0].transpose(0, 1))  # written where transformers writes
    with pytest.raises(RuntimeError, match="layer 0 left its cached prefix .* but layer 1 updates the cache before"):
        state.update(original, cache, new, new, 1, kwargs())
    assert state.take(torch.zeros(3, 2, 8)) is None  # the error is not sticky: nothing waits any more
    state.update(original, cache, new, new, 0, kwargs())
    with pytest.raises(RuntimeError, match="returned its 3 new keys, but the attention call that followed got 5"):
        state.take(torch.zeros(5, 2, 8))
    assert state.take(torch.zeros(3, 2, 8)) is None


def test_a_forward_pass_that_ended_early_does_not_poison_the_next(monkeypatch, caplog):
    """A forward pass that raises between a layer's cache update and its attention call (out of memory, an
    interrupt) leaves that layer waiting; the next pass's first update starts afresh with a warning instead of
    refusing every later step (the server would be dead after one transient error)."""
    if PAGED or SKIP is not None:
        pytest.skip(f"transformers {transformers.__version__}: no cache-update hook ({SKIP or '5.17: paged path'})")
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    pages = torch.zeros(4, 16, 2, 8)
    allocator = object.__new__(FullAttentionCacheAllocator)
    allocator.index, allocator.tokens_per_page, allocator._kv_page_views = 0, 16, {0: (pages, pages.clone()),
                                                                               1: (pages.clone(), pages.clone())}
    allocator.layer_type = "full_attention"
    cache = type("Cache", (), {})()
    cache.config = type("Config", (), {"_attn_implementation": hf_kernels.NAME})()
    cache.layer_to_allocator = {0: allocator, 1: allocator}
    kwargs = lambda: {"read_index": [torch.arange(20)], "write_index": [torch.arange(17, 20)],  # noqa: E731
                      "cu_seq_lens_k": {"full_attention": torch.tensor([0, 20], dtype=torch.int32)},
                      "max_length_k": {"full_attention": 20}}
    state = hf_extend_hook.default()
    original = lambda *a: pytest.fail("transformers' update must not run for this layer")  # noqa: E731
    new = torch.randn(1, 2, 3, 8)
    state.update(original, cache, new, new, 1, kwargs())  # layer 1's attention never comes: the pass raised
    with caplog.at_level("WARNING"):
        for _ in range(2):  # the next passes: each layer's update is followed by its attention call
            for layer in (0, 1):
                state.update(original, cache, new, new, layer, kwargs())
                assert state.take(torch.zeros(3, 2, 8)).layer_idx == layer
    assert "layer 1's attention call never came" in caplog.text


# --- on the GPU: bf16, attnsel's own kernels, and on the flash route CUDA graphs --------------------------------------

GPU_CASES = [pytest.param(name, graphs, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
    for name in ROUTES for graphs in ((False,) if PAGED else (False, True))]  # 5.17's paged path is not captured


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    """A tiny random Llama with head_dim 64 (FA3 serves 64 and up)."""
    return save_tiny_llama(tmp_path_factory, 256, "llama64")


def near_greedy(path, prompts, tokens) -> None:
    """Every generated token is the float32 model's greedy choice within bf16's error: its float32 logit at most
    4 x (the largest |bf16 SDPA logit - float32 logit| on these sequences) + 1e-3 below the best one. (bf16 tokens
    are not compared with transformers' own: a random tiny model has near ties that bf16 flips.)"""
    ref, low = load(path, "eager", torch.float32, "cuda"), load(path, "sdpa", torch.bfloat16, "cuda")
    deficits, error = greedy_deficits(ref, low, prompts, tokens)
    worst = max((max(d) for d in deficits if d), default=0.0)
    assert worst <= 4 * error + 1e-3, f"a chosen token's float32 logit is {worst:.4f} below the best"


@pytest.mark.parametrize("name,graphs", GPU_CASES)
def test_gpu_cached_prefix_through_extend(llama64, seen, monkeypatch, name, graphs):
    """bf16 on the GPU, FA3 or Triton for prefill and extend: a chunked prompt and a shared prefix in one run. The
    extend phase serves them, nothing is gathered or handed back; with CUDA graphs (transformers >= 5.24's flash route
    captures by default) every captured plan was made on the selection in mode "graph"."""
    name = route(name)
    monkeypatch.delenv("ATTNSEL_PREFILL_BACKEND")
    monkeypatch.delenv("ATTNSEL_DECODE_BACKEND")
    hf.register(policy="priority", prefill_priority=["fa3", "triton"], extend_priority=["fa3", "triton"])
    modes = []
    real = attnsel.Selection.plan_extend

    def plan(self, *args, **kwargs):
        modes.append((self.mode, torch.cuda.is_current_stream_capturing()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(attnsel.Selection, "plan_extend", plan)
    prompts = [list(range(3, 53)), SHARED + [60, 61, 62, 63, 64, 65, 66, 67], SHARED + [70, 71, 72, 73, 74]]
    more = {} if PAGED else {"use_cuda_graph": graphs}
    tokens = generate(llama64, name, prompts, cb_config(32, sharing=True, **more), torch.bfloat16, "cuda")
    print(f"extend plans (selection mode, captured): {modes}")
    assert all(len(t) == NEW_TOKENS for t in tokens)
    assert modes and not any(seen.gathered), f"gathered: {seen.gathered}"
    assert gathers_of(name) == {} and hf.fallbacks() == {}
    assert all(mode == ("graph" if captured else "eager") for mode, captured in modes), modes
    assert any(captured for _, captured in modes) == graphs
    near_greedy(llama64, prompts, tokens)
