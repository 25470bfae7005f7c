"""GPU suite: every backend x phase x spec against the float32 reference (skipped without CUDA).

Each outcome (error, tolerance, or the reason a backend is unavailable) is appended as one JSON line to
$ATTNSEL_GPU_RESULTS when set, which `scripts/gpu-bench tests` saves with the run.
FlashInfer JIT-compiles each dtype/head_dim for about two minutes on a fresh machine; ATTNSEL_GPU_FLASHINFER=main
limits it to the bf16/d128 family (compiled once), =all (default) compiles every spec.
"""
import json
import os

import pytest
import torch

from attnsel.backends import BUILTINS, get
from attnsel.spec import AttentionSpec
from attnsel.validate import cases, spot
from attnsel.validate.cases import check_output

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPECS = {
    "gqa4-d128-bf16": AttentionSpec(32, 8, 128, "bf16", 16),
    "gqa7-d128-bf16": AttentionSpec(28, 4, 128, "bf16", 16),
    "mqa-d128-bf16": AttentionSpec(32, 1, 128, "bf16", 16),
    "mha-d128-fp16": AttentionSpec(16, 16, 128, "fp16", 16),
    "gqa4-d64-bf16": AttentionSpec(32, 8, 64, "bf16", 16),
    "gqa4-d96-bf16": AttentionSpec(16, 4, 96, "bf16", 16),
    "gqa4-d256-bf16": AttentionSpec(16, 4, 256, "bf16", 16),
    "gqa4-d128-fp16-page1": AttentionSpec(32, 8, 128, "fp16", 1),
    "gqa8-d128-bf16-page64": AttentionSpec(32, 4, 128, "bf16", 64),
}
MAIN_FAMILY = {"gqa4-d128-bf16", "gqa7-d128-bf16", "mqa-d128-bf16", "gqa8-d128-bf16-page64"}


