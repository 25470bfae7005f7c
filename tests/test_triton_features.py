"""Triton kernels (interpreted on CPU) with sliding window, softcap, sinks and fp8 KV against a float32 reference.

Also the decode contract: zero-length rows give zeros, and nothing past a sequence's length is read (NaN in unused
slots and pages, -1 / num_pages sentinels in unused page-table columns), on the single- and split-KV paths.
The reference (tests/fixtures/feature_cases.py) is written from the AttentionSpec docstring, independently of the
kernels.
"""

import re

import pytest
import torch

import attnsel.backends.triton as tb
from attnsel.backends import get
from attnsel.spec import AttentionSpec
from tests.fixtures.feature_cases import decode_case, prefill_case, reference

TOL = {"fp16": 2e-3, "bf16": 1.6e-2}  # validate.cases.TOL_FLOOR: output rounding to the dtype (|out| <= 1)
CPU = torch.device("cpu")
SLOW = pytest.mark.slow
SPLITS = {1: "single", 3: "split"}


def grid(first, fast, *, first_id=str):
    """(first value, splits) for every first value and 1 or 3 splits, the pairs in ``fast`` in the default run and
    the rest in the slow stage; ids as two stacked parametrizations gave them ("w40-split")."""
    return [pytest.param(v, n, id=f"{first_id(v)}-{name}", marks=() if (v, n) in fast else SLOW)
            for n, name in SPLITS.items() for v in first]


def _spec(dtype="fp16", **kw):
    return AttentionSpec(8, 2, 64, dtype=dtype, page_size=kw.pop("page_size", 16), **kw)


# ---------------------------------------------------------------- prefill

PREFILL_LQ, PREFILL_LK = [1, 7, 37, 83, 5], [1, 7, 37, 83, 70]  # ragged; the last: 5 queries after 65 cached keys


def _prefill(spec, *, q_mul=1.0):
    case = prefill_case(spec, CPU, PREFILL_LQ, PREFILL_LK, q_mul=q_mul)
    return case.run(get("triton"), spec), case.ref, case


@pytest.mark.parametrize("window", [1, pytest.param(5, marks=SLOW), pytest.param(32, marks=SLOW), 40,
                                    pytest.param(1000, marks=SLOW)], ids=lambda w: f"w{w}")
def test_prefill_sliding_window(window):
    """Windows of 1 token, inside a tile, exactly one interpreter tile (32), across tiles, longer than every
    sequence; the reference with window+1 differs, so an off-by-one at the boundary fails."""
    spec = _spec(sliding_window=window)
    out, ref, _ = _prefill(spec)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() <= TOL["fp16"]
    if window < 83:
        wider = prefill_case(_spec(sliding_window=window + 1), CPU, PREFILL_LQ, PREFILL_LK).ref
        assert (out.float() - wider).abs().max().item() > 10 * TOL["fp16"]


def test_prefill_softcap_with_large_logits():
    spec = _spec(softcap=5.0)
    out, ref, _ = _prefill(spec, q_mul=4.0)  # scores up to ~100: the cap matters
    assert (out.float() - ref).abs().max().item() <= TOL["fp16"]
    plain = _prefill(_spec(), q_mul=4.0)[0]
    assert (plain.float() - ref).abs().max().item() > 0.1  # the cap changed the answer


def test_prefill_sinks():
    spec = _spec(sinks=True)
    out, ref, _ = _prefill(spec)
    assert (out.float() - ref).abs().max().item() <= TOL["fp16"]
    assert out[:, 0].float().abs().max().item() < 1e-3  # the large sink (head 0) takes nearly all the weight


@pytest.mark.parametrize("dtype", [pytest.param("fp16", marks=SLOW), "bf16"])
def test_prefill_all_features_together(dtype):
    spec = _spec(dtype, sliding_window=20, softcap=8.0, sinks=True)
    out, ref, _ = _prefill(spec, q_mul=2.0)
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]


