"""FlashInfer keeps one plan per wrapper and rewrites its buffers when it plans again. attnsel gives every live run
function its own wrapper, so that a later plan never changes what an earlier run function (or a CUDA graph captured
from it: a replay reads the wrapper's buffers, it runs no Python) computes. No GPU: a stand-in ``flashinfer`` module
whose wrappers behave like FlashInfer's in that respect (plan rebinds the page-index buffer that run reads)."""
import gc
import sys
import types

import pytest
import torch

import attnsel.backends.flashinfer as fi
from attnsel.spec import AttentionSpec

SPEC = AttentionSpec(4, 2, 16, "fp32", page_size=4)


class FakeDecodeWrapper:
    made = 0

    def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
        type(self).made += 1

    def plan(self, indptr, indices, last_page_len, *args, **kwargs):
        if indices.numel() and int(indices.max()) >= 1000:
            raise RuntimeError("stand-in plan failure")
        self.indices = indices.clone()  # a new buffer per plan, as FlashInfer's non-graph plan does

    def run(self, q, kv, **kwargs):
        return torch.full_like(q, float(self.indices.sum()))  # what the wrapper's current plan says


@pytest.fixture
def fake_flashinfer(monkeypatch):
    FakeDecodeWrapper.made = 0
    module = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi, "_pools", {}, raising=False)
    monkeypatch.setenv("ATTNSEL_FLASHINFER_WORKSPACE_MB", "8")
    return module


def _plan(pages: list[int]):
    table = torch.tensor([pages], dtype=torch.int32)
    lens = torch.tensor([len(pages) * SPEC.page_size], dtype=torch.int32)
    return fi.BACKEND.plan_decode(SPEC, table, lens), float(sum(pages))


def _call(run):
    q = torch.zeros(1, 4, 16)
    cache = torch.zeros(8, 4, 2, 16)
    return float(run(q, cache, cache)[0, 0, 0])


def test_an_earlier_run_function_keeps_its_plan_after_a_later_plan(fake_flashinfer):
    """Before: one wrapper per spec, so run A raised once B was planned (and a CUDA graph captured from A replayed
    B's page indices, with no error at all)."""
    run_a, want_a = _plan([1, 2])
    run_b, want_b = _plan([5, 6, 7])
    assert _call(run_a) == want_a and _call(run_b) == want_b
    assert run_a.current() and run_b.current()
    assert FakeDecodeWrapper.made == 2


def test_a_dropped_run_function_gives_its_wrapper_back(fake_flashinfer):
    for step in range(20):  # an engine's steps: each plan replaces the last one, which is dropped
        run, want = _plan([step, step + 1])
        assert _call(run) == want
        del run
    assert FakeDecodeWrapper.made == 1
    runs = [_plan([i])[0] for i in range(10)]  # ten live plans (e.g. CUDA graphs of ten batch sizes)
    assert FakeDecodeWrapper.made == 10
    del runs
    gc.collect()
    _plan([3])
    pool = next(iter(fi._pools.values()))
    assert len(pool) <= fi.FREE_KEPT + 1  # free wrappers beyond FREE_KEPT are let go


def test_a_failed_plan_releases_its_wrapper(fake_flashinfer):
    with pytest.raises(RuntimeError, match="stand-in plan failure"):
        _plan([1000])
    run, want = _plan([4])
    assert _call(run) == want
    assert FakeDecodeWrapper.made == 1


class FakePrefillWrapper:
    def __init__(self, workspace, layout, backend="auto"):
        pass

    def plan(self, qo_indptr, kv_indptr, *args, **kwargs):
        self.qo_indptr = qo_indptr  # FlashInfer's non-graph plan keeps the tensor it is given; run reads it

    def run(self, q, k, v):
        return torch.full_like(q, float(self.qo_indptr[-1]))