def _record(**row):
    path = os.environ.get("ATTNSEL_GPU_RESULTS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def built_cases():
    store = {}

    def get_case(key, phase):
        if (key, phase) not in store:
            store[(key, phase)] = cases.make_case(SPECS[key], phase, torch.device("cuda"))
        return store[(key, phase)]

    return get_case


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name", list(BUILTINS))
@pytest.mark.parametrize("key", list(SPECS))
def test_backend_against_reference(key, name, phase, built_cases):
    spec = SPECS[key]
    backend = get(name)
    reason = backend.unsupported(spec, phase)
    if reason:
        _record(spec=key, backend=name, phase=phase, status="unavailable", reason=reason)
        if name == "fa3" and spec.head_dim == 96:
            assert "head_dim 96 is not supported by this FA3 build" in reason
        pytest.skip(reason)
    if name.startswith("flashinfer") and os.environ.get("ATTNSEL_GPU_FLASHINFER") == "main" \
            and key not in MAIN_FAMILY:
        pytest.skip("FlashInfer JIT for this dtype/head_dim: run with ATTNSEL_GPU_FLASHINFER=all")
    case = built_cases(key, phase)
    out = cases.run_case(backend, spec, case)
    torch.cuda.synchronize()
    result = check_output(spec, out, case)
    _record(spec=key, backend=name, phase=phase, **result)
    assert result["status"] == "valid", result["reason"]


def test_fa3_reports_head_dim_96_as_unsupported():
    reason = get("fa3").unsupported(SPECS["gqa4-d96-bf16"], "prefill")
    if reason and "not installed" in reason:
        pytest.skip(reason)
    assert reason == "head_dim 96 is not supported by this FA3 build (supported: 64, 128, 192, 256)"


def test_selection_on_gpu_is_measured_and_cached(tmp_path):
    from attnsel import select

    spec = SPECS["gqa4-d128-bf16"]
    cold = select(spec, cache_dir=str(tmp_path), prefill_priority=["triton", "torch"],
                  decode_priority=["triton", "torch"])
    assert all(c.score_us for p in ("prefill", "decode") for c in cold.candidates[p])
    warm = select(spec, cache_dir=str(tmp_path), prefill_priority=["triton", "torch"],
                  decode_priority=["triton", "torch"])
    assert warm.cache == "hit" and (warm.prefill, warm.decode) == (cold.prefill, cold.decode)


def test_graph_mode_timing_captures_every_backend(tmp_path):
    from attnsel import select

    sel = select(SPECS["gqa4-d128-bf16"], mode="graph", cache_dir=str(tmp_path),
                 prefill_priority=["fa3", "triton", "torch"], decode_priority=["fa3", "triton", "torch"])
    for phase in ("prefill", "decode"):
        for c in sel.candidates[phase]:
            if c.status in ("valid", "selected"):
                assert c.score_us, f"{c.name} {phase}: {c.reason}"


# --------------------------------------------------------------------------- features and the decode contract

FEATURE_SPECS = {
    "window256": AttentionSpec(32, 8, 128, "bf16", 16, sliding_window=256),
    "softcap30": AttentionSpec(32, 8, 128, "bf16", 16, softcap=30.0),
    "sinks": AttentionSpec(32, 8, 128, "bf16", 16, sinks=True),
    "fp8kv": AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype="fp8_e4m3"),
    "gemma2-like": AttentionSpec(16, 8, 256, "bf16", 16, sliding_window=512, softcap=50.0),
    "gptoss-like": AttentionSpec(64, 8, 64, "bf16", 16, sliding_window=128, sinks=True),
    "all-fp16-page64": AttentionSpec(32, 4, 128, "fp16", 64, sliding_window=300, softcap=30.0, sinks=True,
                                     kv_dtype="fp8_e4m3"),
}
# FlashInfer JIT-builds one module per feature combination and template (a minute or two each): by default only
# `flashinfer` on four feature specs;
# ATTNSEL_GPU_FLASHINFER_FEATURES=all runs every variant on every feature spec.
FLASHINFER_DEFAULT = {("flashinfer", "window256"), ("flashinfer", "softcap30"), ("flashinfer", "fp8kv"),
                      ("flashinfer", "gptoss-like")}
PREFILL_LQ, PREFILL_LK = [1, 13, 97, 1031, 61], [1, 13, 97, 1031, 263]
DECODE_LENS = [0, 1, 17, 1531, 45, 300, 0]  # zero-length rows: CUDA-graph padding


@pytest.fixture(scope="module")
def feature_cases():
    from tests.fixtures.feature_cases import decode_case, prefill_case

    store = {}

    def get_case(key, phase):
        if (key, phase) not in store:
            spec, dev = FEATURE_SPECS[key], torch.device("cuda")
            q_mul = 4.0 if spec.softcap else 1.0  # logits beyond the cap
            store[(key, phase)] = (prefill_case(spec, dev, PREFILL_LQ, PREFILL_LK, q_mul=q_mul) if phase == "prefill"
                                   else decode_case(spec, dev, DECODE_LENS, sentinel=-1))
        return store[(key, phase)]

    return get_case


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name", list(BUILTINS))
@pytest.mark.parametrize("key", list(FEATURE_SPECS))
def test_feature_against_reference(key, name, phase, feature_cases):
    """Each backend on each feature spec: valid against the float32 reference, or the reason names the feature."""
    spec = FEATURE_SPECS[key]
    backend = get(name)
    reason = backend.unsupported(spec, phase)
    if reason:
        _record(spec=key, backend=name, phase=phase, status="unavailable", reason=reason)
        pytest.skip(reason)
    if name.startswith("flashinfer") and os.environ.get("ATTNSEL_GPU_FLASHINFER_FEATURES") != "all" \
            and (name, key) not in FLASHINFER_DEFAULT:
        pytest.skip("FlashInfer JIT for this feature combination: ATTNSEL_GPU_FLASHINFER_FEATURES=all")
    case = feature_cases(key, phase)
    out = case.run(backend, spec)
    torch.cuda.synchronize()
    err, tol = case.error(out), case.tolerance(spec)
    _record(spec=key, backend=name, phase=phase, status="valid" if err <= tol else "rejected", max_abs_err=err,
            tolerance=tol, low_precision_err=case.low_err)
    assert out.shape == case.ref.shape and out.dtype == spec.torch_dtype
    assert err <= tol, f"{name} {phase} {key}: max abs error {err:.3g} > tolerance {tol:.3g}"
    if phase == "decode":
        zero_rows = [i for i, n in enumerate(DECODE_LENS) if n == 0]
        assert out[zero_rows].abs().max().item() == 0, "zero-length rows must be zeros"


