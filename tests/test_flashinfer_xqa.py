"""attnsel's glue around FlashInfer's XQA decode, checked on the CPU with a fake ``flashinfer.decode`` that records
what it is given (XQA's numbers are checked on the GPU: tests/test_gpu.py). What must hold: the lengths reach XQA as
a uint32 view of the caller's int32 tensor (in-place updates after the plan are seen), the scales fold as XQA's
bmm1/bmm2 factors (k_scale into the score scale, v_scale into the output, as device tensors), the window as
window_left = w - 1, sinks as given, zero-length rows zeros (also for a plan made during CUDA-graph capture, where
the plan may not read the lengths), and wrong run-time inputs raise.
"""
import sys
import types

import pytest
import torch

import attnsel.backends.flashinfer_xqa as xqa
from attnsel.spec import AttentionSpec


@pytest.fixture
def fake_xqa(monkeypatch):
    calls = []

    def xqa_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len,
                                       bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1, out=None, sinks=None,
                                       kv_layout="NHD", **kwargs):
        calls.append(dict(query=query, kv_cache=kv_cache, workspace=workspace_buffer, block_tables=block_tables,
                          seq_lens=seq_lens, max_seq_len=max_seq_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                          window_left=window_left, sinks=sinks, kv_layout=kv_layout))
        return torch.ones_like(query)  # rows XQA computed: ones (zero-length rows must come back zeros)

    decode = types.ModuleType("flashinfer.decode")
    decode.xqa_batch_decode_with_kv_cache = xqa_batch_decode_with_kv_cache
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    monkeypatch.setattr(xqa, "_workspaces", {})
    return calls


def _inputs(spec, batch=3, pages=4):
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(batch * pages, spec.page_size, spec.num_kv_heads, spec.head_dim,
                        dtype=spec.kv_torch_dtype)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    return q, cache, table


def test_lengths_scales_window_and_zero_rows(fake_xqa):
    spec = AttentionSpec(8, 2, 64, "bf16", 16, sliding_window=20, kv_dtype="fp8_e4m3")
    q, cache, table = _inputs(spec)
    lens = torch.tensor([5, 0, 40], dtype=torch.int32)
    run = xqa.BACKEND.plan_decode(spec, table, lens)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([1.7])
    out = run(q, cache, cache, k_scale=k_scale, v_scale=v_scale)
    (call,) = fake_xqa
    assert call["seq_lens"].dtype == torch.uint32 and call["seq_lens"].data_ptr() == lens.data_ptr()
    assert call["max_seq_len"] == 4 * 16 and call["window_left"] == 19 and call["kv_layout"] == "NHD"
    assert torch.allclose(call["bmm1_scale"], torch.tensor([0.5 * 64 ** -0.5]))
    assert torch.equal(call["bmm2_scale"], torch.tensor([1.7]))
    assert out[1].abs().max().item() == 0 and out[0].min().item() == 1 and out[2].min().item() == 1
    lens[0] = 7  # an engine updates its lengths in place: the plan's run reads them at run time
    run(q, cache, cache, k_scale=k_scale, v_scale=v_scale)
    assert fake_xqa[-1]["seq_lens"].tolist() == [7, 0, 40]


def test_plain_cache_scales_are_floats_and_sinks_pass_through(fake_xqa):
    spec = AttentionSpec(8, 2, 64, "bf16", 16, sinks=True)
    q, cache, table = _inputs(spec)
    run = xqa.BACKEND.plan_decode(spec, table, torch.tensor([3, 9, 1], dtype=torch.int32))
    sinks = torch.randn(8)
    run(q[:, :, :], cache, cache, sinks=sinks)
    (call,) = fake_xqa
    assert call["bmm1_scale"] == pytest.approx(64 ** -0.5) and call["bmm2_scale"] == 1.0
    assert call["window_left"] == -1 and torch.equal(call["sinks"], sinks)
    with pytest.raises(ValueError, match="float32 tensor"):
        run(q, cache, cache)  # the spec has sinks: they are required
    with pytest.raises(ValueError, match="float32 tensor"):
        run(q, cache, cache, sinks=sinks[:4])


def test_strided_queries_reach_xqa_contiguous(fake_xqa):
    spec = AttentionSpec(8, 2, 64, "bf16", 16)
    q, cache, table = _inputs(spec)
    wide = torch.randn(3, 16, 64, dtype=torch.bfloat16)[:, ::2]  # every other head: strided
    run = xqa.BACKEND.plan_decode(spec, table, torch.tensor([3, 9, 1], dtype=torch.int32))
    run(wide, cache, cache)
    assert fake_xqa[0]["query"].is_contiguous() and torch.equal(fake_xqa[0]["query"], wide)


