"""Triton kernels (interpreted on CPU) with sliding window, softcap, sinks and fp8 KV against a float32 reference.

Also the decode contract: zero-length rows give zeros, and nothing past a sequence's length is read (NaN in unused
slots and pages, -1 / num_pages sentinels in unused page-table columns), on the single- and split-KV paths.
The reference below is written from the AttentionSpec docstring, independently of the kernels.
"""
import math

import pytest
import torch

import attnsel.backends.triton as tb
from attnsel.backends import get
from attnsel.spec import AttentionSpec

TOL = {"fp16": 2e-3, "bf16": 1.6e-2}  # validate.cases.TOL_FLOOR: output rounding to the dtype (|out| <= 1)


def reference(q, k, v, scale, *, causal=True, window=None, softcap=None, sinks=None):
    """float32 attention of one sequence: q [lq, H, D], k/v [lk, KVH, D]; queries are the last lq positions."""
    lq, lk = q.shape[0], k.shape[0]
    if lk == 0:
        return torch.zeros(q.shape, dtype=torch.float32)
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = (q @ k.transpose(1, 2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(lq)[:, None] + (lk - lq)
    pos_k = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep &= pos_k <= pos_q
    if window is not None:
        keep &= pos_k > pos_q - window
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(-1, lq, 1)], -1)
    p = s.softmax(-1)[..., :lk]
    return (p @ v).transpose(0, 1)


def _spec(dtype="fp16", **kw):
    return AttentionSpec(8, 2, 64, dtype=dtype, page_size=kw.pop("page_size", 16), **kw)


def _sinks(spec, gen):
    s = torch.randn(spec.num_q_heads, generator=gen) * 2
    s[0], s[1] = 12.0, -12.0  # a sink that takes nearly all the weight, one that takes none
    return s.float()


# ---------------------------------------------------------------- prefill

PREFILL_LQ, PREFILL_LK = [1, 7, 37, 83, 5], [1, 7, 37, 83, 70]  # ragged; the last: 5 queries after 65 cached keys


def _prefill(spec, *, q_mul=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dt = spec.torch_dtype
    q = (torch.randn(sum(PREFILL_LQ), spec.num_q_heads, spec.head_dim, generator=gen) * q_mul).to(dt)
    k = (torch.randn(sum(PREFILL_LK), spec.num_kv_heads, spec.head_dim, generator=gen) * q_mul).to(dt)
    v = torch.randn(sum(PREFILL_LK), spec.num_kv_heads, spec.head_dim, generator=gen).to(dt)
    sinks = _sinks(spec, gen) if spec.sinks else None
    cu_q = torch.tensor([0, *torch.tensor(PREFILL_LQ).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(PREFILL_LK).cumsum(0).tolist()], dtype=torch.int32)
    out = get("triton").plan_prefill(spec, cu_q, cu_k, max(PREFILL_LQ), max(PREFILL_LK))(q, k, v, sinks=sinks)
    refs = []
    for i in range(len(PREFILL_LQ)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        refs.append(reference(q[qs], k[ks], v[ks], spec.scale, causal=spec.causal, window=spec.sliding_window,
                              softcap=spec.softcap, sinks=sinks))
    return out, torch.cat(refs), (q, k, v, sinks, cu_q, cu_k)


@pytest.mark.parametrize("window", [1, 5, 32, 40, 1000], ids=lambda w: f"w{w}")
def test_prefill_sliding_window(window):
    """Windows of 1 token, inside a tile, exactly one interpreter tile (32), across tiles, longer than every
    sequence; the reference with window+1 differs, so an off-by-one at the boundary fails."""
    spec = _spec(sliding_window=window)
    out, ref, (q, k, v, _, cu_q, cu_k) = _prefill(spec)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() <= TOL["fp16"]
    if window < 83:
        wider = torch.cat([reference(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]],
                                     spec.scale, window=window + 1) for i in range(len(PREFILL_LQ))])
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


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
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


def _decode_case(spec, lens, sentinel, seed=1):
    """Cache full of NaN except the used slots; unused page-table columns hold ``sentinel`` ("nan_page": a real
    page full of NaN, so any read of it shows; -1 or "num_pages": engines' padding, out of range)."""
    gen = torch.Generator().manual_seed(seed)
    ps, kvh, d = spec.page_size, spec.num_kv_heads, spec.head_dim
    pages = [math.ceil(n / ps) for n in lens]
    num_pages = sum(pages) + 2
    nan_page = num_pages - 1
    kv_dt = spec.kv_torch_dtype
    k_cache = torch.full((num_pages, ps, kvh, d), float("nan")).to(kv_dt)
    v_cache = torch.full((num_pages, ps, kvh, d), float("nan")).to(kv_dt)
    fill = {"nan_page": nan_page, "num_pages": num_pages, -1: -1}[sentinel]
    page_table = torch.full((len(lens), max(pages) + 2), fill, dtype=torch.int32)
    order = torch.randperm(num_pages - 1, generator=gen)
    q = torch.randn(len(lens), spec.num_q_heads, d, generator=gen).to(spec.torch_dtype)
    k_scale = torch.tensor([0.5 if spec.kv_dtype else 1.0])
    v_scale = torch.tensor([1.7 if spec.kv_dtype else 1.0])
    sinks = _sinks(spec, gen) if spec.sinks else None
    ref = torch.empty(q.shape)
    used = 0
    for b, n in enumerate(lens):
        k = torch.randn(n, kvh, d, generator=gen).to(kv_dt)
        v = torch.randn(n, kvh, d, generator=gen).to(kv_dt)
        for p in range(pages[b]):
            page = int(order[used])
            used += 1
            page_table[b, p] = page
            rows = slice(p * ps, min((p + 1) * ps, n))
            k_cache[page, : rows.stop - rows.start] = k[rows]
            v_cache[page, : rows.stop - rows.start] = v[rows]
        ref[b] = reference(q[b:b + 1], k.float() * k_scale, v.float() * v_scale, spec.scale, causal=False,
                           window=spec.sliding_window, softcap=spec.softcap, sinks=sinks)[0]
    kwargs = {}
    if spec.sinks:
        kwargs["sinks"] = sinks
    if spec.kv_dtype:
        kwargs.update(k_scale=k_scale, v_scale=v_scale)
    return (q, k_cache, v_cache), page_table, torch.tensor(lens, dtype=torch.int32), kwargs, ref