def test_a_prefill_plan_does_not_follow_the_callers_metadata_buffer(fake_flashinfer, monkeypatch):
    """An engine that rewrites one persistent cu_seqlens buffer for the next batch must not change what an earlier
    plan (or a CUDA graph captured from it) reads: the plan gets private copies."""
    monkeypatch.setattr(fake_flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", FakePrefillWrapper, raising=False)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    run = fi.BACKEND.plan_prefill(SPEC, cu, cu, 5, 5)
    q = torch.zeros(8, 4, 16)
    kv = torch.zeros(8, 2, 16)
    assert float(run(q, kv, kv)[0, 0, 0]) == 8.0
    cu[2] = 6  # the next batch, written in place
    assert float(run(q, kv, kv)[0, 0, 0]) == 8.0


def test_a_failed_plan_whose_exception_is_kept_releases_its_wrapper(fake_flashinfer):
    """A kept exception keeps its traceback's frames alive (loggers, pytest, sys.last_traceback): the wrapper a
    failed plan took must go back to the pool anyway."""
    kept = []
    for _ in range(3):
        try:
            _plan([1000])
        except RuntimeError as exc:
            kept.append(exc)
    run, want = _plan([4])
    assert _call(run) == want
    assert FakeDecodeWrapper.made == 1 and len(kept) == 3


def test_host_scalar_reads_inference_tensors_every_call():
    """fp8 descale factors made under torch.inference_mode() (as engines run) have no version counter: reading it
    raised RuntimeError on every FlashInfer fp8 decode call. They are read on every call instead; normal tensors are
    read once per version."""
    from attnsel.backends.flashinfer import HostScalar

    read = HostScalar()
    normal = torch.tensor([0.5])
    assert read(normal) == 0.5
    normal.fill_(0.25)
    assert read(normal) == 0.25
    with torch.inference_mode():
        scale = torch.tensor([2.0])
        assert read(scale) == 2.0
        scale.fill_(3.0)  # no version counter moves
        assert read(scale) == 3.0
    assert read(normal) == 0.25


def test_workspace_holds_what_a_plan_of_the_spec_may_take(fake_flashinfer, monkeypatch):
    """FlashInfer's plans carve their partial outputs out of the float workspace and raise when they do not fit: on
    an H100 (132 SMs), a split-KV FA2 prefill of 8 query heads over 1 KV head (head_dim 128) asked for 136314880
    bytes of partial outputs and then 1044480 of log-sum-exps, past 128 MiB, and the backend was rejected for the
    spec. The workspace a plan gets is now at least what the spec's plans may take on that GPU, and the setting stays
    the floor (no more memory for specs that fit)."""
    h100 = 132
    assert fi.plan_bytes(AttentionSpec(8, 1, 128), h100) >= 136314880 + 1044480
    for q, kv in ((32, 8), (28, 4), (40, 8), (48, 8)):  # the specs that fit 128 MiB keep it
        assert fi.plan_bytes(AttentionSpec(q, kv, 128), h100) <= 128 << 20
    # the attention-sink wrapper plans as the paged prefill does (tests/test_flashinfer_workspace.py)
    assert fi.plan_bytes(AttentionSpec(32, 8, 128, sinks=True), h100) == fi.plan_bytes(AttentionSpec(32, 8, 128), h100)

    seen = []

    class Wrapper(FakePrefillWrapper):
        def __init__(self, workspace, layout, backend="auto"):
            seen.append(workspace)

    monkeypatch.setattr(fake_flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", Wrapper, raising=False)
    monkeypatch.setattr(fi, "_sms", lambda device: h100)
    monkeypatch.setattr(fi, "_workspaces", {}, raising=False)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    big = fi.BACKEND_FA2.plan_prefill(AttentionSpec(8, 1, 128), cu, cu, 5, 5)
    small = fi.BACKEND_FA2.plan_prefill(AttentionSpec(4, 2, 16), cu, cu, 5, 5)  # a second wrapper: big holds one
    assert len(seen) == 2 and seen[0].numel() >= fi.plan_bytes(AttentionSpec(8, 1, 128), h100)
    assert seen[1] is seen[0]  # one buffer per device: the smaller spec's plans run in the larger one
    del big, small


def test_a_larger_workspace_retires_the_smaller_one(fake_flashinfer, monkeypatch):
    """A process that served a spec within the floor and then one that needs more kept both buffers (one per size,
    with up to FREE_KEPT idle wrappers on each) for good. Now the device's buffer grows: free wrappers on the smaller
    one leave the pool, the smaller buffer is freed once no run function holds a wrapper on it, and later plans of
    either spec run in the larger buffer."""
    import weakref

    made = []

    class Wrapper(FakePrefillWrapper):
        def __init__(self, workspace, layout, backend="auto"):
            self.workspace = workspace  # as FlashInfer's wrappers keep it (else the weakref below proves nothing)
            made.append(workspace)

    monkeypatch.setattr(fake_flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", Wrapper, raising=False)
    monkeypatch.setattr(fi, "_sms", lambda device: 132)
    monkeypatch.setattr(fi, "_workspaces", {}, raising=False)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    small_spec, big_spec = AttentionSpec(4, 2, 16), AttentionSpec(8, 1, 128)
    run = fi.BACKEND_FA2.plan_prefill(small_spec, cu, cu, 5, 5)
    first = weakref.ref(made[0])
    assert made[0].numel() == 8 << 20
    del run  # its wrapper is free now, on the 8 MiB buffer
    run = fi.BACKEND_FA2.plan_prefill(big_spec, cu, cu, 5, 5)
    assert len(made) == 2 and made[1].numel() >= fi.plan_bytes(big_spec, 132)
    del run
    made.clear()
    gc.collect()
    assert first() is None  # the free wrapper on it left the pool: the 8 MiB buffer is gone
    fi.BACKEND_FA2.plan_prefill(small_spec, cu, cu, 5, 5)
    assert made == [] and [w.attnsel_ws_bytes for w in fi._pools[next(iter(fi._pools))]] == [
        fi._workspaces[torch.device("cpu")].numel()]


def test_a_grown_workspace_keeps_no_idle_wrapper_on_the_old_one(fake_flashinfer, monkeypatch):
    """Only free wrappers of the pool being planned from, and only those on less than that plan needs, left the pool:
    a decode wrapper freed before the buffer grew (another pool), and a prefill wrapper whose run function outlived
    the growth, stayed on the old buffer and were taken again by the smaller spec's next plans, so the process kept
    both buffers for good. A free wrapper on an older buffer now leaves every pool of the device when it grows, and
    is never taken again."""
    import weakref

    made = []

    class Prefill(FakePrefillWrapper):
        def __init__(self, workspace, layout, backend="auto"):
            self.workspace = workspace  # as FlashInfer's wrappers keep it
            made.append(workspace)

    class Decode(FakeDecodeWrapper):
        def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
            self.workspace = workspace
            made.append(workspace)

    monkeypatch.setattr(fake_flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", Prefill, raising=False)
    monkeypatch.setattr(fake_flashinfer, "BatchDecodeWithPagedKVCacheWrapper", Decode)
    monkeypatch.setattr(fi, "_sms", lambda device: 132)
    monkeypatch.setattr(fi, "_workspaces", {}, raising=False)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    table, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    small_spec, big_spec = AttentionSpec(4, 2, 16, page_size=4), AttentionSpec(8, 1, 128)
    decode = fi.BACKEND_FA2.plan_decode(small_spec, table, lens)
    prefill = fi.BACKEND_FA2.plan_prefill(small_spec, cu, cu, 5, 5)
    old = weakref.ref(made[0])
    assert made[1] is made[0] and made[0].numel() == 8 << 20
    del decode  # free, in the decode pool, on the 8 MiB buffer
    big = fi.BACKEND_FA2.plan_prefill(big_spec, cu, cu, 5, 5)  # the device's buffer grows
    del prefill, big  # the small prefill's run function outlived the growth
    made.clear()
    gc.collect()
    runs = [fi.BACKEND_FA2.plan_decode(small_spec, table, lens),
            fi.BACKEND_FA2.plan_prefill(small_spec, cu, cu, 5, 5)]
    gc.collect()
    assert old() is None, "the 8 MiB buffer is still held by a pooled wrapper"
    current = fi._workspaces[torch.device("cpu")].numel()
    assert {w.attnsel_ws_bytes for pool in fi._pools.values() for w in pool} == {current}
    del runs