def test_prefill_sinks_are_required_when_the_spec_has_them():
    spec = _spec(sinks=True)
    run = get("triton").plan_prefill(spec, torch.tensor([0, 4], dtype=torch.int32),
                                     torch.tensor([0, 4], dtype=torch.int32), 4, 4)
    x = torch.zeros(4, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 tensor"):
        run(x, x[:, :2], x[:, :2])


# ---------------------------------------------------------------- decode

DECODE_LENS = [0, 1, 17, 45, 0, 130, 32]  # zero-length rows (CUDA-graph padding) among real ones


def _decode(spec, splits, monkeypatch, lens=DECODE_LENS, sentinel="nan_page"):
    """Triton's output and the reference; with splits, the in-kernel merge (MERGE_IN_DECODE_KERNEL) must give the
    reduce kernel's output bit for bit (same arithmetic)."""
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 1))  # chunk 1: every row of >= splits tokens
    # uses all splits, shorter rows fewer (the rest write empty partials)
    case = decode_case(spec, CPU, lens, sentinel)
    out = case.run(get("triton"), spec)
    if splits > 1:
        with monkeypatch.context() as m:
            m.setattr(tb, "MERGE_IN_DECODE_KERNEL", not tb.MERGE_IN_DECODE_KERNEL)
            assert torch.equal(case.run(get("triton"), spec), out), "in-kernel merge and reduce kernel differ"
    return out, case.ref


def _assert_close(out, ref, dtype="fp16"):
    """Within the dtype's rounding of the output (outputs beyond 1 in magnitude: relative to the largest)."""
    assert torch.isfinite(out.float()).all(), "NaN or inf in the output"
    assert (out.float() - ref).abs().max().item() <= TOL[dtype] * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("sentinel,splits", grid(["nan_page", -1, "num_pages"], {("num_pages", 1), (-1, 3)}))
def test_decode_zero_length_rows_and_garbage_are_harmless(splits, sentinel, monkeypatch):
    out, ref = _decode(_spec(page_size=16), splits, monkeypatch, sentinel=sentinel)
    _assert_close(out, ref)
    assert out[0].abs().max().item() == 0 and out[4].abs().max().item() == 0  # zero-length rows are zeros


@pytest.mark.parametrize("window,splits", grid([1, 16, 40, 500], {(1, 1), (40, 3)}, first_id=lambda w: f"w{w}"))
def test_decode_sliding_window(window, splits, monkeypatch):
    out, ref = _decode(_spec(page_size=16, sliding_window=window), splits, monkeypatch)
    _assert_close(out, ref)


def test_decode_rows_take_splits_by_length_and_empty_partials_are_never_read(monkeypatch):
    """A ragged batch where each row uses round(len / chunk) of the plan's splits (chunk 32 tokens: rows of 0, 1,
    17, 45, 130 tokens use 1, 1, 1, 1, 4 of 4): the split buffers start as NaN (garbage from the allocator), so a
    reduce that reads the partial output of a split its row did not use outputs NaN."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (4, 2**30, 32))  # chunk: 32 tokens
    case = decode_case(_spec(page_size=16), CPU, DECODE_LENS, "nan_page")
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", nan_empty)
        run = get("triton").plan_decode(_spec(page_size=16), *case.plan_args)
    _assert_close(run(*case.inputs), case.ref)


def test_decode_split_plan_fills_the_gpu_and_follows_the_rows():
    """The H200's plan (132 SMs, 8 KV heads, tiles of 64): about 3 programs per SM, splits rounded to the nearest
    count, at least two tiles per split; a ragged batch's chunk comes from its total tokens."""
    assert tb.decode_splits(24, 8, 6000, 24 * 6000, 64, 132) == (2, 396, 128)  # 384 programs, not 576
    assert tb.decode_splits(6, 8, 12000, 6 * 12000, 64, 132)[0] == 8  # 384 programs
    assert tb.decode_splits(1, 8, 1500, 1500, 64, 132)[0] == 50  # room for 396 / 8; the row uses 1500 / 128 = 12
    assert tb.decode_splits(200, 8, 9000, 200 * 9000, 64, 132)[0] == 1
    assert tb.decode_splits(8, 8, 9000, 18820, 64, 132)[0] == 24  # one 9000-token row among short ones
    assert tb.decode_splits(1, 1, 10**6, 10**6, 64, 132)[0] == 64  # one KV head would want 396: at most 64
    assert tb.decode_splits(8, 8, 16, 8 * 16, 64, 132)[0] == 6  # planned on dummy lengths: room for 396 / 64
    assert tb.decode_splits(4, 8, 100, 400, 32, None) == (1, 2**30, 128)  # the interpreter
    assert tb.decode_splits(4, 8, 200, 800, 32, None) == (2, 2**30, 128)


