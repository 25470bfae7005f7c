"""The torch backend (the universal fallback) serves every spec feature: sliding window, softcap, sinks, fp8 KV cache,
prefill and decode, against the validation cases' float32 reference and against hand computations written from the
AttentionSpec docstring. GPU tests (marked gpu) run the same on CUDA and capture decode in a CUDA graph (run must
not sync with the host)."""
import math

import pytest
import torch

from attnsel.backends import get
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.spec import AttentionSpec
from attnsel.validate import cases

CPU = torch.device("cpu")
FEATURES = {
    "window3": {"sliding_window": 3},
    "window40": {"sliding_window": 40},
    "window1": {"sliding_window": 1},
    "softcap": {"softcap": 30.0},
    "sinks": {"sinks": True},
    "fp8": {"kv_dtype": "fp8_e4m3"},
    "gpt-oss": {"sliding_window": 7, "sinks": True},
    "gemma2": {"sliding_window": 9, "softcap": 50.0},
    "all": {"sliding_window": 5, "softcap": 20.0, "sinks": True, "kv_dtype": "fp8_e4m3"},
    "non-causal-window": {"causal": False, "sliding_window": 6},
}
SHAPES = [(4, 2, 64), (8, 1, 32), (4, 4, 64)]  # GQA, MQA, MHA


def _valid(spec: AttentionSpec, phase: str, device=CPU) -> dict:
    assert TORCH.unsupported(spec, phase) is None
    case = cases.make_case(spec, phase, device)
    out = cases.run_case(TORCH, spec, case)
    result = cases.check_output(spec, out, case)
    assert result["status"] == "valid", result["reason"]
    return result


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_torch_serves_every_feature(feature, dtype, phase):
    _valid(AttentionSpec(4, 2, 64, dtype, page_size=4, **FEATURES[feature]), phase)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv_d{s[2]}")
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_torch_features_across_shapes_and_pages(shape, page_size, phase):
    _valid(AttentionSpec(*shape, "fp16", page_size=page_size, **FEATURES["all"]), phase)


def test_unsupported_is_none_for_every_feature():
    spec = AttentionSpec(4, 2, 64, "bf16", sliding_window=8, softcap=30.0, sinks=True, kv_dtype="fp8_e4m3",
                         causal=False)
    assert TORCH.unsupported(spec, "prefill") is None and TORCH.unsupported(spec, "decode") is None
    assert get("torch") is TORCH


# --- hand computations, independent of the cases' reference ---------------------------------------------------------

def _dense(q, k, v, scale):
    """softmax(q k^T) v for one query row per head: q [H, D], k/v [L, H, D] (MHA), float64."""
    s = torch.einsum("hd,lhd->hl", q.double(), k.double()) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v.double())


def _paged(k, v, ps, fill=float("nan")):
    """One sequence's k/v [n, H, D] in a cache of shuffled pages; everything else NaN; page table padded with -1."""
    n = k.shape[0]
    pages = math.ceil(n / ps)
    order = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(0))
    k_cache = torch.full((pages + 3, ps, *k.shape[1:]), fill, dtype=k.dtype)
    v_cache = k_cache.clone()
    table = torch.full((1, pages + 2), -1, dtype=torch.int32)
    for p in range(pages):
        rows = slice(p * ps, min(n, (p + 1) * ps))
        k_cache[order[p], : rows.stop - rows.start] = k[rows]
        v_cache[order[p], : rows.stop - rows.start] = v[rows]
        table[0, p] = order[p]
    return table, k_cache, v_cache


@pytest.mark.parametrize("w", [1, 2, 7, 16])
def test_decode_window_is_exactly_w_keys_including_its_own(w):
    """A decode query at position n - 1 with window w sees keys n - w .. n - 1: the same as plain attention over the
    last w keys, not w + 1 or w - 1. Everything outside the window in the cache is NaN (only the window is read)."""
    spec = AttentionSpec(2, 2, 16, "fp32", page_size=4, sliding_window=w)
    gen = torch.Generator().manual_seed(w)
    n = w + 5
    q = torch.randn(1, 2, 16, generator=gen)
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    k_in, v_in = k.clone(), v.clone()
    k_in[: n - w], v_in[: n - w] = float("nan"), float("nan")  # outside the window: never read
    table, k_cache, v_cache = _paged(k_in, v_in, spec.page_size)
    out = TORCH.plan_decode(spec, table, torch.tensor([n], dtype=torch.int32))(q, k_cache, v_cache)[0]
    assert torch.allclose(out.double(), _dense(q[0], k[n - w:], v[n - w:], spec.scale), atol=1e-5)
    for wrong in (w + 1, w - 1):
        if wrong >= 1:
            assert not torch.allclose(out.double(), _dense(q[0], k[n - wrong:], v[n - wrong:], spec.scale), atol=1e-3)


