"""The FA-compatible functions under CUDA-graph capture (attnsel/graph_selection.py): a captured call plans on a
selection made in mode "graph", never on an eager one, and a captured call that cannot get one says why. On the CPU
the capture is stood in for (``flash_api._capturing``) and so is the selection in mode "graph" (a real one needs
CUDA: tests/test_gpu_hf_graphs.py runs it); what is checked is which selection each call plans on and which
selections are asked for. Then the facts about transformers this relies on (>= 5.18): it captures by default for
attnsel's flash-named implementations, and takes their varlen path for every step."""
import dataclasses

import pytest
import torch

import attnsel
from attnsel import flash_api
from tests.test_flash_api import ragged


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    flash_api.configure(policy="priority")
    monkeypatch.setattr(flash_api.default(), "_captured", [])
    yield
    flash_api.configure()


class Recorder:
    """flash_api.select recorded: every selection asked for (its mode), each answered by a real selection made on
    the CPU in mode eager (mode "graph" needs CUDA) and then labelled with the mode asked for."""

    def __init__(self, monkeypatch):
        self.asked, self.made = [], []
        real = flash_api.select

        def select(spec, prefill, decode, **options):
            self.asked.append(dict(options, prefill=prefill, decode=decode))
            mode = options.pop("mode", "eager")
            sel = dataclasses.replace(real(spec, prefill, decode, **options), mode=mode)
            self.made.append(sel)
            return sel

        monkeypatch.setattr(flash_api, "select", select)


def planned_on(monkeypatch, method: str) -> list:
    """The selections Selection.<method> plans on, in call order."""
    seen, real = [], getattr(attnsel.Selection, method)
    monkeypatch.setattr(attnsel.Selection, method, lambda self, *a, **kw: seen.append(self) or real(self, *a, **kw))
    return seen


def _varlen():
    q, k, v, cu_q, cu_k = ragged([3, 5], [3, 5], 2, 1, 8, torch.float32, seed=9)
    return lambda: attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)


def _kvcache():
    from tests.test_flash_api import paged

    kc, vc, table, _, _ = paged([3, 17], 1, 8, 16, torch.float32, seed=9)
    q = torch.randn(2, 1, 2, 8)
    lens = torch.tensor([3, 17], dtype=torch.int32)
    return lambda: attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table)


@pytest.mark.parametrize("call,method", [(_varlen, "plan_prefill"), (_kvcache, "plan_decode")])
def test_a_captured_call_plans_on_a_graph_mode_selection(monkeypatch, call, method):
    """transformers' way: each batch shape runs once eagerly, then is captured. The captured calls plan on a second
    selection, asked for in mode "graph" with the same options, made once per spec; eager calls keep the first."""
    recorder, seen, run = Recorder(monkeypatch), planned_on(monkeypatch, method), call()
    run()  # eager: selects in the configured mode
    monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    run()
    run()
    monkeypatch.setattr(flash_api, "_capturing", lambda t: False)
    run()
    eager, graph = recorder.made[0], recorder.made[-1]
    assert [s.mode for s in seen] == ["eager", "graph", "graph", "eager"]
    assert seen == [eager, graph, graph, eager]
    asked = {"policy": "priority", "device": "cpu", "prefill": "torch", "decode": "torch", "extend": "auto"}
    assert recorder.asked == [asked, {**asked, "mode": "graph"}]
    flash_api.configure(policy="priority")  # forgets both: the next capture asks again
    run()
    monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    run()
    assert [a.get("mode", "eager") for a in recorder.asked] == ["eager", "graph", "eager", "graph"]


def test_a_graph_mode_configuration_is_the_one_selection(monkeypatch):
    recorder, seen, run = Recorder(monkeypatch), planned_on(monkeypatch, "plan_prefill"), _varlen()
    flash_api.configure(policy="priority", mode="graph")
    run()
    monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    run()
    assert [a["mode"] for a in recorder.asked] == ["graph"] and seen == [recorder.made[0]] * 2


def test_a_captured_call_with_several_ranks_names_the_fix(monkeypatch):
    """The ranks agree on a selection through a broadcast, which a capture would record: no selection during
    capture there; the error names mode "graph". A first call during capture stays an error of its own."""
    from attnsel import graph_selection

    run = _varlen()
    run()
    monkeypatch.setattr(graph_selection, "capturing_now", lambda: True)
    monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match=r"is being captured into a CUDA graph and needs a selection made in mode "
                                           r"'graph'.*2 torch.distributed ranks cannot agree on a new one inside a "
                                           r"capture.*configure\(mode='graph'\).*register\(mode='graph'\)"):
        run()
    flash_api.reset()
    with pytest.raises(RuntimeError, match="the first call for .* happened during CUDA graph capture; call once "
                                           "outside capture first"):
        run()


NAMES = ["attnsel_flash", "paged|attnsel_flash", "attnsel/flash-attn"]  # hf_kernels.NAME, PAGED_NAME, KERNEL_NAME


@pytest.mark.parametrize("name", NAMES)
def test_transformers_captures_attnsel_flash_names_by_default(monkeypatch, name):
    """What hf_kernels' docstring and graph_selection rely on: with no CUDA-graph option given, transformers turns
    graphs on for both paths of a flash-named implementation where a graph backend exists (here: made to think so),
    and the decode fast path (block tables) is only for FA2/FA3 names, so every step is a captured varlen call."""
    transformers = pytest.importorskip("transformers")
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 18):
        pytest.skip("transformers 5.17 serves continuous batching through paged|attnsel, which it does not capture "
                    "by default (.ci/run runs this file on 5.18 and the newest)")
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization
    from transformers.utils.generic import is_flash_attention_requested

    from attnsel.integrations import hf_kernels

    assert NAMES == [hf_kernels.NAME, hf_kernels.PAGED_NAME, hf_kernels.KERNEL_NAME]
    if hasattr(initialization, "get_accelerator_graph_name"):  # 5.25 (5.18 asks torch.cuda.is_available())
        monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = ContinuousBatchingConfig()
    mask_needed = not is_flash_attention_requested(requested_attention_implementation=name)
    initialization.decide_use_cuda_graphs(cb_config=config, is_attn_mask_needed=mask_needed,
                                          cuda_graph_requested=False)
    assert config.use_cuda_graph == (True, True)
    assert not is_flash_attention_requested(requested_attention_implementation=name, version=[2, 3])
