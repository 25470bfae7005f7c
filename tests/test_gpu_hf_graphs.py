"""transformers' continuous batching with CUDA graphs through attnsel ("attnsel_flash", transformers >= 5.18, bf16 on
the GPU). transformers captures by default for flash-named attention: each batch shape runs once eagerly, then is
captured; later steps of that shape replay after transformers rewrote cu_seqlens in place. The captured calls must
plan on a selection made in mode "graph" (attnsel/graph_selection.py) and the replays must compute the new batches.

Judged twice: the tokens equal those of the same route with CUDA graphs off (same backend, so the same numerics up to
the padding transformers adds for graphs; from 5.24 the eager decode steps read the cache through the decode phase
and the padded captured ones through the extend phase, other kernels: there both runs are judged as follows), and
every token is greedy within bf16's error under an independent float32
model fed the generated sequence (the budget: 4 x the error of transformers' own bf16 SDPA on those sequences).
bf16 tokens are not compared with transformers' own attention's: a random tiny model has near ties that bf16 flips
(on the CPU, transformers' own bf16 sdpa and eager differ on 3 of these 4 prompts)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from attnsel import Selection, flash_api  # noqa: E402
from attnsel.integrations import hf, hf_extend_hook, hf_kernels  # noqa: E402
from tests.fixtures.tiny_llama import greedy_deficits, save_tiny_llama  # noqa: E402

MINOR = tuple(int(x) for x in transformers.__version__.split(".")[:2])
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(MINOR < (5, 18), reason=f"transformers {transformers.__version__}: continuous "
                                 "batching captures CUDA graphs for flash-named attention from 5.18")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24], [7] * 19]
NEW_TOKENS = 16
GRAPH_SAFE = {"fa3", "triton"}  # the prefill backends these tests let graph mode choose


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama with head_dim 64 (FA3 serves 64 and up), saved once."""
    return save_tiny_llama(tmp_path_factory, 256, "llama")


@pytest.fixture(autouse=True)
def _fresh(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hf_graphs_cache"))  # one per module
    monkeypatch.delenv("ATTNSEL_PREFILL_BACKEND", raising=False)
    monkeypatch.delenv("ATTNSEL_DECODE_BACKEND", raising=False)
    yield
    flash_api.configure()


def load(path, implementation, dtype=torch.bfloat16):
    return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation=implementation,
                                                         dtype=dtype).to("cuda").eval()


def batch_tokens(model, graphs: bool) -> list[list[int]]:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256, use_cuda_graph=graphs)
    out = model.generate_batch(PROMPTS, generation_config=gen, progress_bar=False, continuous_batching_config=cb)
    return [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.split("_")[-1]))]