@pytest.mark.parametrize("w", [1, 3, 8])
@pytest.mark.parametrize("lq,lk", [(12, 12), (4, 12), (1, 9)])
def test_prefill_window_per_query(w, lq, lk):
    """Prefill with window w: query r (absolute position i = lk - lq + r) sees keys i - w + 1 .. i."""
    spec = AttentionSpec(2, 2, 16, "fp32", sliding_window=w)
    gen = torch.Generator().manual_seed(lq * 100 + lk * 10 + w)
    q = torch.randn(lq, 2, 16, generator=gen)
    k, v = torch.randn(lk, 2, 16, generator=gen), torch.randn(lk, 2, 16, generator=gen)
    cu_q, cu_k = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32)
    out = TORCH.plan_prefill(spec, cu_q, cu_k, lq, lk)(q, k, v)
    for r in range(lq):
        i = lk - lq + r
        lo = max(0, i - w + 1)
        assert torch.allclose(out[r].double(), _dense(q[r], k[lo:i + 1], v[lo:i + 1], spec.scale), atol=1e-5)


def test_softcap_by_hand():
    spec = AttentionSpec(2, 2, 16, "fp32", softcap=5.0, causal=False)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16, generator=gen) * 6  # logits well past the cap
    k, v = torch.randn(10, 2, 16, generator=gen), torch.randn(10, 2, 16, generator=gen)
    out = TORCH.plan_prefill(spec, torch.tensor([0, 3]).int(), torch.tensor([0, 10]).int(), 3, 10)(q, k, v)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * spec.scale
    assert s.abs().max() > 3 * spec.softcap
    p = (5.0 * torch.tanh(s / 5.0)).softmax(-1)
    assert torch.allclose(out.double(), torch.einsum("hqk,khd->qhd", p, v.double()), atol=1e-5)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_sinks_by_hand(phase):
    """A sink s only joins the denominator: out = plain_out * Z / (Z + e^s), Z the plain softmax sum; a very
    negative sink changes nothing."""
    heads = 4
    spec = AttentionSpec(heads, 2, 16, "fp32", page_size=4, sinks=True)
    plain = AttentionSpec(heads, 2, 16, "fp32", page_size=4)
    gen = torch.Generator().manual_seed(5)
    n = 11
    q = torch.randn(1, heads, 16, generator=gen)
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    sinks = torch.tensor([-1e4, 0.0, 2.0, 8.0])
    if phase == "prefill":
        cu = (torch.tensor([0, 1]).int(), torch.tensor([0, n]).int(), 1, n)
        with_sinks = TORCH.plan_prefill(spec, *cu)(q, k, v, sinks=sinks)
        without = TORCH.plan_prefill(plain, *cu)(q, k, v)
    else:
        table, k_cache, v_cache = _paged(k, v, 4)
        lens = torch.tensor([n], dtype=torch.int32)
        with_sinks = TORCH.plan_decode(spec, table, lens)(q, k_cache, v_cache, sinks=sinks)
        without = TORCH.plan_decode(plain, table, lens)(q, k_cache, v_cache)
    s = torch.einsum("hd,khd->hk", q[0].double(), k.double().repeat_interleave(2, 1)) * spec.scale
    z = s.exp().sum(-1)
    expected = without[0].double() * (z / (z + sinks.double().exp()))[:, None]
    assert torch.allclose(with_sinks[0].double(), expected, atol=1e-5)
    assert torch.allclose(with_sinks[0, 0], without[0, 0], atol=1e-6)  # sink -1e4: no effect


