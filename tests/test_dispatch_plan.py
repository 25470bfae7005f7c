"""Plan-time dispatch from host sizes and the checked run functions: every bad argument named, metadata checked
before any backend sees it, the FlashAttention q layout [B, 1, H, D] and its validation."""
import re
import types

import pytest
import torch

import attnsel.backends as backends_mod
import attnsel.selection as selection
from attnsel import AttentionSpec, SelectionError, select
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.selection import PhaseChoice, build_table
from attnsel.validate.cases import cumulative
from tests.fixtures.dispatch import B1hdPlugin, H, Recorder, SPEC, _prefill_run, _selection, measured


def test_plan_decode_dispatches_from_host_sizes_without_reading_tensors(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    cells = {(1, 256): {"rec_a": 1.0, "rec_b": 2.0}, (1, 4096): {"rec_a": 9.0, "rec_b": 2.0},
             (32, 256): {"rec_a": 9.0, "rec_b": 2.0}, (32, 4096): {"rec_a": 9.0, "rec_b": 2.0}}
    sel = _selection({"decode": PhaseChoice("rec_b", "auto", [],
                                            build_table(measured("decode", "eager", cells), ["rec_a", "rec_b"]))})
    Recorder.planned.clear()
    meta = dict(device="meta", dtype=torch.int32)
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), max_seq_len=300)
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), max_seq_len=5000)
    # without max_seq_len the page table's width decides: 20 pages x 16 = 320 tokens
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta))
    sel.plan_decode(torch.empty(40, 20, **meta), torch.empty(40, **meta), max_seq_len=300)
    # context_tokens (the batch's context tokens, summed) decides over max_seq_len: one long row among short ones is
    # bucketed by its mean context, 2 rows x 300 tokens on average
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), max_seq_len=5000, context_tokens=600)
    assert Recorder.planned == ["rec_a", "rec_b", "rec_a", "rec_b", "rec_a"]
    with pytest.raises(ValueError, match="^context_tokens: expected None or a non-negative Python int"):
        sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), context_tokens=torch.tensor(600))