def _decode(spec, splits, monkeypatch, lens=DECODE_LENS, sentinel="nan_page"):
    monkeypatch.setattr(tb, "num_splits", lambda *a: splits)
    inputs, page_table, seq_lens, kwargs, ref = _decode_case(spec, lens, sentinel)
    out = get("triton").plan_decode(spec, page_table, seq_lens)(*inputs, **kwargs)
    return out, ref


def _assert_close(out, ref, dtype="fp16"):
    """Within the dtype's rounding of the output (outputs beyond 1 in magnitude: relative to the largest)."""
    assert torch.isfinite(out.float()).all(), "NaN or inf in the output"
    assert (out.float() - ref).abs().max().item() <= TOL[dtype] * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
@pytest.mark.parametrize("sentinel", ["nan_page", -1, "num_pages"])
def test_decode_zero_length_rows_and_garbage_are_harmless(splits, sentinel, monkeypatch):
    out, ref = _decode(_spec(page_size=16), splits, monkeypatch, sentinel=sentinel)
    _assert_close(out, ref)
    assert out[0].abs().max().item() == 0 and out[4].abs().max().item() == 0  # zero-length rows are zeros


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
@pytest.mark.parametrize("window", [1, 16, 40, 500], ids=lambda w: f"w{w}")
def test_decode_sliding_window(window, splits, monkeypatch):
    out, ref = _decode(_spec(page_size=16, sliding_window=window), splits, monkeypatch)
    _assert_close(out, ref)


def test_decode_window_reads_only_the_window(monkeypatch):
    """Pages wholly before the window are NaN: a kernel that reads them (0 x NaN) outputs NaN."""
    spec = _spec(page_size=16, sliding_window=20)
    monkeypatch.setattr(tb, "num_splits", lambda *a: 2)
    inputs, page_table, seq_lens, kwargs, ref = _decode_case(spec, [130, 64], "nan_page")
    q, k_cache, v_cache = inputs
    for b, n in enumerate([130, 64]):
        for p in range((n - 20) // 16):  # pages that end before the window starts
            k_cache[page_table[b, p]] = float("nan")
            v_cache[page_table[b, p]] = float("nan")
        page_table[b, : (n - 20) // 16 - 1] = -1  # and their table entries are sentinels
    out = get("triton").plan_decode(spec, page_table, seq_lens)(q, k_cache, v_cache, **kwargs)
    _assert_close(out, ref)


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
def test_decode_softcap(splits, monkeypatch):
    spec = _spec(page_size=16, softcap=2.0)  # unit-variance q.k / 8: some scores beyond the cap
    out, ref = _decode(spec, splits, monkeypatch)
    _assert_close(out, ref)


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
def test_decode_sinks(splits, monkeypatch):
    out, ref = _decode(_spec(page_size=16, sinks=True), splits, monkeypatch)
    _assert_close(out, ref)
    assert out[0].abs().max().item() == 0  # zero-length row with sinks: still zeros


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_fp8_cache_with_scales(dtype, splits, monkeypatch):
    out, ref = _decode(_spec(dtype, page_size=16, kv_dtype="fp8_e4m3"), splits, monkeypatch)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
def test_decode_all_features_page_5(splits, monkeypatch):
    spec = _spec(page_size=5, sliding_window=23, softcap=3.0, sinks=True, kv_dtype="fp8_e4m3")
    out, ref = _decode(spec, splits, monkeypatch, sentinel=-1)
    _assert_close(out, ref)


def test_decode_fp8_needs_scales():
    spec = _spec(kv_dtype="fp8_e4m3")
    inputs, page_table, seq_lens, _, _ = _decode_case(spec, [3], -1)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        get("triton").plan_decode(spec, page_table, seq_lens)(*inputs)


def test_unsupported_names_window_without_causal():
    reason = get("triton").unsupported(_spec(sliding_window=4, causal=False), "prefill")
    assert "sliding window with non-causal" in reason
    assert get("triton").unsupported(_spec(sliding_window=4, softcap=1.0, sinks=True, kv_dtype="fp8_e4m3"),
                                     "decode") is None


def test_kernels_compile_for_hopper_without_a_gpu():
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
    proc = subprocess.run([sys.executable, "-m", "tests.triton_compile_check"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("OK ") == 8