def test_fp8_decode_equals_decode_on_the_dequantised_cache():
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, kv_dtype="fp8_e4m3")
    plain = AttentionSpec(4, 2, 64, "bf16", page_size=4)
    case = cases.decode_case(spec, CPU)
    out = cases.run_case(TORCH, spec, case)
    k = (case.k_cache.float() * case.k_scale).to(torch.bfloat16)
    v = (case.v_cache.float() * case.v_scale).to(torch.bfloat16)
    same = TORCH.plan_decode(plain, case.page_table, case.seq_lens)(case.q, k, v)
    assert torch.equal(out, same)


def test_decode_ignores_everything_past_each_sequence():
    """Inf in every unused slot and page, and every out-of-range sentinel in unused page-table columns: the output
    is the same as with a clean cache."""
    spec = AttentionSpec(4, 2, 32, "fp16", page_size=4)
    case = cases.decode_case(spec, CPU)
    out = cases.run_case(TORCH, spec, case)
    for fill in (float("inf"), float("-inf"), 0.0):
        k, v, table = case.k_cache.clone(), case.v_cache.clone(), case.page_table.clone()
        owned = torch.zeros(k.shape[:2], dtype=torch.bool)
        for b, n in enumerate(case.seq_lens.tolist()):
            used = math.ceil(n / spec.page_size)
            for p in range(used):
                owned[table[b, p], : min(spec.page_size, n - p * spec.page_size)] = True
            table[b, used:] = torch.tensor([-1, k.shape[0], 10**6, -(10**6)]).repeat(table.shape[1])[
                : table.shape[1] - used].int()
        k[~owned], v[~owned] = fill, fill
        again = TORCH.plan_decode(spec, table, case.seq_lens)(case.q, k, v)
        assert torch.equal(out, again)


def test_run_time_inputs_are_checked():
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, sinks=True, kv_dtype="fp8_e4m3")
    case = cases.decode_case(spec, CPU)
    run = TORCH.plan_decode(spec, case.page_table, case.seq_lens)
    args = (case.q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match=r"run needs sinks=, a float32 tensor \[4\]"):
        run(*args, k_scale=case.k_scale, v_scale=case.v_scale)
    with pytest.raises(ValueError, match=r"sinks must have shape \[4\]"):
        run(*args, sinks=case.sinks[:2], k_scale=case.k_scale, v_scale=case.v_scale)
    with pytest.raises(ValueError, match="run needs k_scale= and v_scale="):
        run(*args, sinks=case.sinks)
    plain = AttentionSpec(4, 2, 64, "bf16", page_size=4)
    plain_case = cases.decode_case(plain, CPU)
    plain_run = TORCH.plan_decode(plain, plain_case.page_table, plain_case.seq_lens)
    with pytest.raises(ValueError, match="sinks were passed but the spec has sinks=False"):
        plain_run(plain_case.q, plain_case.k_cache, plain_case.v_cache, sinks=case.sinks)
    with pytest.raises(ValueError, match="the spec has no fp8 KV cache"):
        plain_run(plain_case.q, plain_case.k_cache, plain_case.v_cache, k_scale=case.k_scale, v_scale=case.v_scale)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        TORCH.plan_decode(plain, plain_case.page_table, -plain_case.seq_lens)


def test_math_path_is_chunked_over_queries(monkeypatch):
    """Softcap/sinks run in float32 chunks of queries (bounded memory): any chunk size gives the same numbers."""
    import attnsel.backends.torch_sdpa as ts

    spec = AttentionSpec(4, 2, 64, "fp16", softcap=30.0, sinks=True)
    case = cases.prefill_case(spec, CPU)
    whole = cases.run_case(TORCH, spec, case)
    monkeypatch.setattr(ts, "MATH_CHUNK_ELEMS", 4 * 83 * 7)  # 7 query rows per chunk on the longest sequence
    chunked = cases.run_case(TORCH, spec, case)
    assert torch.equal(whole, chunked)