def test_plan_prefill_dispatches_on_seqs_tokens_longest(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    cells = {(1, 64, 64): {"rec_a": 1.0, "rec_b": 2.0}, (16, 1024, 64): {"rec_a": 9.0, "rec_b": 2.0}}
    sel = _selection({"prefill": PhaseChoice("rec_a", "auto", [],
                                             build_table(measured("prefill", "eager", cells), ["rec_a", "rec_b"]))})
    Recorder.planned.clear()
    cu = cumulative([40, 50], "cpu")
    run = sel.plan_prefill(cu, cu, 50, 50, total_q=90)
    sel.plan_prefill(cumulative([60] * 12, "cpu"), cumulative([60] * 12, "cpu"), 60, 60)  # total_q: 12 x 60
    assert Recorder.planned == ["rec_a", "rec_b"]
    q = torch.randn(90, 4, 64, dtype=torch.float16)
    k, v = torch.randn(90, 2, 64, dtype=torch.float16), torch.randn(90, 2, 64, dtype=torch.float16)
    ref = TORCH.plan_prefill(SPEC, cu, cu, 50, 50)(q, k, v)
    assert torch.equal(run(q, k, v), ref)  # the check changes nothing


@pytest.mark.parametrize("arg,value,allowed", [
    ("total_q", torch.tensor(9), "a non-negative Python int"), ("total_k", torch.tensor(9), "a non-negative Python int"),
    ("total_q", -3, "a non-negative Python int"), ("total_q", "9", "a non-negative Python int"),
    ("total_q", float("nan"), "a non-negative Python int"), ("total_q", True, "a non-negative Python int"),
    ("total_k", 2.0, "a non-negative Python int"),
])
def test_plan_prefill_names_a_bad_total(arg, value, allowed):
    """total_q / total_k key the dispatch and check the run's token counts: plan_prefill refuses, naming the
    argument, a tensor there (reading it would be a device sync; on a meta tensor a RuntimeError) and a negative or
    impossible count (it would fail only at run time, without naming the argument). A count above sequences x
    longest stays allowed: q may carry padding rows past the last sequence."""
    sel = _selection({})
    cu = cumulative([5, 7], "cpu")
    with pytest.raises(ValueError, match=rf"^{arg}: expected None or {re.escape(allowed)}"):
        sel.plan_prefill(cu, cu, 7, 7, **{arg: value})


@pytest.mark.parametrize("args, message", [
    (((12, 3, 64), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [12, 3, 64] fp16 on cpu"),
    (((12, 4, 32), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [12, 4, 32] fp16 on cpu"),
    (((11, 4, 64), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [11, 4, 64] fp16 on cpu"),
    (((12, 4, 64), (12, 4, 64), (12, 4, 64)), "k: expected [*, 2, 64] fp16 on cpu, got [12, 4, 64] fp16 on cpu"),
    (((12, 4, 64), (12, 2, 64), (10, 2, 64)), "v: expected [12, 2, 64] fp16 on cpu, got [10, 2, 64] fp16 on cpu"),
    (((4, 64), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [4, 64] fp16 on cpu"),
])
def test_prefill_run_names_the_bad_argument(args, message):
    run = _prefill_run()
    tensors = [torch.zeros(s, **H) for s in args]
    with pytest.raises(ValueError) as exc:
        run(*tensors)
    assert str(exc.value) == message


def test_prefill_run_checks_dtype_token_count_and_features():
    run = _prefill_run(total_k=12)
    q, k, v = torch.zeros(12, 4, 64, **H), torch.zeros(12, 2, 64, **H), torch.zeros(12, 2, 64, **H)
    with pytest.raises(ValueError, match=r"^q: expected \[12, 4, 64\] fp16 on cpu, got \[12, 4, 64\] bf16 on cpu$"):
        run(q.bfloat16(), k, v)
    with pytest.raises(ValueError, match=r"^k: expected \[12, 2, 64\] fp16 on cpu, got \[13, 2, 64\] fp16 on cpu$"):
        run(q, torch.zeros(13, 2, 64, **H), torch.zeros(13, 2, 64, **H))
    with pytest.raises(ValueError, match=r"^v: expected \[12, 2, 64\] fp16 on cpu, got \[12, 2, 64\] fp32 on cpu$"):
        run(q, k, v.float())
    with pytest.raises(ValueError, match="^sinks: given, but the spec has no attention sinks"):
        run(q, k, v, sinks=torch.zeros(4))
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        run(q, k, v, window=3)
    assert run(q, k, v).shape == (12, 4, 64)


def test_decode_run_names_the_bad_argument():
    sel = _selection({})
    page_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    run = sel.plan_decode(page_table, seq_lens, 20)
    q, kc = torch.zeros(2, 4, 64, **H), torch.zeros(4, 16, 2, 64, **H)
    with pytest.raises(ValueError) as exc:
        run(torch.zeros(3, 4, 64, **H), kc, kc)
    assert str(exc.value) == "q: expected [2, 4, 64] fp16 on cpu, got [3, 4, 64] fp16 on cpu"
    with pytest.raises(ValueError) as exc:
        run(q, torch.zeros(4, 8, 2, 64, **H), kc)
    assert str(exc.value) == "k_cache: expected [*, 16, 2, 64] fp16 on cpu, got [4, 8, 2, 64] fp16 on cpu"
    with pytest.raises(ValueError) as exc:
        run(q, kc, kc.bfloat16())
    assert str(exc.value) == "v_cache: expected [4, 16, 2, 64] fp16 on cpu, got [4, 16, 2, 64] bf16 on cpu"
    with pytest.raises(ValueError, match="^v_cache: expected .* got None$"):
        run(q, kc, None)
    look_alike = types.SimpleNamespace(shape=(4, 16, 2, 64), dtype=torch.float16)  # no tensor methods
    with pytest.raises(ValueError, match="^v_cache: expected .* got SimpleNamespace$"):
        run(q, kc, look_alike)
    with pytest.raises(ValueError, match="^k_scale: given, but the spec's KV cache is fp16"):
        run(q, kc, kc, k_scale=torch.ones(1))
    assert torch.equal(run(q, kc, kc), TORCH.plan_decode(SPEC, page_table, seq_lens)(q, kc, kc))


def test_decode_run_checks_feature_inputs_the_spec_asks_for():
    spec = AttentionSpec(4, 2, 64, "fp16", sinks=True)
    sel = _selection({}, spec=spec)
    run = selection.checked_decode(lambda q, k, v, **kw: q, spec, -1, 2)
    q, kc = torch.zeros(2, 4, 64, **H), torch.zeros(4, 16, 2, 64, **H)
    with pytest.raises(ValueError, match=r"^sinks: expected \[4\] fp32 \(the spec has attention sinks\), got None$"):
        run(q, kc, kc)
    assert run(q, kc, kc, sinks=torch.zeros(4)) is q
    assert sel.spec.sinks


def test_plan_metadata_is_checked_before_any_backend_sees_it():
    """A page table with fewer rows than seq_lens (the Triton decode would crash, SIGSEGV) and mismatched
    cu_seqlens (NaN) are refused by plan_* from host metadata, naming the argument."""
    sel = _selection({})
    lens = torch.tensor([20, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^page_table: expected an int32 tensor \[2, max_pages\] on cpu .* "
                                         r"got \[1, 2\] int32 on cpu$"):
        sel.plan_decode(torch.zeros(1, 2, dtype=torch.int32), lens, 20)
    with pytest.raises(ValueError, match=r"^page_table: .* got \[2, 2\] fp32 on cpu$"):
        sel.plan_decode(torch.zeros(2, 2), lens, 20)
    with pytest.raises(ValueError, match=r"^seq_lens: expected a 1-D int32 tensor \[batch\], got \[2, 1\]"):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.int32), lens[:, None], 20)
    with pytest.raises(ValueError, match="^max_seq_len: expected None or a non-negative Python int, got "):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.int32), lens, torch.tensor(20))
    cu = cumulative([5, 7], "cpu")
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: expected the shape and device of cu_seqlens_q"):
        sel.plan_prefill(cu, cumulative([5, 7, 1], "cpu"), 7, 7, 12)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-D int32 tensor"):
        sel.plan_prefill(cu.float(), cu, 7, 7, 12)
    with pytest.raises(ValueError, match=r"^max_seqlen_k: expected a non-negative Python int"):
        sel.plan_prefill(cu, cu, 7, -1, 12)
    # int64 metadata, as FlashAttention refuses it: backends would plan from an int32 copy, which in-place updates
    # of the caller's tensors (between CUDA-graph replays) never reach (was accepted, unlike the FA-compatible calls)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-D int32 tensor .* got \[3\] int64"):
        sel.plan_prefill(cu.long(), cu.long(), 7, 7, 12)
    with pytest.raises(ValueError, match=r"^seq_lens: expected a 1-D int32 tensor \[batch\], got \[2\] int64"):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.int32), lens.long(), 20)
    with pytest.raises(ValueError, match=r"^page_table: .* got \[2, 2\] int64 on cpu$"):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.long), lens, 20)


def test_run_refuses_a_strided_last_dimension():
    """A strided last dimension is refused: Triton indexes it with stride 1 (q[..., ::2] would give errors of 1.56)."""
    run = _prefill_run()
    wide = torch.zeros(12, 4, 128, **H)
    k, v = torch.zeros(12, 2, 64, **H), torch.zeros(12, 2, 64, **H)
    with pytest.raises(ValueError, match=r"^q: its last dimension must be contiguous \(stride 1\), got strides "
                                         r"\(512, 128, 2\); pass q.contiguous\(\)$"):
        run(wide[..., ::2], k, v)
    assert run(wide[..., ::2].contiguous(), k, v).shape == (12, 4, 64)


@pytest.mark.parametrize("name,native", [("b1hd_native", True), ("b1hd_views", False), ("b1hd_truthy", False),
                                         ("b1hd_raises", False)])
def test_plan_decode_in_flash_layout_passes_q_only_to_backends_that_take_it(monkeypatch, caplog, name, native):
    """q_layout="b1hd": q [B, 1, H, D] reaches a backend whose decode_takes_b1hd is True as the very tensor given
    (no view); any other backend (attribute missing, not True, or raising: logged) gets q viewed as [B, H, D]. Out is
    [B, 1, H, D] and equal to the [B, H, D] plan's, against the float32 reference either way."""
    from tests.fixtures.feature_cases import decode_case

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:B1HD_PLUGINS")
    spec = AttentionSpec(4, 2, 16, "fp32", 16)
    case = decode_case(spec, torch.device("cpu"), [5, 0, 33])
    sel = _selection({"decode": PhaseChoice(name, "explicit", [])}, spec=spec)
    q, k_cache, v_cache = case.inputs
    q4 = q.unsqueeze(1)
    B1hdPlugin.seen.clear()
    monkeypatch.setattr(backends_mod, "_B1HD_RAISED", set())  # the warning is logged once per backend and process
    out = sel.plan_decode(*case.plan_args, q_layout="b1hd")(q4, k_cache, v_cache)
    assert out.shape == q4.shape
    assert (B1hdPlugin.seen[-1] is q4) is native and B1hdPlugin.seen[-1].dim() == (4 if native else 3)
    assert (out[:, 0] - case.ref).abs().max().item() < 1e-5
    assert torch.equal(out[:, 0], sel.plan_decode(*case.plan_args)(q, k_cache, v_cache))
    if name == "b1hd_raises":
        assert "decode_takes_b1hd of b1hd_raises raised RuntimeError: broken attribute" in caplog.text


def test_plan_decode_in_flash_layout_names_a_bad_q_and_a_bad_layout():
    sel = _selection({})
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    cache = torch.zeros(6, SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim, dtype=SPEC.torch_dtype)
    run = sel.plan_decode(table, lens, q_layout="b1hd")
    q3 = torch.zeros(2, SPEC.num_q_heads, SPEC.head_dim, dtype=SPEC.torch_dtype)
    with pytest.raises(ValueError, match=rf"q: expected \[2, 1, {SPEC.num_q_heads}, {SPEC.head_dim}\]"):
        run(q3, cache, cache)
    with pytest.raises(ValueError, match=r"q: expected \[2, 1, "):
        run(q3.unsqueeze(0).expand(2, 2, *q3.shape[1:]), cache, cache)  # [2, 2, H, D]: the axis must be 1
    with pytest.raises(ValueError, match="q_layout: expected 'bhd' .* or 'b1hd' .* got 'bshd'"):
        sel.plan_decode(table, lens, q_layout="bshd")


@pytest.mark.usefixtures("inproc_worker")
@pytest.mark.parametrize("name,why", [
    ("b1hd_liar_shape", r"declares decode_takes_b1hd but returned \(\d+, 4, 16\) for q \[B, 1, H, D\], expected "
                        r"\(\d+, 1, 4, 16\)"),
    ("b1hd_liar_values", r"declares decode_takes_b1hd but its out for q \[B, 1, H, D\] differs from its out for "
                         r"q \[B, H, D\] by 0.01")])
def test_a_backend_that_declares_the_flash_layout_is_validated_in_it(monkeypatch, tmp_path, name, why):
    """Validation runs a decode case with q [B, 1, H, D] too when the backend declares decode_takes_b1hd: a plugin
    that returns another shape or other numbers in that layout is rejected with the reason (before, it was selected
    and flash_attn_with_kvcache returned its [B, H, D] out or its wrong numbers)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:B1HD_PLUGINS")
    spec = AttentionSpec(4, 2, 16, "fp32", 16)
    with pytest.raises(SelectionError) as err:
        select(spec, prefill="torch", decode=name, cache_dir=str(tmp_path))
    assert re.search(why, str(err.value)), str(err.value)
    sel = select(spec, prefill="torch", decode="b1hd_native", cache_dir=str(tmp_path))  # the honest one is valid
    assert sel.decode == "b1hd_native"


def test_a_layout_failure_is_not_carried_to_the_next_backend_on_the_same_case(monkeypatch):
    """bench.valid_backends runs every backend on one case: a rejection in the [B, 1, H, D] layout belongs to the
    backend that failed it, not to the next one (torch here, which takes no such layout)."""
    from attnsel.bench import valid_backends

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:B1HD_PLUGINS")
    valid = valid_backends(AttentionSpec(4, 2, 16, "fp32", 16), "decode", ["b1hd_liar_values", "torch"],
                           torch.device("cpu"))
    assert valid["torch"] == "", valid["torch"]
    assert "declares decode_takes_b1hd" in valid["b1hd_liar_values"]