def test_fp8_needs_scales_and_sinks_need_the_spec(fake_xqa):
    spec = AttentionSpec(8, 2, 64, "bf16", 16, kv_dtype="fp8_e4m3")
    q, cache, table = _inputs(spec)
    run = xqa.BACKEND.plan_decode(spec, table, torch.tensor([3, 9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        run(q, cache, cache)
    plain = AttentionSpec(8, 2, 64, "bf16", 16)
    run = xqa.BACKEND.plan_decode(plain, table, torch.tensor([3, 9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="sinks=False"):
        run(q, cache, cache, sinks=torch.zeros(8))
    assert not fake_xqa  # nothing reached XQA


def test_plan_during_capture_masks_without_reading_the_lengths(fake_xqa, monkeypatch):
    """During CUDA-graph capture the plan may not read the lengths on the host: it masks zero-length rows on the
    device on every run (a replay may bring such rows)."""
    spec = AttentionSpec(8, 2, 64, "bf16", 16)
    q, cache, table = _inputs(spec)
    lens = torch.tensor([3, 9, 1], dtype=torch.int32)
    xqa.BACKEND.plan_decode(spec, table, lens)  # a first plan outside capture makes the workspace
    monkeypatch.setattr(xqa, "capturing", lambda t: True)
    real_bool = torch.Tensor.__bool__

    def no_host_read(self):
        raise AssertionError("a host read of a device tensor during capture")

    monkeypatch.setattr(torch.Tensor, "__bool__", no_host_read)
    try:
        run = xqa.BACKEND.plan_decode(spec, table, lens)
    finally:
        monkeypatch.setattr(torch.Tensor, "__bool__", real_bool)
    lens[1] = 0  # the replay's batch has a padding row
    out = run(q, cache, cache)
    assert out[1].abs().max().item() == 0 and out[0].min().item() == 1


def test_prefill_is_refused():
    with pytest.raises(NotImplementedError, match="decode only"):
        xqa.BACKEND.plan_prefill(AttentionSpec(8, 2, 64), torch.zeros(2, dtype=torch.int32),
                                 torch.zeros(2, dtype=torch.int32), 1, 1)


def test_empty_batch_never_reaches_xqa(fake_xqa):
    """XQA's launcher divides by the batch size (a crash of the process, not an exception)."""
    spec = AttentionSpec(8, 2, 64, "bf16", 16)
    q, cache, table = _inputs(spec, batch=0)
    out = xqa.BACKEND.plan_decode(spec, table, torch.zeros(0, dtype=torch.int32))(q, cache, cache)
    assert out.shape == (0, 8, 64) and not fake_xqa


def test_tensors_read_through_raw_pointers_must_be_on_q_device(fake_xqa):
    spec = AttentionSpec(8, 2, 64, "bf16", 16, sinks=True)
    q, cache, table = _inputs(spec)
    run = xqa.BACKEND.plan_decode(spec, table, torch.tensor([3, 9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="sinks must be on q's device cpu, got meta"):
        run(q, cache, cache, sinks=torch.zeros(8, device="meta"))
    spec8 = AttentionSpec(8, 2, 64, "bf16", 16, kv_dtype="fp8_e4m3")
    q, cache, table = _inputs(spec8)
    run = xqa.BACKEND.plan_decode(spec8, table, torch.tensor([3, 9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_scale and v_scale must be on q's device"):
        run(q, cache, cache, k_scale=torch.ones(1, device="meta"), v_scale=torch.ones(1))
    assert not fake_xqa


def test_workspace_is_zeroed_once_outside_capture_and_large_enough(fake_xqa, monkeypatch):
    spec = AttentionSpec(8, 2, 64, "bf16", 16)
    q, cache, table = _inputs(spec)
    lens = torch.tensor([3, 9, 1], dtype=torch.int32)
    monkeypatch.setattr(xqa, "capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="run one decode step with it before capturing"):
        xqa.BACKEND.plan_decode(spec, table, lens)  # the first plan on the device, during capture
    monkeypatch.setattr(xqa, "capturing", lambda t: False)
    xqa.BACKEND.plan_decode(spec, table, lens)(q, cache, cache)
    workspace = fake_xqa[-1]["workspace"]
    assert workspace.dtype == torch.uint8 and workspace.numel() == 128 << 20 and workspace.max().item() == 0
    monkeypatch.setattr(xqa, "capturing", lambda t: True)  # now made: a plan during capture reuses it
    xqa.BACKEND.plan_decode(spec, table, lens)(q, cache, cache)
    assert fake_xqa[-1]["workspace"] is workspace
    monkeypatch.setenv("ATTNSEL_FLASHINFER_WORKSPACE_MB", "8")
    with pytest.raises(ValueError, match="at least 16"):
        xqa.BACKEND.plan_decode(spec, table, lens)