# --- GPU --------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_torch_features_on_gpu(dtype, feature, phase):
    _valid(AttentionSpec(32, 8, 128, dtype, page_size=16, **FEATURES[feature]), phase, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("feature", ["none", "all", "gpt-oss"])
def test_torch_decode_captures_in_a_cuda_graph(feature):
    """run does no host sync: it can be captured in a CUDA graph, and the replay is right."""
    spec = AttentionSpec(32, 8, 128, "bf16", page_size=16, **FEATURES.get(feature, {}))
    device = torch.device("cuda")
    case = cases.decode_case(spec, device)
    run = TORCH.plan_decode(spec, case.page_table, case.seq_lens)
    kwargs = cases.run_kwargs(spec, case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(case.q, case.k_cache, case.v_cache, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(case.q, case.k_cache, case.v_cache, **kwargs)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    result = cases.check_output(spec, out, case)
    assert result["status"] == "valid", result["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch,ctx,window", [(64, 4096, None), (256, 1024, None), (64, 4096, 512)])
def test_torch_decode_speed_vs_the_old_decode(batch, ctx, window, capsys):
    """Gathering only owned slots and zeroing the rest costs little against the old decode (which read up to the
    longest sequence through unused page-table columns); with a window the new one reads only the window. Prints
    the times (and appends them to $ATTNSEL_GPU_RESULTS); fails only on a gross regression (> 1.5x)."""
    import json
    import os

    from attnsel.validate.grid import make_decode_workload
    from attnsel.validate.timing import bench
    from tests.fixtures.fault_numerics import old_torch_plan_decode

    device = torch.device("cuda")
    spec = AttentionSpec(32, 8, 128, "bf16", page_size=16, sliding_window=window)
    load = make_decode_workload(spec, device, "speed", batch, ctx)
    new = TORCH.plan_decode(spec, *load.plan_args)
    new_us = bench(lambda: new(*load.inputs), device) * 1e6
    old_spec = AttentionSpec(32, 8, 128, "bf16", page_size=16)  # the old decode has no window: full context
    old = old_torch_plan_decode(old_spec, *load.plan_args)
    old_us = bench(lambda: old(*load.inputs), device) * 1e6
    row = {"test": "torch_decode_speed", "batch": batch, "ctx": ctx, "window": window, "new_us": new_us,
           "old_us": old_us}
    with capsys.disabled():
        print(json.dumps(row))
    if os.environ.get("ATTNSEL_GPU_RESULTS"):
        with open(os.environ["ATTNSEL_GPU_RESULTS"], "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert new_us <= 1.5 * old_us


@pytest.mark.parametrize("feature", [{}, {"softcap": 5.0}, {"sinks": True}, {"sliding_window": 8}])
def test_an_empty_batch_gives_an_empty_output(feature):
    """A step with no sequences (an engine's idle step): out [0, H, D] in decode, [0, H, D] in prefill, on every
    path, the softcap/sinks math path included (not a raw reshape error at batch 0)."""
    spec = AttentionSpec(8, 2, 64, dtype="fp32", page_size=16, **feature)
    kw = {"sinks": torch.zeros(8)} if feature.get("sinks") else {}
    run = TORCH.plan_decode(spec, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    out = run(torch.randn(0, 8, 64), torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64), **kw)
    assert out.shape == (0, 8, 64)
    cu = torch.zeros(1, dtype=torch.int32)
    run = TORCH.plan_prefill(spec, cu, cu, 0, 0)
    assert run(torch.randn(0, 8, 64), torch.randn(0, 2, 64), torch.randn(0, 2, 64), **kw).shape == (0, 8, 64)


def test_a_cache_of_no_pages_is_named():
    """Padding rows over a cache of 0 pages are refused, naming the cache (not a raw IndexError from the gather)."""
    from attnsel.selection import select

    sel = select(AttentionSpec(8, 2, 64, dtype="fp32", page_size=16), "torch", "torch", policy="priority",
                 use_cache=False)
    run = sel.plan_decode(torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^k_cache/v_cache hold 0 pages \(\[0, 16, 2, 64\]\); allowed: at least one"):
        run(torch.randn(2, 8, 64), torch.randn(0, 16, 2, 64), torch.randn(0, 16, 2, 64))
    # an idle step (no rows) before any page is allocated reads nothing: served, not refused by the check above
    run = sel.plan_decode(torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert run(torch.randn(0, 8, 64), torch.randn(0, 16, 2, 64), torch.randn(0, 16, 2, 64)).shape == (0, 8, 64)