B1HD = [n for n in BUILTINS if getattr(get(n), "decode_takes_b1hd", False)]


@pytest.mark.parametrize("key", ["plain", "window256", "sinks", "fp8kv"])
@pytest.mark.parametrize("name", B1HD)
def test_decode_in_flash_layout_matches_bhd(name, key):
    """A backend with decode_takes_b1hd (FA3, Triton) takes q [B, 1, H, D] with no view: out [B, 1, H, D] equal
    to the [B, H, D] call's, within tolerance of the float32 reference, zero-length rows zeros."""
    from tests.fixtures.feature_cases import decode_case

    spec = SPECS["gqa4-d128-bf16"] if key == "plain" else FEATURE_SPECS[key]
    backend = get(name)
    reason = backend.unsupported(spec, "decode")
    if reason:
        pytest.skip(reason)
    case = decode_case(spec, torch.device("cuda"), DECODE_LENS, sentinel=-1)
    run = backend.plan_decode(spec, *case.plan_args)
    q, k_cache, v_cache = case.inputs
    out4 = run(q.unsqueeze(1), k_cache, v_cache, **case.kwargs)
    out3 = run(q, k_cache, v_cache, **case.kwargs)
    torch.cuda.synchronize()
    err, tol = case.error(out4[:, 0]), case.tolerance(spec)
    _record(spec=f"b1hd-{key}", backend=name, phase="decode", max_abs_err=err, tolerance=tol)
    assert out4.shape == (q.shape[0], 1, *q.shape[1:]) and out4.dtype == q.dtype
    assert err <= tol, f"{name} [B, 1, H, D] {key}: max abs error {err:.3g} > tolerance {tol:.3g}"
    assert torch.equal(out4[:, 0], out3)
    zero_rows = [i for i, n in enumerate(DECODE_LENS) if n == 0]
    assert out4[zero_rows].abs().max().item() == 0


@pytest.mark.parametrize("name", [n for n in BUILTINS if n != "torch"])
def test_decode_contract_zero_length_and_sentinels(name):
    """Plain spec: zero-length rows, NaN in unused slots and pages, -1 and num_pages sentinels in the page table."""
    from tests.fixtures.feature_cases import decode_case

    spec = SPECS["gqa4-d128-bf16"]
    backend = get(name)
    reason = backend.unsupported(spec, "decode")
    if reason:
        pytest.skip(reason)
    for sentinel in ("nan_page", -1, "num_pages"):
        case = decode_case(spec, torch.device("cuda"), DECODE_LENS, sentinel=sentinel)
        out = case.run(backend, spec)
        torch.cuda.synchronize()
        err, tol = case.error(out), case.tolerance(spec)
        _record(spec="contract", backend=name, phase="decode", sentinel=str(sentinel), max_abs_err=err,
                tolerance=tol)
        assert err <= tol, f"{name} with sentinel {sentinel}: error {err:.3g} > {tol:.3g}"
        assert out[[0, 6]].abs().max().item() == 0