def test_a_plan_on_uniform_rows_keeps_split_room_for_a_ragged_replay():
    """A CUDA graph is planned on rows of one length (an engine's dummy lengths, or the page table's bound during
    capture) and replayed on ragged ones. Planned for uniform rows only, 34 rows over 8 KV heads got one split, so a
    replay's long row ran alone in one program per head: Triton 3.0x behind FA3 on a ragged 34-row graph replay
    (H100, held-out seed 7777's timing). A uniform plan now keeps room for a long row's splits, bounded by the
    programs a replay may launch; a plan on ragged lengths it has read keeps its exact count."""
    assert tb.decode_splits(34, 8, 1, 34, 64, 132)[0] == 1
    assert tb.decode_splits(34, 8, 1, 34, 64, 132, ragged_room=True)[0] == 8  # 8 x the one uniform rows use
    assert tb.decode_splits(16, 8, 1, 16, 64, 132, ragged_room=True)[0] == 24  # 8 x 3
    assert tb.decode_splits(2, 8, 1, 2, 64, 132, ragged_room=True)[0] == 64  # at most 64
    assert tb.decode_splits(128, 8, 1, 128, 64, 132, ragged_room=True)[0] == 3  # at most 8 x 396 programs
    assert tb.decode_splits(512, 8, 1, 512, 64, 132, ragged_room=True)[0] == 1
    assert tb.decode_splits(1, 8, 1, 1, 64, 132, ragged_room=True)[0] == 50  # one row is never ragged


@pytest.mark.parametrize("lens,room", [([1] * 6, True), ([300] * 6, True), ([0, 1, 1, 1, 1, 1], True),
                                       ([5, 300, 7, 9, 2, 40], False)])
def test_decode_plans_ask_for_ragged_room_on_uniform_rows_only(monkeypatch, lens, room):
    """plan_decode asks decode_splits for ragged room when every row it reads is as long, padding rows of 0 aside (a
    capture's dummy rows), and during capture (no read); a ragged batch it has read gets its exact count."""
    from tests.fixtures.host_reads import planning_in_capture

    seen = []
    monkeypatch.setattr(tb, "decode_splits", lambda *a, ragged_room=False, **k: seen.append(ragged_room) or (1, 2**30, 1))
    spec = _spec()
    table = torch.arange(6 * 20, dtype=torch.int32).reshape(6, 20)
    get("triton").plan_decode(spec, table, torch.tensor(lens, dtype=torch.int32))
    assert seen == [room]
    with planning_in_capture(monkeypatch):
        get("triton").plan_decode(spec, table, torch.tensor(lens, dtype=torch.int32))
    assert seen == [room, True]


def test_decode_splits_follow_the_lengths_of_each_run(monkeypatch):
    """A plan made at long contexts and run at short ones (a CUDA graph captured at the longest context, replayed
    as the batch grows) still spreads each row over several splits: the kernel sizes its chunks from the lengths
    it reads, not from the plan's. Observed in the split buffers: a split that read nothing has lse = -inf."""
    lse_parts = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dim() == 3 and t.dtype == torch.float32:  # lse_part [batch, heads, splits]
            lse_parts.append(t)
        return t

    spec = _spec(page_size=16)  # 2 KV heads
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (8, 16, 32))  # aim at 16 programs, chunks >= 32 tokens
    long = decode_case(spec, CPU, [1024, 1024])
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", recording_empty)
        run = get("triton").plan_decode(spec, *long.plan_args)
    (lse,) = lse_parts
    _assert_close(run(*long.inputs), long.ref)
    assert (lse > float("-inf")).sum(-1).tolist() == [[4] * 8] * 2  # 2048 x 2 / 16 = 256 tokens a chunk: 4 splits
    page_table, seq_lens = long.plan_args
    seq_lens.fill_(256)  # the same plan, run at a quarter of the length
    q, k_cache, v_cache = long.inputs
    out = run(q, k_cache, v_cache)
    assert (lse > float("-inf")).sum(-1).tolist() == [[4] * 8] * 2  # 512 x 2 / 16 = 64 a chunk: still 4 splits
    for b in range(2):  # each row against the float32 reference over its first 256 keys
        keys = lambda cache: cache[page_table[b, :16].long()].reshape(256, 2, 64).float()  # noqa: E731
        ref = reference(q[b:b + 1], keys(k_cache), keys(v_cache), spec.scale, causal=False)[0]
        _assert_close(out[b:b + 1], ref[None])


