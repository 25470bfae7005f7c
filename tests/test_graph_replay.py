"""The CUDA-graph contract check (validate/graph_replay.py) on the CPU, with a fake capture that calls the captured
run again after the in-place updates (a replay). A backend whose run reads the metadata's values at each call passes;
one whose plan copied them on the host is caught, and a declared stale phase is refused before any capture. The real
captures run in tests/test_gpu_graph.py."""
import pytest
import torch

from attnsel import AttentionSpec
from attnsel.backends import graph_stale_reason
from attnsel.backends.flashinfer import BACKEND as FLASHINFER
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.validate import graph_replay

CPU = torch.device("cpu")


def fake_capture(run, inputs):
    """A replay on the CPU: the captured call made again with the same tensor objects."""
    return lambda: run(*inputs)


class ReadsAtRun:
    """Plans afresh from the metadata tensors at every run: what a captured run of a contract-keeping backend does."""
    name = "reads_at_run"

    def plan_decode(self, spec, page_table, seq_lens):
        return lambda q, k, v, **kw: TORCH.plan_decode(spec, page_table, seq_lens)(q, k, v, **kw)

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        return lambda q, k, v, **kw: TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k)(q, k, v, **kw)


class CopiesAtPlan:
    """Copies the metadata when it plans (as FlashInfer's plan or a plan's int32 copy of a sliced table does)."""
    name = "copies_at_plan"

    def plan_decode(self, spec, page_table, seq_lens):
        return TORCH.plan_decode(spec, page_table.clone(), seq_lens.clone())

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        return TORCH.plan_prefill(spec, cu_q.clone(), cu_k.clone(), max_q, max_k)


SPECS = [AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bf16", page_size=16),
         AttentionSpec(num_q_heads=4, num_kv_heads=1, head_dim=32, dtype="fp16", page_size=1, sliding_window=24,
                       softcap=30.0)]


@pytest.mark.parametrize("spec", SPECS, ids=["bf16-p16", "fp16-p1-window-softcap"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_run_that_reads_the_metadata_at_replay_passes(spec, phase):
    assert graph_replay.check(ReadsAtRun(), spec, phase, CPU, fake_capture) == {"graph_capture": "ok"}


@pytest.mark.parametrize("spec", SPECS, ids=["bf16-p16", "fp16-p1-window-softcap"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_plan_that_copied_the_metadata_is_caught(spec, phase):
    reason = graph_replay.check(CopiesAtPlan(), spec, phase, CPU, fake_capture)["graph_capture"]
    assert reason.startswith("wrong under CUDA graph replay (")
    assert "replay 2" in reason  # the first replay is the planned batch: right; the first update shows the fault


def test_the_decode_steps_cross_pages_fill_an_empty_row_and_empty_another():
    spec = SPECS[0]
    lens = [1, 17, 0, 43, 157, 32]
    grown, moved, last = graph_replay.decode_steps(spec, lens)
    assert all(g // 16 > n // 16 for g, n in zip(grown, lens))  # every row reaches another page
    assert grown[2] > 0 and last[0] == 0 and lens[0] > 0
    assert moved == grown[-1:] + grown[:-1]
    assert max(last) == max(moved) + 32


def test_a_declared_stale_phase_is_refused_before_capture():
    def no_capture(run, inputs):
        raise AssertionError("nothing is captured for a backend that declares the phase stale")

    for phase in ("prefill", "decode"):
        reason = graph_replay.check(FLASHINFER, SPECS[0], phase, CPU, no_capture)["graph_capture"]
        assert reason.startswith("cannot serve CUDA-graph replays: its plan copies the lengths")
    assert graph_stale_reason(TORCH, "decode") is None
    assert "splits the batch into sequences on the host" in graph_stale_reason(TORCH, "prefill")


def test_a_graph_stale_attribute_that_raises_is_a_reason():
    class Raises:
        name = "raises"

        @property
        def graph_stale(self):
            raise RuntimeError("boom")

    assert graph_stale_reason(Raises(), "decode") == "its graph_stale attribute raised RuntimeError: boom"