def test_triton_prefill_past_2_31_elements():
    """66 prefix-cached chunks (16 queries after 8192 keys) x 32 KV heads x 128: 2.2e9 elements per K/V tensor.
    The last chunks lie past 2^31 elements, where int32 offsets would fault."""
    from tests.fixtures.feature_cases import reference

    spec = AttentionSpec(32, 32, 128, "bf16", 16)
    chunks, lq, lk = 66, 16, 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(chunks * lq, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(chunks * lk, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(chunks * lk, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert k.numel() > 2**31
    cu_q = torch.arange(chunks + 1, device="cuda", dtype=torch.int32) * lq
    cu_k = torch.arange(chunks + 1, device="cuda", dtype=torch.int32) * lk
    out = get("triton").plan_prefill(spec, cu_q, cu_k, lq, lk)(q, k, v)
    torch.cuda.synchronize()
    for s in (0, chunks - 2, chunks - 1):
        qs, ks = slice(s * lq, (s + 1) * lq), slice(s * lk, (s + 1) * lk)
        ref = reference(q[qs, :4], k[ks, :4], v[ks, :4], spec.scale)
        err = (out[qs, :4].float() - ref).abs().max().item()
        assert err <= 1.6e-2, f"chunk {s}: max abs error {err:.3g}"


# batch, context, extra page-table columns
REUSE_SHAPES = [(1, 200, 0), (1, 700, 0), (12, 700, 0), (1, 9000, 0), (12, 700, 512), (64, 3000, 1024)]


@pytest.mark.parametrize("shape", REUSE_SHAPES, ids=[f"{b}x{c}+{x}" for b, c, x in REUSE_SHAPES])
@pytest.mark.parametrize("name", [n for n in BUILTINS if n != "torch"])
def test_decode_plan_reused_many_times_eager_and_graph(name, shape):
    """One plan run many times (every layer of a step, the timed samples), eagerly and as CUDA-graph replays over
    several input sets, with a table exactly as wide as needed or much wider (an engine's table): every output right.
    (On the H200 the bench saw wrong FA3 graph outputs and device faults: the timing freed plans while their graphs
    were replayed, see test_timing.py::test_graph_timing_keeps_each_plan_alive_as_long_as_its_graph.)"""
    from attnsel.validate import grid as bucket_grid
    from attnsel.validate import timing

    spec = SPECS["gqa4-d128-bf16"]
    backend = get(name)
    reason = backend.unsupported(spec, "decode")
    if reason:
        pytest.skip(reason)
    batch, ctx, extra = shape
    device = torch.device("cuda")
    (page_table, seq_lens), sets = bucket_grid.rotated_workloads(spec, "decode", (batch, ctx), device)  # > 2x L2
    if extra:
        page_table = torch.cat([page_table, torch.zeros(batch, extra, dtype=page_table.dtype, device=device)], 1)
    run = backend.plan_decode(spec, page_table, seq_lens)
    for _ in range(2):
        for i, s in enumerate(sets[:4]):
            reason = spot.spot_check(spec, "decode", (page_table, seq_lens), s, run(*s), {})
            assert reason is None, f"{name} eager, set {i}: {reason}"
    graph, outs = timing.capture(run, sets, device)  # the calls back to back, as the timing replays them
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (s, out) in enumerate(zip(sets, outs)):
            reason = spot.spot_check(spec, "decode", (page_table, seq_lens), s, out, {})
            assert reason is None, f"{name} graph replay, set {i}: {reason}"
    _record(spec="reuse", backend=name, phase="decode", shape=list(shape), result="ok")


# batch, context lengths of the rows: split plans of 2 to 50 splits, a ragged batch (rows use different splits)
MERGE_SHAPES = {"1x9000": [9000], "4x3000": [3000] * 4, "8-ragged": [9000, 17, 0, 300, 1200, 5, 64, 2048],
                "24x512": [512] * 24}


@pytest.mark.parametrize("lens", list(MERGE_SHAPES.values()), ids=list(MERGE_SHAPES))
def test_triton_split_decode_merges_under_concurrency(lens, monkeypatch):
    """Triton's split decode merges the splits inside the decode kernel when run eagerly (the last program of a row
    and KV head to arrive merges): under real concurrency a merge by a program that is not the last, or before the
    others' stores are visible, reads partials of the previous run. So every run gets a query other than the run
    before it (8 queries in turn): 200 eager runs, each within one bf16 ulp (+ 1e-5) per element of the plan that
    merges in a second kernel on the same query (checked against the float32 reference per row): the two merges sum
    in different orders (on an H200 and an H100: a few elements 1-2 ulps apart, the same ones each time a query came
    round), while a partial of the previous query is off by the outputs' own size (~1e-2). Then 50 CUDA-graph
    replays (a new query copied into the captured one, the graph's output NaN before each replay): a captured run
    takes the reduce kernel, bitwise equal."""
    import attnsel.backends.triton as tb
    from tests.fixtures.feature_cases import reference

    spec = SPECS["gqa4-d128-bf16"]
    torch.manual_seed(0)
    dev, ps, batch = torch.device("cuda"), spec.page_size, len(lens)
    pages = max(-(-n // ps) for n in lens) + 1
    k_cache = torch.randn(batch * pages, ps, 8, 128, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    qs = [torch.randn(batch, 32, 128, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert tb.decode_splits(batch, 8, max(lens), sum(lens), tb.decode_config(128).block_n, sms)[0] > 1
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", False)
    reduce_run = get("triton").plan_decode(spec, table, seq_lens)
    expected = [reduce_run(q, k_cache, v_cache) for q in qs]
    for b, n in enumerate(lens):
        keys = lambda cache: cache[table[b].long()].reshape(-1, 8, 128)[:n]  # noqa: E731
        ref = reference(qs[0][b:b + 1], keys(k_cache), keys(v_cache), spec.scale, causal=False)[0]
        err = (expected[0][b].float() - ref).abs().max().item()
        assert err <= 1.6e-2, f"row {b} ({n} tokens): max abs error {err:.3g}"
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    real_zeros, counts = torch.zeros, []

    def recording_zeros(*args, **kwargs):
        t = real_zeros(*args, **kwargs)
        if kwargs.get("dtype") == torch.int32:
            counts.append(t)
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "zeros", recording_zeros)
        run = get("triton").plan_decode(spec, table, seq_lens)
    assert len(counts) == 1, "the plan does not merge in the decode kernel"
    bad, worst = [], 0.0
    for i in range(200):
        out = run(qs[i % 8], k_cache, v_cache)
        want = expected[i % 8].float()
        diff = (out.float() - want).abs()
        # one bf16 ulp of the larger value, and 1e-5 absolute: near-zero outputs (a sum that cancels) differ by
        # more ulps (on an H100: 2 ulps on 2 elements of one query, every time it came round, at 4 x 3000)
        tol = torch.finfo(torch.bfloat16).eps * torch.maximum(out.float().abs(), want.abs()) + 1e-5
        worst = max(worst, diff.max().item())
        if (diff > tol).any():
            bad.append((i, diff.max().item(), (diff > tol).sum().item()))
    assert not bad, f"eager runs off the reduce kernel's output (run, max abs difference, elements): {bad[:8]}"
    assert counts[0].abs().sum().item() == 0, "arrival counts not back at 0 after the eager runs"
    static_q = qs[0].clone()
    run(static_q, k_cache, v_cache)  # warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run(static_q, k_cache, v_cache)
    for i in range(50):
        static_q.copy_(qs[(i + 1) % 8])
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, expected[(i + 1) % 8]), f"graph replay {i} differs from the reduce kernel's"
    _record(spec="split-merge", backend="triton", phase="decode", shape=lens, result="ok", eager_max_abs_diff=worst)