def watch(monkeypatch) -> tuple[dict, list]:
    """(attnsel's varlen calls by capture state, every plan: (phase, selection mode, the phase's backend, made in
    capture)). Steps with a cached prefix (decodes) plan extend (hf_extend_hook), fresh prompts prefill."""
    calls, plans = {"eager": 0, "captured": 0}, []
    real_call = flash_api.flash_attn_varlen_func

    def call(*args, **kwargs):
        calls["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
        return real_call(*args, **kwargs)

    monkeypatch.setattr(flash_api, "flash_attn_varlen_func", call)
    for phase in ("prefill", "decode", "extend"):
        real_plan = getattr(Selection, f"plan_{phase}")

        def plan(self, *args, _real=real_plan, _phase=phase, **kwargs):
            plans.append((_phase, self.mode, getattr(self, _phase), torch.cuda.is_current_stream_capturing()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Selection, f"plan_{phase}", plan)
    return calls, plans


def selections() -> dict:
    """flash_api's selections by mode ("configured" or "graph")."""
    return {("graph" if key[2] == "graph" else "configured"): sel
            for key, sel in flash_api.default()._selections.items()}


def assert_near_greedy(path, tokens):
    """Every generated token is the float32 model's greedy choice within bf16's error: its float32 logit is at most
    4 x (the largest |bf16 SDPA logit - float32 logit| on these sequences) + 1e-3 below the best one."""
    ref, low = load(path, "eager", torch.float32), load(path, "sdpa")
    deficits, error = greedy_deficits(ref, low, PROMPTS, tokens)
    budget = 4 * error + 1e-3
    worst = max(max(d) for d in deficits)
    print(f"float32 deficit of the chosen tokens: worst {worst:.4f}, budget {budget:.4f}; "
          f"{sum(x == 0 for d in deficits for x in d)} of {NEW_TOKENS * len(PROMPTS)} exactly greedy")
    assert worst <= budget, f"per-prompt deficits {[[round(x, 3) for x in d] for d in deficits]}"


def test_generate_batch_with_cuda_graphs_replays_right(llama, monkeypatch):
    """FA3 (Triton without it) in both modes: the graph run equals the eager run token for token; the captured
    calls planned on a second selection, made in mode "graph" at the first capture."""
    hf_kernels.register(None, "torch", policy="priority", prefill_priority=["fa3", "triton"],
                        extend_priority=["fa3", "triton"])
    eager_tokens = batch_tokens(load(llama, hf_kernels.NAME), graphs=False)
    assert set(selections()) == {"configured"}  # nothing was captured: no graph-mode selection
    calls, plans = watch(monkeypatch)
    model = load(llama, hf_kernels.NAME)
    tokens = batch_tokens(model, graphs=True)
    print(f"attnsel varlen calls: {calls}; plans (phase, mode, backend, captured) made: {len(plans)}")
    assert model.config._attn_implementation in (hf_kernels.NAME, hf_kernels.PAGED_NAME)  # not another one
    assert all(len(t) == NEW_TOKENS for t in tokens)
    if hf_extend_hook.unsupported() is not None:  # 5.18 to 5.23: every step through the varlen prefill
        assert tokens == eager_tokens
    else:  # cached prefixes in place: eager decode steps take the decode phase, captured ones extend
        assert_near_greedy(llama, eager_tokens)
    assert calls["captured"] > 0 and calls["eager"] > 0
    assert hf.fallbacks() == {}
    sels = selections()
    assert sels["graph"].mode == "graph" and sels["graph"].prefill in GRAPH_SAFE
    assert {p for p in plans if p[3]} == {(ph, "graph", getattr(sels["graph"], ph), True)  # every captured plan
                                          for ph, _, _, captured in plans if captured}
    assert {p for p in plans if not p[3]} == {(ph, "eager", getattr(sels["configured"], ph), False)
                                              for ph, _, _, captured in plans if not captured}
    assert_near_greedy(llama, tokens)


def test_an_eager_choice_that_cannot_be_captured_is_not_captured(llama, monkeypatch):
    """torch first in the priority: eager mode takes torch's prefill, whose plan splits the batch on the host (a
    sync during capture, stale lengths on replay). The captured calls plan on the graph-mode selection, which leaves
    torch out with its reason; the run completes with greedy tokens."""
    hf_kernels.register(None, "torch", policy="priority", prefill_priority=["torch", "fa3", "triton"],
                        extend_priority=["fa3", "triton"])
    calls, plans = watch(monkeypatch)
    tokens = batch_tokens(load(llama, hf_kernels.NAME), graphs=True)
    print(f"attnsel varlen calls: {calls}; plans (phase, mode, backend, captured) made: {len(plans)}")
    assert all(len(t) == NEW_TOKENS for t in tokens), tokens
    sels = selections()
    assert sels["configured"].prefill == "torch"  # the eager choice really was the stale one
    torch_in_graph = next(c for c in sels["graph"].candidates["prefill"] if c.name == "torch")
    assert torch_in_graph.status == "unavailable" and "cannot serve CUDA-graph replays" in torch_in_graph.reason
    assert calls["captured"] > 0 and hf.fallbacks() == {}
    assert {p for p in plans if p[3]} == {(ph, "graph", getattr(sels["graph"], ph), True)
                                          for ph, _, _, captured in plans if captured}
    assert sels["graph"].prefill in GRAPH_SAFE
    assert_near_greedy(llama, tokens)