def test_decode_window_reads_only_the_window(monkeypatch):
    """Pages wholly before the window are NaN: a kernel that reads them (0 x NaN) outputs NaN."""
    spec = _spec(page_size=16, sliding_window=20)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (2, 2**30, 1))
    case = decode_case(spec, CPU, [130, 64], "nan_page")
    page_table = case.plan_args[0]
    q, k_cache, v_cache = case.inputs
    for b, n in enumerate([130, 64]):
        for p in range((n - 20) // 16):  # pages that end before the window starts
            k_cache[page_table[b, p]] = float("nan")
            v_cache[page_table[b, p]] = float("nan")
        page_table[b, : (n - 20) // 16 - 1] = -1  # and their table entries are sentinels
    _assert_close(case.run(get("triton"), spec), case.ref)


@pytest.mark.parametrize("splits", [pytest.param(1, marks=SLOW), 3], ids=["single", "split"])
def test_decode_softcap(splits, monkeypatch):
    spec = _spec(page_size=16, softcap=2.0)  # unit-variance q.k / 8: some scores beyond the cap
    out, ref = _decode(spec, splits, monkeypatch)
    _assert_close(out, ref)


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
def test_decode_sinks(splits, monkeypatch):
    out, ref = _decode(_spec(page_size=16, sinks=True), splits, monkeypatch)
    _assert_close(out, ref)
    assert out[0].abs().max().item() == 0  # zero-length row with sinks: still zeros


@pytest.mark.parametrize("dtype,splits", grid(["fp16", "bf16"], {("fp16", 1), ("bf16", 3)}))
def test_decode_fp8_cache_with_scales(dtype, splits, monkeypatch):
    out, ref = _decode(_spec(dtype, page_size=16, kv_dtype="fp8_e4m3"), splits, monkeypatch)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("splits", [pytest.param(1, marks=SLOW), 3], ids=["single", "split"])
def test_decode_all_features_page_5(splits, monkeypatch):
    spec = _spec(page_size=5, sliding_window=23, softcap=3.0, sinks=True, kv_dtype="fp8_e4m3")
    out, ref = _decode(spec, splits, monkeypatch, sentinel=-1)
    _assert_close(out, ref)


def test_decode_fp8_needs_scales():
    spec = _spec(kv_dtype="fp8_e4m3")
    case = decode_case(spec, CPU, [3], -1)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        get("triton").plan_decode(spec, *case.plan_args)(*case.inputs)


def test_unsupported_names_window_without_causal():
    reason = get("triton").unsupported(_spec(sliding_window=4, causal=False), "prefill")
    assert "sliding window with non-causal" in reason
    assert get("triton").unsupported(_spec(sliding_window=4, softcap=1.0, sinks=True, kv_dtype="fp8_e4m3"),
                                     "decode") is None


# By default the variants with every feature on (where the interpreter lets most through); the slow stage compiles
# every variant and reads the PTX (fp8 operands in words, the merge's ordering, no spills).
ALL_FEATURES = ["prefill all", "decode nosplit all fp8", "decode split all fp8", "reduce sinks"]


@pytest.mark.parametrize("checks", [pytest.param(ALL_FEATURES, id="all-features"),
                                    pytest.param([], id="every-variant", marks=pytest.mark.slow)])
def test_kernels_compile_for_hopper_without_a_gpu(checks):
    """Every feature combination compiles to sm_90 code (the interpreter does not type-check like the compiler)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"Triton's bundled ptxas is missing ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ["ATTNSEL_CACHE_DIR"]) / "triton")
    proc = subprocess.run([sys.executable, "-m", "tests.fixtures.triton_compile_check", *checks], capture_output=True,
                          text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("OK ") == (len(checks) or 28)


def test_version_changes_with_the_kernel_sources(tmp_path, monkeypatch):
    """The cache key must change when our kernels change, not only with the triton package."""
    import hashlib
    from pathlib import Path

    src = Path(tb.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(src.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    assert get("triton").version().endswith("+kernels." + digest.hexdigest()[:12])
    for path in src.glob("*.py"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "kernels.py").write_text((src / "kernels.py").read_text() + "\n# a changed kernel\n")
    monkeypatch.setattr(tb, "__file__", str(tmp_path / "__init__.py"))
    tb.sources_hash.cache_clear()
    try:
        assert tb.sources_hash() != digest.hexdigest()[:12]
    finally:
        tb.sources_hash.cache_clear()


def test_prefill_window_with_very_negative_scores():
    """Rows whose first visited block lies left of their window, then only very negative scores (-800 before the
    softmax): the running max must stay -inf through the empty block, or exp underflows to 0/0."""
    spec = _spec(sliding_window=40)
    lq = lk = 83
    q = torch.full((lq, 8, 64), 10.0, dtype=torch.float16)
    k = torch.full((lk, 2, 64), -10.0, dtype=torch.float16)
    v = torch.randn(lk, 2, 64, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    cu = torch.tensor([0, lq], dtype=torch.int32)
    out = get("triton").plan_prefill(spec, cu, cu, lq, lk)(q, k, v)
    assert torch.isfinite(out).all()
    # equal scores: each query averages the values of its window
    for i in (0, 39, 40, 82):
        lo = max(0, i - 39)
        ref = v[lo:i + 1].float().mean(0).repeat_interleave(4, 0)
        assert (out[i].float() - ref).abs().max().item() <= TOL["fp16"]


def test_prefill_long_offsets_variant(monkeypatch):
    """The 64-bit-inside-a-sequence variant (chosen for sequences whose rows x stride pass 2^31) computes the same:
    forced here by lowering the threshold."""
    monkeypatch.setattr(tb, "INT32_OFFSETS", 1)
    spec = _spec(sliding_window=40, softcap=8.0, sinks=True)
    out, ref, _ = _prefill(spec, q_mul=2.0)
    assert (out.float() - ref).abs().max().item() <= TOL["fp16"] * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
def test_decode_takes_q_in_flash_layout(splits, monkeypatch):
    """q as FlashAttention's [batch, 1, heads, dim] (decode_takes_b1hd): the same numbers as [batch, heads, dim],
    out in q's layout, on the single and split (reduce kernel) paths; sinks and a window on so every store runs.
    Fails when the kernels index heads with stride(1) (that is the unit axis of a [B, 1, H, D] tensor)."""
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 1))
    spec = _spec(page_size=16, sliding_window=40, sinks=True)
    case = decode_case(spec, CPU, DECODE_LENS)
    assert tb.BACKEND.decode_takes_b1hd is True
    run = get("triton").plan_decode(spec, *case.plan_args)
    q, k_cache, v_cache = case.inputs
    out4 = run(q.unsqueeze(1), k_cache, v_cache, **case.kwargs)
    assert out4.shape == (q.shape[0], 1, *q.shape[1:])
    _assert_close(out4[:, 0], case.ref)
    assert torch.equal(out4[:, 0], run(q, k_cache, v_cache, **case.kwargs))


@pytest.mark.parametrize("merge", [True, False], ids=["merge-in-kernel", "reduce-kernel"])
def test_decode_split_plan_merges_on_every_run(merge, monkeypatch):
    """A split plan run three times with new queries and a new length (as a CUDA graph replays one plan): every
    run's output against the float32 reference, with the output buffer NaN before each run (an unmerged head stays
    NaN), sinks on. In-kernel merge: the last program of each (row, KV head) merges and sets its arrival count
    back to 0; fails when the count is not reset (the next run has no last program). The interpreter runs the
    programs one after another, so a merge by a program that is not the last (before the others wrote) is caught
    only on the GPU (tests/test_gpu.py::test_triton_split_decode_merges_under_concurrency)."""
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", merge)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (3, 2**30, 1))
    real_zeros, real_empty_like, counts = torch.zeros, torch.empty_like, []

    def recording_zeros(*args, **kwargs):
        t = real_zeros(*args, **kwargs)
        if kwargs.get("dtype") == torch.int32:
            counts.append(t)
        return t

    spec = _spec(page_size=16, sinks=True)
    case = decode_case(spec, CPU, DECODE_LENS)
    with monkeypatch.context() as m:
        m.setattr(torch, "zeros", recording_zeros)
        run = get("triton").plan_decode(spec, *case.plan_args)
    assert len(counts) == (1 if merge else 0)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    q, k_cache, v_cache = case.inputs
    page_table, seq_lens = case.plan_args
    for step in range(3):
        if step == 2:
            seq_lens.clamp_(max=20)  # shorter rows: fewer splits used, the rest empty
        q = torch.randn_like(q)
        out = run(q, k_cache, v_cache, **case.kwargs)
        for b, n in enumerate(seq_lens.tolist()):
            keys = lambda cache: cache[page_table[b].long()].reshape(-1, 2, 64)[:n].float()  # noqa: E731
            ref = reference(q[b:b + 1], keys(k_cache), keys(v_cache), spec.scale, causal=False,
                            sinks=case.kwargs["sinks"])[0]
            _assert_close(out[b:b + 1], ref[None])
        if merge:
            assert counts[0].abs().sum().item() == 0, "arrival counts not back at 0 after the run"


def test_decode_run_captured_into_a_graph_takes_the_reduce_kernel(monkeypatch):
    """A split plan merges in the decode kernel when run eagerly (one launch), but a run captured into a CUDA graph
    launches the reduce kernel (on an H200 the in-kernel merge is 1.02-1.9x slower under graphs); both right."""
    import attnsel.backends.support as support

    launches = []
    _counting_reduce(monkeypatch, launches)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (3, 2**30, 1))
    spec = _spec(page_size=16)
    case = decode_case(spec, CPU, DECODE_LENS)
    run = get("triton").plan_decode(spec, *case.plan_args)
    eager = run(*case.inputs, **case.kwargs)
    assert launches == []
    _assert_close(eager, case.ref)
    monkeypatch.setattr(support, "capturing", lambda t: True)
    captured = run(*case.inputs, **case.kwargs)
    assert len(launches) == 1
    _assert_close(captured, case.ref)


def _counting_reduce(monkeypatch, launches):
    import attnsel.backends.triton.kernels as kernels

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launches.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(kernels, "paged_reduce_kernel", Counting(kernels.paged_reduce_kernel))


def test_decode_plan_made_during_capture_never_merges_in_the_kernel(monkeypatch):
    """A plan made while a CUDA graph is captured gets its arrival counts from the graph's pool, zeroed only when
    the graph first replays: an eager run of it before then would read garbage counts. So such a plan always merges
    in the reduce kernel, eager runs included, and allocates no counts."""
    import attnsel.backends.support as support

    launches, int32_zeros = [], []
    _counting_reduce(monkeypatch, launches)
    real_zeros = torch.zeros
    def zeros(*a, **kw):
        if kw.get("dtype") == torch.int32:
            int32_zeros.append(1)
        return real_zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (3, 2**30, 1))
    spec = _spec(page_size=16)
    case = decode_case(spec, CPU, DECODE_LENS)
    monkeypatch.setattr(support, "capturing", lambda t: True)
    run = get("triton").plan_decode(spec, *case.plan_args)
    assert int32_zeros == []
    monkeypatch.setattr(support, "capturing", lambda t: False)
    out = run(*case.inputs, **case.kwargs)
    assert len(launches) == 1
    _assert_close(out, case.ref)


def test_decode_merge_survives_arrival_counts_left_by_overlapping_runs(monkeypatch):
    """While two runs of one plan overlap (two streams) a group's arrival count passes multiples of the splits
    other than 0 (one run's last program subtracts after the other's programs have counted on); with an equality
    test the count would stay at the splits for good and no later run would merge (no output at all). The last
    arrival is found modulo the splits: a run starting from such a count still merges, and leaves it as it found
    it."""
    counts = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: (counts.append(real_zeros(*a, **kw)) or counts[-1])
                        if kw.get("dtype") == torch.int32 else real_zeros(*a, **kw))
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (3, 2**30, 1))
    spec = _spec(page_size=16)
    case = decode_case(spec, CPU, DECODE_LENS)
    run = get("triton").plan_decode(spec, *case.plan_args)
    (arrived,) = counts
    _assert_close(run(*case.inputs, **case.kwargs), case.ref)
    assert torch.equal(arrived, torch.zeros_like(arrived))
    for left in (3, 6):  # what overlapping runs leave: multiples of the 3 splits
        arrived.fill_(left)
        for _ in range(2):
            _assert_close(run(*case.inputs, **case.kwargs), case.ref)
            assert torch.equal(arrived, torch.full_like(arrived, left))


def test_decode_merge_tile_past_the_limit_takes_the_reduce_kernel(monkeypatch):
    """head_dim 256 with 64 splits: the in-kernel merge's [64, 256] float32 tile makes the decode kernel spill
    (tests/fixtures/triton_compile_check.py), so such a plan merges in the reduce kernel (no arrival counts); 32 splits
    merge in the kernel."""
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    real_zeros, counts = torch.zeros, []
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: counts.append(kw.get("dtype")) or real_zeros(*a, **kw))
    spec = AttentionSpec(8, 2, 256, dtype="fp16", page_size=16)
    case = decode_case(spec, CPU, [40, 3])
    for splits, merges in ((64, False), (33, False), (32, True)):
        counts.clear()
        monkeypatch.setattr(tb, "decode_splits", lambda *a, n=splits, **k: (n, 2**30, 1))
        get("triton").plan_decode(spec, *case.plan_args)
        assert (torch.int32 in counts) is merges, splits


@pytest.mark.parametrize("window", [pytest.param(None, marks=SLOW), 40], ids=["full", "w40"])
def test_decode_plan_during_graph_capture_reads_nothing_on_the_host(window, monkeypatch):
    """A decode plan made during CUDA-graph capture (attnsel.flash_attn_with_kvcache plans there) may not read seq_lens
    on the host (a sync is an error during capture): it plans from the page table's width instead, and the run is still
    right for every row, zero-length ones included."""
    from tests.fixtures.host_reads import planning_in_capture

    spec = _spec(page_size=16, sliding_window=window)
    case = decode_case(spec, CPU, DECODE_LENS)
    with planning_in_capture(monkeypatch):
        run = get("triton").plan_decode(spec, *case.plan_args)
    out = run(*case.inputs, **case.kwargs)
    _assert_close(out, case.ref)
    assert out[0].abs().max().item() == 0 and out[4].abs().max().item() == 0


def test_strided_metadata_and_sinks_are_read_right(monkeypatch):
    """Metadata and sinks handed over as views with strides of their own (a column of an engine's [batch, 2]
    lengths tensor, every other column of a wider page table, every other element of a sinks buffer, cu_seqlens
    from a [batch + 1, 2] tensor): the kernels index them with stride 1, so the plans must make them contiguous.
    Before the fix the decode read wrong lengths (wrong numbers or an out-of-bounds read)."""
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (3, 2**30, 1))
    spec = _spec(page_size=16, sinks=True)
    case = decode_case(spec, CPU, DECODE_LENS)
    table, lens = case.plan_args
    wide = torch.full((table.shape[0], 2 * table.shape[1]), -1, dtype=torch.int32)
    wide[:, ::2] = table
    pair = torch.stack((lens, torch.zeros_like(lens)), dim=1)
    sinks2 = torch.stack((case.kwargs["sinks"], torch.full_like(case.kwargs["sinks"], 50.0)), dim=1)
    run = get("triton").plan_decode(spec, wide[:, ::2], pair[:, 0])
    out = run(*case.inputs, sinks=sinks2[:, 0])
    _assert_close(out, case.ref)

    pspec = _spec(sinks=True)
    pcase = prefill_case(pspec, CPU, PREFILL_LQ, PREFILL_LK)
    cu_q, cu_k, max_q, max_k = pcase.plan_args
    cu2 = lambda cu: torch.stack((cu, torch.zeros_like(cu)), dim=1)[:, 0]  # noqa: E731
    run = get("triton").plan_prefill(pspec, cu2(cu_q), cu2(cu_k), max_q, max_k)
    psinks = torch.stack((pcase.kwargs["sinks"], torch.zeros_like(pcase.kwargs["sinks"])), dim=1)[:, 0]
    _assert_close(run(*pcase.inputs, sinks=psinks), pcase.ref)


def test_the_prefill_only_fa3_variant_does_not_claim_the_decode_layout():
    from attnsel.backends import decode_takes_b1hd

    assert [n for n in ("fa3", "fa3_packgqa", "fa3_split", "triton", "torch", "flashinfer")
            if decode_takes_b1hd(get(n))] == ["fa3", "fa3_packgqa", "triton"]


@pytest.mark.parametrize("bad,words", [(-5, "seq_lens[2] is -5"), (49, "seq_lens[2] is 49")])
def test_triton_decode_eager_plan_refuses_lengths_its_read_shows_wrong(bad, words):
    """The eager decode plan reads the lengths on the host (its split count): a negative length gave zeros silently,
    and one past the page table's reach (3 pages x 16 = 48 tokens) read the next row's page ids. That read refuses
    both, naming the row and what is allowed."""
    spec = _spec()
    table = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    lens = torch.tensor([5, 48, bad, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^triton decode: " + re.escape(words) + r"; allowed: 0 .* 48 tokens"):
        get("triton").plan_decode(spec, table, lens)
