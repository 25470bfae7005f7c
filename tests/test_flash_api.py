"""attnsel.flash_attn_varlen_func / flash_attn_with_kvcache: FA3's calling convention over the selection.

Numbers against an independent float32 reference (explicit softmax per sequence); the torch backend runs fp32 and the
Triton kernels (interpreted on CPU) fp16. Feature mapping (window, softcap, sinks, fp8 descales) is checked on the
spec and run arguments the call produces, with the selection replaced by a recorder.
"""
import math
import os
import re

import pytest
import torch

import attnsel
from attnsel import flash_api
from attnsel.flash_api import UnsupportedArgument

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The selections these calls make validate in a worker thread (tests/fixtures/inproc_worker.py): the calls are
# under test here, not the worker process.
pytestmark = pytest.mark.usefixtures("inproc_worker")


@pytest.fixture(autouse=True)
def _fresh(tmp_path_factory, monkeypatch):
    # One result cache for the module: each distinct spec is validated once, not once per test.
    cache = tmp_path_factory.getbasetemp() / "flash_api_cache"
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(cache))
    flash_api.configure(policy="priority")
    yield
    flash_api.configure()


def reference(q, k, v, lens_q, lens_k, scale, causal=True, window=None, softcap=None, sinks=None):
    """float32 attention per sequence on packed [tokens, heads, dim] tensors; queries are the last keys."""
    outs, qs, ks = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for lq, lk in zip(lens_q, lens_k):
        qq = q[qs:qs + lq].double()
        kk = k[ks:ks + lk].double().repeat_interleave(group, 1)
        vv = v[ks:ks + lk].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(lk - lq, lk)[:, None]
        kpos = torch.arange(lk)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            keep &= kpos <= qpos
        if window:
            keep &= kpos > qpos - window
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
        m = s.amax(-1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sinks.double()[:, None, None])
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sinks.double()[:, None, None] - m)
        outs.append(torch.einsum("hqk,khd->qhd", p / denom, vv))
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs).float()


def ragged(lens_q, lens_k, hq, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(DEV, dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(DEV, dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(DEV, dtype)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)  # noqa
    return q, k, v, cu(lens_q), cu(lens_k)


LENS_Q, LENS_K = [1, 7, 17, 5], [1, 7, 23, 40]  # a 1, primes, Sq < Sk (chunked prefill), one longer


@pytest.mark.parametrize("backend,dtype,tol", [("torch", torch.float32, 1e-5), ("triton", torch.float16, 2e-3)])
def test_varlen_matches_reference_gqa(monkeypatch, backend, dtype, tol):
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", backend)
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged(LENS_Q, LENS_K, 4, 2, 16, dtype)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), LENS_Q, LENS_K, 16 ** -0.5)
    err = (out.float().cpu() - ref).abs().max().item()
    assert err < tol, err
    sel = next(iter(flash_api.default()._specs.values()))[1]
    assert sel.prefill == backend


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("backend,dtype,tol", [("torch", torch.float32, 1e-5), ("triton", torch.float16, 2e-3),
                                               ("fa3", torch.bfloat16, 1.6e-2),
                                               ("flashinfer", torch.bfloat16, 1.6e-2)])
def test_varlen_with_more_queries_than_keys(monkeypatch, backend, dtype, tol, causal):
    """Sequences with more queries than keys, and one with no keys: non-causal is cross-attention; causal
    (bottom-right) leaves the first queries without a key, and FlashAttention gives those rows zeros. torch refused
    every such sequence (even non-causal), Triton gave NaN (0 / 0) for rows without keys."""
    if backend in ("fa3", "flashinfer") and DEV == "cpu":
        pytest.skip(f"{backend} needs a CUDA device")
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", backend)
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    lens_q, lens_k = [5, 2, 3, 4, 150], [3, 2, 0, 40, 6]  # the last: 144 queries more than keys, past a key tile
    # (BLOCK_N <= 128): its blind tiles read keys before the sequence (the one before it) when the first tile that
    # every row sees was computed as a negative block
    d = 64 if backend == "flashinfer" else 16  # FlashInfer serves head_dim 64, 128 and 256
    q, k, v, cu_q, cu_k = ragged(lens_q, lens_k, 4, 2, d, dtype, seed=2)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal).float().cpu()
    assert torch.isfinite(out).all()
    qs = ks = 0
    for lq, lk in zip(lens_q, lens_k):
        got = out[qs:qs + lq]
        if lk == 0:
            assert got.abs().max().item() == 0
        else:
            ref = reference(q[qs:qs + lq].float().cpu(), k[ks:ks + lk].float().cpu(), v[ks:ks + lk].float().cpu(),
                            [lq], [lk], d ** -0.5, causal=causal)
            blind = max(lq - lk, 0) if causal else 0  # queries before the first key
            assert got[:blind].abs().max().item() == 0 if blind else True
            assert (got[blind:] - ref[blind:]).abs().max().item() < tol
        qs, ks = qs + lq, ks + lk


def test_varlen_scale_and_noncausal(monkeypatch):
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([3, 6], [3, 6], 2, 1, 8, torch.float32, seed=1)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, softmax_scale=0.3)  # FA3 default: non-causal
    ref = reference(q.cpu(), k.cpu(), v.cpu(), [3, 6], [3, 6], 0.3, causal=False)
    assert (out.cpu() - ref).abs().max().item() < 1e-5


def test_plan_reused_within_step_and_remade_after_a_write(monkeypatch):
    """Layers of one step share a plan; an in-place rewrite of cu_seqlens (a new step in static buffers) replans.
    The torch backend's plan holds the sequence bounds on the host, so a stale plan gives wrong numbers."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([4, 4], [4, 4], 2, 2, 8, torch.float32, seed=2)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    plan = flash_api.default()._plans[next(iter(flash_api.default()._plans))][-1]
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    assert flash_api.default()._plans[next(iter(flash_api.default()._plans))][-1] is plan
    cu_q[1], cu_k[1] = 2, 2  # same tensors, new lengths [2, 6]
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)  # same host bounds
    ref = reference(q.cpu(), k.cpu(), v.cpu(), [2, 6], [2, 6], 8 ** -0.5)
    assert (out.cpu() - ref).abs().max().item() < 1e-5


def paged(lens, hk, d, page_size, dtype, seed=0, spare_pages=3, garbage=float("nan")):
    """A paged cache with shuffled pages, ``garbage`` in every slot past a sequence's length and in spare pages, and
    page table padding of -1; returns (k_cache, v_cache, page_table, dense k, dense v per sequence)."""
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in lens]
    total = sum(pages) + spare_pages
    order = torch.randperm(total, generator=g)
    kc = torch.full((total, page_size, hk, d), garbage)
    vc = torch.full((total, page_size, hk, d), garbage)
    table = torch.full((len(lens), max(pages) + 1), -1, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(lens):
        kk, vv = torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)
        ks.append(kk), vs.append(vv)
        for p in range(pages[b]):
            page = int(order[used])
            used += 1
            table[b, p] = page
            chunk = slice(p * page_size, min(n, (p + 1) * page_size))
            kc[page, : chunk.stop - chunk.start] = kk[chunk]
            vc[page, : chunk.stop - chunk.start] = vv[chunk]
    return kc.to(DEV, dtype), vc.to(DEV, dtype), table.to(DEV), ks, vs


# The foundation's torch backend multiplies masked NaN by zero (its fix is helper "correctness"'s): finite garbage
# there; Triton gets NaN.
@pytest.mark.parametrize("backend,dtype,tol,garbage", [("torch", torch.float32, 1e-5, 1e4),
                                                       ("triton", torch.float16, 2e-3, float("nan"))])
@pytest.mark.parametrize("append", [False, True])
def test_kvcache_paged_decode_gqa(monkeypatch, append, backend, dtype, tol, garbage):
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", backend)
    lens, hq, hk, d, ps = [1, 5, 16, 21], 4, 2, 16, 4
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, dtype, seed=3, garbage=garbage)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), 1, hq, d, generator=g).to(DEV, dtype)
    if append:  # the cache holds lens - 1 tokens; the last one comes as k/v and must be written at its position
        k_new = torch.stack([kk[-1:] for kk in ks]).to(DEV, dtype)
        v_new = torch.stack([vv[-1:] for vv in vs]).to(DEV, dtype)
        for b, n in enumerate(lens):  # poison the slot the new token goes to
            kc[table[b, (n - 1) // ps], (n - 1) % ps] = float("nan")
        seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV) - 1
        out = attnsel.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, page_table=table,
                                              causal=True)
        for b, n in enumerate(lens):
            assert torch.equal(kc[table[b, (n - 1) // ps], (n - 1) % ps].cpu(), ks[b][-1].to(dtype))
    else:
        seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        out = attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=True)
    assert out.shape == q.shape
    ref = reference(q[:, 0].float().cpu(), torch.cat(ks).to(dtype).float(), torch.cat(vs).to(dtype).float(),
                    [1] * len(lens), lens, d ** -0.5)
    err = (out[:, 0].float().cpu() - ref).abs().max().item()
    assert err < tol, err


class Recorder:
    """Stands in for a Selection: records the spec of the call and the keyword arguments its run gets."""

    def __init__(self):
        self.specs, self.kwargs, self.plans = [], [], 0

    def __call__(self, spec, device):
        self.specs.append(spec)
        return self

    def _run(self, *args, **kwargs):
        self.kwargs.append(kwargs)
        return args[0].clone()

    def plan_prefill(self, *args, **kwargs):
        self.plans += 1
        return self._run

    plan_decode = plan_prefill


def test_features_map_onto_the_spec(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(flash_api.default(), "selection_for", rec)
    q, k, v, cu_q, cu_k = ragged([3], [3], 4, 2, 16, torch.bfloat16)
    sinks = torch.zeros(4)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, window_size=(7, 7), softcap=30.0,
                                   sinks=sinks, softmax_scale=0.25)
    spec = rec.specs[-1]
    assert (spec.sliding_window, spec.softcap, spec.sinks, spec.causal) == (8, 30.0, True, True)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (4, 2, 16, "bf16")
    assert spec.softmax_scale is None  # 0.25 == 16 ** -0.5: the default
    assert rec.kwargs[-1]["sinks"] is sinks
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, window_size=(-1, 0))
    assert rec.specs[-1].sliding_window is None and rec.specs[-1].softcap is None and not rec.specs[-1].sinks

    kc = torch.zeros(4, 16, 2, 16, dtype=torch.float8_e4m3fn)
    table = torch.zeros(2, 2, dtype=torch.int32)
    qd = torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([2.0])
    attnsel.flash_attn_with_kvcache(qd, kc, kc.clone(), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
                                    page_table=table, k_descale=k_scale, v_descale=v_scale)
    spec = rec.specs[-1]
    assert (spec.kv_dtype, spec.page_size, spec.dtype) == ("fp8_e4m3", 16, "bf16")
    assert rec.kwargs[-1]["k_scale"].item() == 0.5 and rec.kwargs[-1]["v_scale"].item() == 2.0


def test_one_plan_per_step_and_selection_once_per_spec(monkeypatch):
    calls = []
    real = flash_api.select
    monkeypatch.setattr(flash_api, "select", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([2, 3], [2, 3], 2, 2, 8, torch.float32)
    for _ in range(3):
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True)
    _, _, _, cu_q2, cu_k2 = ragged([2, 3], [2, 3], 2, 2, 8, torch.float32)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q2, cu_k2, 3, 3, causal=True)
    assert len(calls) == 1 and calls[0].num_q_heads == 2


@pytest.mark.parametrize("window", [(2,), (2, 0, 1), ("a", 0), 3, (2.5, 0)])
def test_a_window_size_that_is_not_a_pair_of_ints_is_named(monkeypatch, window):
    """window_size=(2,) gave a bare "not enough values to unpack"; now the argument and what is allowed."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([3], [3], 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match=r"window_size must be a pair of ints \(left, right\), got .*allowed: "
                                         r"\(-1, -1\) \(no window\)"):
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, window_size=window)


@pytest.mark.parametrize("func,kwargs,name", [
    ("varlen", {"qv": torch.zeros(1)}, "qv"),
    ("varlen", {"return_attn_probs": True}, "return_attn_probs=True"),
    ("varlen", {"seqused_k": torch.zeros(1)}, "seqused_k"),
    ("varlen", {"window_size": (4, 4), "causal": False}, "window_size=(4, 4) with causal=False: not supported by "
                                                         "attnsel; allowed: (-1, -1) (no window), or (left, 0)"),
    ("kvcache", {"rotary_cos": torch.zeros(1)}, "rotary_cos"),
    ("kvcache", {"rotary_seqlens": torch.zeros(1)}, "rotary_seqlens"),
    ("kvcache", {"return_softmax_lse": True}, "return_softmax_lse=True"),
    ("kvcache", {"page_table": None}, "page_table=None (a contiguous"),
    ("kvcache", {"k_descale": torch.ones(1)}, "k_descale"),
])
def test_unsupported_argument_is_named(monkeypatch, func, kwargs, name):
    rec = Recorder()
    monkeypatch.setattr(flash_api.default(), "selection_for", rec)
    if func == "varlen":
        q, k, v, cu_q, cu_k = ragged([3], [3], 2, 2, 8, torch.float32)
        with pytest.raises(UnsupportedArgument, match=name.replace("(", r"\(").replace(")", r"\)")):
            attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, **kwargs)
    else:
        q = torch.zeros(1, 1, 2, 8)
        kc = torch.zeros(2, 4, 2, 8)
        args = dict(cache_seqlens=torch.tensor([3], dtype=torch.int32), page_table=torch.zeros(1, 1,
                                                                                               dtype=torch.int32))
        args.update(kwargs)
        with pytest.raises(UnsupportedArgument, match=name.replace("(", r"\(").replace(")", r"\)")):
            attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), **args)
    assert rec.plans == 0


def test_kvcache_dispatches_on_the_real_context_not_the_page_tables_width(monkeypatch):
    """Outside capture the plan reads cache_seqlens on the host anyway (its bounds check): the dispatch takes the
    batch's mean context from that read. The page table's capacity would be the wrong guide: an engine that sizes
    its table for the longest context would have every step looked up at the largest timed context."""
    from attnsel.selection import PhaseChoice, Selection, build_table
    from tests.fixtures.dispatch import Recorder, measured

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32", page_size=16)
    cells = {(1, 256): {"rec_a": 1.0, "rec_b": 2.0}, (1, 4096): {"rec_a": 9.0, "rec_b": 2.0},
             (32, 256): {"rec_a": 1.0, "rec_b": 2.0}, (32, 4096): {"rec_a": 9.0, "rec_b": 2.0}}
    sel = Selection(spec, {"prefill": PhaseChoice("torch", "explicit", []),
                           "decode": PhaseChoice("rec_b", "auto", [], build_table(measured("decode", "eager", cells),
                                                                                  ["rec_a", "rec_b"]))},
                    "measure", "eager", "off", {}, {})
    monkeypatch.setattr(flash_api.default(), "selection_for", lambda s, device: sel)
    kc = torch.randn(600, 16, 2, 64)
    vc = torch.randn_like(kc)
    got = []
    for width, lens in ((2, [20, 7]), (300, [20, 7]), (300, [4000, 3000]), (300, [4000, 20])):
        table = torch.arange(2 * width, dtype=torch.int32).view(2, width) % 600
        Recorder.planned.clear()
        attnsel.flash_attn_with_kvcache(torch.randn(2, 1, 4, 64), kc, vc, page_table=table, causal=True,
                                        cache_seqlens=torch.tensor(lens, dtype=torch.int32))
        got.append(Recorder.planned[-1])
    # short contexts: rec_a whatever the table's width; long: rec_b; one long row among short: their mean (2010)
    assert got == ["rec_a", "rec_a", "rec_b", "rec_b"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_varlen_after_first_call():
    """Captured after a first eager call (selection outside capture), replayed after cu_seqlens changed in place:
    the output follows the new lengths."""
    flash_api.configure(policy="priority", mode="graph")
    hq, hk, d = 8, 2, 128
    q, k, v, cu_q, cu_k = ragged([7, 30], [7, 30], hq, hk, d, torch.bfloat16)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 32, 32, causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 32, 32, causal=True)
    cu_q.copy_(torch.tensor([0, 20, 37], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 20, 37], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), [20, 17], [20, 17], d ** -0.5)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_kvcache_after_first_call():
    """The same for paged decode with cache_seqlens changed in place. Needs the selected decode backend's
    plan_decode to run without a device sync (the foundation's backends read max(seq_lens) on the host there)."""
    flash_api.configure(policy="priority", mode="graph")
    lens, hq, hk, d, ps = [5, 16, 33], 8, 2, 128, 16
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, torch.bfloat16, seed=5, spare_pages=8)
    q = torch.randn(len(lens), 1, hq, d, device=DEV, dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table)
    new_lens = [3, 9, 30]
    seqlens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q[:, 0].float().cpu(), torch.cat([kk[:n] for kk, n in zip(ks, new_lens)]).bfloat16().float(),
                    torch.cat([vv[:n] for vv, n in zip(vs, new_lens)]).bfloat16().float(), [1, 1, 1], new_lens,
                    d ** -0.5)
    assert (out[:, 0].float().cpu() - ref).abs().max().item() < 2e-2


class OnePlanTorch:
    """One plan per phase, as FlashInfer's wrappers were used before each run function got its own: a later plan
    makes earlier run functions raise, and run.current() says so. Torch underneath (loaded as a plugin: ATTNSEL_BACKENDS="tests.test_flash_api:ONE_PLAN")."""

    name, version = "one_plan", "test"

    def __init__(self):
        self.generation = {"prefill": 0, "decode": 0}

    def unsupported(self, spec, phase):
        return None

    def _current_only(self, phase, run):
        self.generation[phase] += 1
        mine = self.generation[phase]

        def checked(*args, **kwargs):
            if self.generation[phase] != mine:
                raise RuntimeError("one_plan: this run function belongs to an earlier plan")
            return run(*args, **kwargs)

        checked.current = lambda: self.generation[phase] == mine
        return checked

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        from attnsel.backends.torch_sdpa import BACKEND as TORCH
        return self._current_only("prefill", TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k))

    def plan_decode(self, spec, page_table, seq_lens):
        from attnsel.backends.torch_sdpa import BACKEND as TORCH
        return self._current_only("decode", TORCH.plan_decode(spec, page_table, seq_lens))


ONE_PLAN = OnePlanTorch()


def _window_step(window, seed=11):
    """A decode step's inputs shared by a global and a sliding layer, and each layer kind's float32 reference."""
    hq, hk, d, ps = 4, 2, 16, 4
    lens = [3, 9, 13]
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, torch.float32, seed=seed, garbage=1e4)
    q = torch.randn(len(lens), 1, hq, d, generator=torch.Generator().manual_seed(seed)).to(DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    refs = {w: reference(q[:, 0].cpu(), torch.cat(ks), torch.cat(vs), [1] * len(lens), lens, d ** -0.5, window=w)
            for w in (None, window)}
    call = lambda w: attnsel.flash_attn_with_kvcache(  # noqa: E731
        q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=True, window_size=(w - 1, 0) if w else (-1, -1))
    return call, refs


def test_a_plan_replaced_by_another_layer_kind_is_made_again(monkeypatch):
    """Sliding and global layers alternate over the same metadata tensors on a backend that keeps one plan per phase
    (a plugin): each layer kind has its own cached plan, and the global layers' plan goes stale when the sliding
    layers plan. It must be planned again, not called (a RuntimeError, as scripts/gpu_flash_api.py met on an H200
    where a direct plan came between two calls)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_flash_api:ONE_PLAN")
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "one_plan")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "one_plan")
    flash_api.configure(policy="priority")
    window = 5
    call, refs = _window_step(window, seed=5)
    for w in (None, window, None, window, window, None):  # one step's layers: global, sliding, global, ...
        assert (call(w)[:, 0].cpu() - refs[w]).abs().max().item() < 1e-5
    lq = [3, 5]
    hq, hk, d = 4, 2, 16
    qp, k, v, cu_q, cu_k = ragged(lq, lq, hq, hk, d, torch.float32, seed=7)
    refs = {w: reference(qp.cpu(), k.cpu(), v.cpu(), lq, lq, d ** -0.5, window=w) for w in (None, 2)}
    for w in (None, 2, None):
        out = attnsel.flash_attn_varlen_func(qp, k, v, cu_q, cu_k, 5, 5, causal=True,
                                             window_size=(w - 1, 0) if w else (-1, -1))
        assert (out.cpu() - refs[w]).abs().max().item() < 1e-5


def test_plans_made_during_capture_outlive_the_plan_cache(monkeypatch):
    """A CUDA graph replays its plan's buffers and holds no Python reference: a plan made during capture must stay
    alive after later calls replace it in the plan cache (and after configure()), or the buffers it allocated (the
    Triton decode's split buffers) go back to the allocator while the graph still writes them."""
    import weakref

    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    monkeypatch.setattr(flash_api.default(), "_captured", [])
    real = flash_api.select  # captured calls ask for mode "graph", which needs CUDA: an eager one stands in
    monkeypatch.setattr(flash_api, "select", lambda *a, mode="eager", **kw: real(*a, **kw))
    q, k, v, cu_q, cu_k = ragged([3, 5], [3, 5], 2, 1, 8, torch.float32, seed=9)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)  # selects outside capture
    monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    captured = weakref.ref(flash_api.default()._plans[next(iter(flash_api.default()._plans))][-1])
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)  # replans, replacing it in the cache
    flash_api.configure(policy="priority")
    import gc
    gc.collect()
    assert captured() is not None and len(flash_api.default()._captured) == 2


def _after_first_plan(monkeypatch, method: str, action) -> list:
    """Make Selection.<method> run ``action`` once, after its first plan and before the call stores it (what another
    thread could do in between); returns a list that gets an entry when it ran."""
    real = getattr(attnsel.Selection, method)
    done = []

    def plan_then_act(self, *args, **kwargs):
        run = real(self, *args, **kwargs)
        if not done:
            done.append(True)
            action()
        return run

    monkeypatch.setattr(attnsel.Selection, method, plan_then_act)
    return done


def test_first_calls_racing_in_two_threads_give_no_slot_to_another_spec(monkeypatch):
    """Two threads make the first call of one spec at once (the selection is slow, so both miss the memo). A later
    spec (a sliding-window layer over the same metadata) must not get the plan slot of the first: it would reuse the
    global layers' plan and attend to every token. Failed when slots were numbered by len(_specs) and stored with
    a plain assignment (the second thread's entry replaced the first's)."""
    import threading
    import time

    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    real = flash_api.default().selection_for
    monkeypatch.setattr(flash_api.default(), "selection_for", lambda spec, device: time.sleep(0.3) or real(spec, device))
    call, refs = _window_step(5)
    threads = [threading.Thread(target=call, args=(None,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in (None, 5, None, 5):
        assert (call(w)[:, 0].cpu() - refs[w]).abs().max().item() < 1e-5, w


def test_a_reset_during_planning_gives_no_slot_to_another_spec(monkeypatch):
    """configure()/reset() while a call is planning: that call stores its plan after the reset. A spec seen after
    the reset must not be handed the same slot (it was, with slots numbered by len(_specs))."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    call, refs = _window_step(5)
    done = _after_first_plan(monkeypatch, "plan_decode", flash_api.reset)  # as another thread would
    call(None)
    assert done
    for w in (5, None, 5):
        assert (call(w)[:, 0].cpu() - refs[w]).abs().max().item() < 1e-5, w


@pytest.mark.parametrize("scale", [torch.tensor(0.25), float("nan"), -1.0, 0.0, True, "0.25"])
def test_softmax_scale_must_be_a_positive_float(monkeypatch, scale):
    """A scale that is not a positive finite real number is refused, whatever came before (an accepted 1 or 0.25
    first); before, a 0-d tensor or NaN never compared equal to itself in the memo key, and every call made a new
    spec entry and a new plan slot."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([3], [3], 2, 1, 8, torch.float32)
    for _ in range(3):
        with pytest.raises(ValueError, match="softmax_scale must be None .* positive finite Python float"):
            attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softmax_scale=scale)
    assert not flash_api.default()._specs and not flash_api.default()._plans
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softmax_scale=1)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softmax_scale=0.25)
    with pytest.raises(ValueError, match="softmax_scale must be None"):
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softmax_scale=scale)


def test_softmax_scale_takes_any_real_number(monkeypatch):
    """As FA3: an int or a numpy scalar is a scale (numpy.float32 is no Python float subclass); same numbers as the
    float, one spec for equal values."""
    import numpy as np

    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([3, 5], [3, 5], 2, 1, 8, torch.float32, seed=4)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), [3, 5], [3, 5], 0.5)
    for scale in (np.float32(0.5), 0.5, np.float64(0.5)):  # numpy first: a float first would make it a memo hit
        out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, softmax_scale=scale)
        assert (out.cpu() - ref).abs().max().item() < 1e-5
    assert len({entry[0] for entry in flash_api.default()._specs.values()}) == 1 and len(flash_api.default()._specs) == 1


def test_a_write_to_the_metadata_during_planning_is_seen(monkeypatch):
    """A write to cu_seqlens that lands while a call is planning (another thread) must make the next call plan again:
    the versions a plan is stored with are read before planning (they were read after)."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([4, 4], [4, 4], 2, 2, 8, torch.float32, seed=2)

    def write():
        cu_q[1], cu_k[1] = 2, 2

    _after_first_plan(monkeypatch, "plan_prefill", write)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), [2, 6], [2, 6], 8 ** -0.5)
    assert (out.cpu() - ref).abs().max().item() < 1e-5


def test_calls_under_inference_mode_are_right_and_plan_each_call(monkeypatch, caplog):
    """Serving engines run under torch.inference_mode(); tensors made there have no version counter (reading it
    raised RuntimeError). The calls must work, and since a change to such metadata cannot be seen, plan every call
    (an in-place rewrite of cu_seqlens must still give the right answer), and say why once."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    monkeypatch.setattr(flash_api.default(), "_no_versions_logged", False)
    plans = []
    real = attnsel.Selection.plan_prefill
    monkeypatch.setattr(attnsel.Selection, "plan_prefill", lambda self, *a, **kw: plans.append(1) or real(self, *a, **kw))
    with torch.inference_mode():
        q, k, v, cu_q, cu_k = ragged([4, 4], [4, 4], 2, 2, 8, torch.float32, seed=2)
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
        cu_q[1], cu_k[1] = 2, 2  # no version counter moves
        out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
        call, refs = _window_step(None)
        dec = call(None)
    assert len(plans) == 2
    assert (out.cpu() - reference(q.cpu(), k.cpu(), v.cpu(), [2, 6], [2, 6], 8 ** -0.5)).abs().max().item() < 1e-5
    assert (dec[:, 0].cpu() - refs[None]).abs().max().item() < 1e-5
    assert sum("no version counter" in r.getMessage() for r in caplog.records) == 1


def _small_decode(monkeypatch):
    """torch for both phases; an all-zero fp32 paged cache (4/2 heads, d 8, page 4), its table and lengths, q and a
    new token: the inputs of the bad-input tests, which check that nothing was written."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    hq, hk, d, ps = 4, 2, 8, 4
    kc = torch.zeros(8, ps, hk, d, device=DEV)
    table = torch.arange(8, dtype=torch.int32, device=DEV).view(2, 4)
    seqlens = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 1, hq, d, device=DEV)
    return hq, hk, d, ps, kc, table, seqlens, q, torch.ones(2, 1, hk, d, device=DEV)


def test_bad_inputs_raise_before_the_cache_is_written(monkeypatch):
    """A wrong sinks shape, or a k_cache whose head_dim differs from q's on a later call, raises before the new token
    is written into the cache (both wrote it first)."""
    hq, hk, d, ps, kc, table, seqlens, q, k_new = _small_decode(monkeypatch)
    with pytest.raises(ValueError, match="sinks must have shape"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), k_new, k_new, cache_seqlens=seqlens, page_table=table,
                                        causal=True, sinks=torch.zeros(2))
    assert kc.abs().sum().item() == 0
    attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens, page_table=table, causal=True)
    with pytest.raises(ValueError, match="of one dtype"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.to(torch.float16), k_new, k_new, cache_seqlens=seqlens,
                                        page_table=table, causal=True)
    assert kc.abs().sum().item() == 0
    kc16 = torch.zeros(8, ps, hk, 2 * d, device=DEV)
    for _ in range(2):  # a first and a later call of the same (q, k_cache) heads
        with pytest.raises(attnsel.spec.SpecError, match="head_dim"):
            attnsel.flash_attn_with_kvcache(q, kc16, kc16.clone(), torch.ones(2, 1, hk, 2 * d, device=DEV),
                                            torch.ones(2, 1, hk, 2 * d, device=DEV), cache_seqlens=seqlens,
                                            page_table=table, causal=True)
        assert kc16.abs().sum().item() == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lengths_past_the_page_table_are_refused_before_anything_is_written(monkeypatch, backend):
    """cache_seqlens larger than the page table holds (4 pages of 4 = 16 tokens): a new token at position 16 was
    written over a cached one under Triton (its slot clamped to the table's last page) and a read of 17 tokens
    took another sequence's page, silently (torch raised its own error). Now a ValueError naming page_table and
    cache_seqlens for every backend, before the cache is written; a negative length too."""
    if backend == "triton" and DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    hq, hk, d, ps, kc, table, seqlens, q, k_new = _small_decode(monkeypatch)
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", backend)
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", backend)
    dtype = torch.float16 if backend == "triton" else torch.float32  # Triton serves fp16/bf16
    kc, q, k_new = kc.normal_().to(dtype), q.to(dtype), k_new.to(dtype)
    before = kc.clone()
    for lens, append, what in (([16, 3], True, "too few for 16 cached + 1 new"),
                               ([17, 3], False, "too few for 17 cached"), ([-1, 3], False, "negative length -1")):
        cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        with pytest.raises(ValueError, match=f"attnsel.flash_attn_with_kvcache: .*{re.escape(what)}"):
            attnsel.flash_attn_with_kvcache(q, kc, kc, *((k_new, k_new) if append else ()),
                                            cache_seqlens=cache_seqlens, page_table=table, causal=True)
        assert torch.equal(kc, before)
    cache_seqlens = torch.tensor([15, 3], dtype=torch.int32, device=DEV)  # the last slot: fine
    attnsel.flash_attn_with_kvcache(q, kc, kc, k_new, k_new, cache_seqlens=cache_seqlens, page_table=table,
                                    causal=True)
    assert torch.equal(kc[table[0, 3].item(), 3], k_new[0, 0])


def test_tensors_on_another_device_or_with_strided_last_dims_are_named(monkeypatch):
    """The FA-compatible calls run the backend's own run function (Selection's per-call checks off), so they make
    those checks themselves: caches or metadata on another device than q, and a last dimension that is not
    contiguous (a kernel would read the wrong elements), raise naming the tensor, before the cache is written."""
    hq, hk, d, ps, kc, table, seqlens, q, k_new = _small_decode(monkeypatch)
    meta = dict(device="meta")
    with pytest.raises(ValueError, match=r"flash_attn_with_kvcache: q, k_cache and v_cache must be on one device, "
                                         r"got q on [\w:]+, k_cache on meta, v_cache on meta"):
        attnsel.flash_attn_with_kvcache(q, kc.to(**meta), kc.to(**meta), cache_seqlens=seqlens, page_table=table)
    with pytest.raises(ValueError, match="must be on one device"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.to(**meta), k_new, k_new, cache_seqlens=seqlens, page_table=table)
    with pytest.raises(ValueError, match="k and v \\(new tokens\\) must be on q's device"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), k_new, k_new.to(**meta), cache_seqlens=seqlens,
                                        page_table=table)
    with pytest.raises(ValueError, match="page_table and cache_seqlens must be on q's device"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), k_new, k_new, cache_seqlens=seqlens,
                                        page_table=table.to(**meta))
    strided = torch.zeros(8, ps, hk, 2 * d, device=DEV)[..., ::2]
    with pytest.raises(ValueError, match=r"k_cache's last dimension must be contiguous \(stride 1\)"):
        attnsel.flash_attn_with_kvcache(q, strided, kc.clone(), k_new, k_new, cache_seqlens=seqlens,
                                        page_table=table)
    assert kc.abs().sum().item() == 0
    qv, kv, vv, cu_q, cu_k = ragged([2, 3], [2, 3], hq, hk, d, torch.float32)
    with pytest.raises(ValueError, match="flash_attn_varlen_func: q, k and v must be on one device"):
        attnsel.flash_attn_varlen_func(qv, kv.to(**meta), vv, cu_q, cu_k, 3, 3, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q/cu_seqlens_k must be on q's device"):
        attnsel.flash_attn_varlen_func(qv, kv, vv, cu_q.to(**meta), cu_k, 3, 3, causal=True)
    q_strided = torch.randn(5, hq, 2 * d, device=DEV)[..., ::2]
    with pytest.raises(ValueError, match=r"q's last dimension must be contiguous"):
        attnsel.flash_attn_varlen_func(q_strided, kv, vv, cu_q, cu_k, 3, 3, causal=True)
    # a q whose heads are strided but whose last dimension is contiguous is served (a slice of a fused qkv)
    fused = torch.randn(5, 2 * hq, d, device=DEV)[:, :hq]
    out = attnsel.flash_attn_varlen_func(fused, kv, vv, cu_q, cu_k, 3, 3, causal=True)
    ref = reference(fused.float().cpu(), kv.float().cpu(), vv.float().cpu(), [2, 3], [2, 3], d ** -0.5)
    assert (out.float().cpu() - ref).abs().max().item() < 1e-5


def test_kvcache_passes_q_as_it_comes_to_a_backend_that_takes_its_layout(monkeypatch):
    """A decode backend with decode_takes_b1hd gets the caller's very q [B, 1, H, D] (no views); one without gets
    q as [B, H, D]; the output is [B, 1, H, D] either way and matches the reference."""
    from tests.fixtures.dispatch import B1hdPlugin

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:B1HD_PLUGINS")
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    lens, hq, hk, d, ps = [1, 5, 16, 21], 4, 2, 16, 4
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, torch.float32, seed=3, garbage=float("nan"))
    q = torch.randn(len(lens), 1, hq, d).to(DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = reference(q[:, 0].cpu(), torch.cat(ks).float(), torch.cat(vs).float(), [1] * len(lens), lens, d ** -0.5)
    for name, native in (("b1hd_native", True), ("b1hd_views", False)):
        monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", name)
        flash_api.reset()
        B1hdPlugin.seen.clear()
        out = attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=True)
        assert out.shape == q.shape
        assert (B1hdPlugin.seen[-1] is q) is native and B1hdPlugin.seen[-1].dim() == (4 if native else 3)
        assert (out[:, 0].cpu() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("splits", [1, 3], ids=["single", "split"])
@pytest.mark.parametrize("layout", ["head_slice", "batch_stride"])
def test_kvcache_triton_with_a_strided_q(monkeypatch, layout, splits):
    """q handed to the Triton kernel as it comes ([B, 1, H, D] with strides of its own: the heads of a fused qkv, or
    every other row of a larger batch): right numbers, out [B, 1, H, D]. Fails when the kernel writes out with q's
    strides (they differ from out's here, unlike for a contiguous q)."""
    import attnsel.backends.triton as tb

    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 1))
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "triton")
    lens, hq, hk, d, ps = [1, 5, 16, 21], 4, 2, 16, 4
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, torch.float16, seed=3, garbage=float("nan"))
    g = torch.Generator().manual_seed(4)
    if layout == "head_slice":
        q = torch.randn(len(lens), 1, 3 * hq, d, generator=g).to(DEV, torch.float16)[:, :, hq:2 * hq]
    else:
        q = torch.randn(2 * len(lens), 1, hq, d, generator=g).to(DEV, torch.float16)[::2]
    assert not q.is_contiguous() and q.stride(-1) == 1
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=True)
    assert out.shape == q.shape
    ref = reference(q[:, 0].float().cpu(), torch.cat(ks).half().float(), torch.cat(vs).half().float(),
                    [1] * len(lens), lens, d ** -0.5)
    assert (out[:, 0].float().cpu() - ref).abs().max().item() < 2e-3


def test_cache_dtype_and_head_mismatches_are_named_in_the_callers_terms(monkeypatch):
    """A cache of another dtype than q's that is not fp8 is named as such (it used to ask for descales that cannot
    help); descales with a cache in q's dtype say they apply only to fp8; heads that give no spec name the tensors."""
    hq, hk, d, ps, kc, table, seqlens, q, k_new = _small_decode(monkeypatch)
    with pytest.raises(ValueError, match=r"flash_attn_with_kvcache: the KV cache's dtype torch.float16 differs from "
                                         r"q's torch.float32; allowed: q's dtype, or torch.float8_e4m3fn"):
        attnsel.flash_attn_with_kvcache(q, kc.half(), kc.half(), cache_seqlens=seqlens, page_table=table)
    with pytest.raises(UnsupportedArgument, match=r"k_descale=<tensor \(1,\) torch.float32>: descale factors apply "
                                                  r"only to a torch.float8_e4m3fn cache; this cache is torch.float32"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens, page_table=table,
                                        k_descale=torch.ones(1))
    kc3 = torch.zeros(8, ps, 3, d, device=DEV)
    with pytest.raises(attnsel.spec.SpecError, match=r"flash_attn_with_kvcache: q \(2, 1, 4, 8\) and k_cache "
                                                     r"\(8, 4, 3, 8\) give no valid spec: .*multiple"):
        attnsel.flash_attn_with_kvcache(q, kc3, kc3.clone(), cache_seqlens=seqlens, page_table=table)


def test_every_check_still_runs_after_a_good_call_with_the_same_facts(monkeypatch):
    """A call whose facts (dtypes, head shapes, options, devices) were seen before skips the checks that depend on them
    alone; every other bad argument must still be refused after a good call: another device, a strided last
    dimension, v's shape, softmax_scale=True (hashes like 1.0), and metadata of the wrong dtype or shape (checked when
    a plan is made)."""
    hq, hk, d, ps, kc, table, seqlens, q, k_new = _small_decode(monkeypatch)
    meta = dict(device="meta")
    good = dict(cache_seqlens=seqlens, page_table=table)
    for scale in (None, 1.0):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), softmax_scale=scale, **good)
    with pytest.raises(ValueError, match="must be on one device"):
        attnsel.flash_attn_with_kvcache(q, kc.to(**meta), kc.to(**meta), **good)
    with pytest.raises(ValueError, match=r"k_cache's last dimension must be contiguous"):
        attnsel.flash_attn_with_kvcache(q, torch.zeros(8, ps, hk, 2 * d, device=DEV)[..., ::2], kc, **good)
    with pytest.raises(ValueError, match="softmax_scale must be None"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), softmax_scale=True, **good)
    with pytest.raises(ValueError, match="page_table must be int32"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens, page_table=table.long())
    with pytest.raises(ValueError, match="cache_seqlens must be an int or int32"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens.long(), page_table=table)
    with pytest.raises(ValueError, match=r"cache_seqlens must be an int or int32 \[2\]"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens[:, None], page_table=table)
    with pytest.raises(ValueError, match="page_table must be int32 \\[batch, max_pages\\] with batch 2"):
        attnsel.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens, page_table=table[:1])
    qv, kv, vv, cu_q, cu_k = ragged([2, 3], [2, 3], hq, hk, d, torch.float32)
    for scale in (None, 1.0):
        attnsel.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 3, 3, causal=True, softmax_scale=scale)
    with pytest.raises(ValueError, match="q, k and v must be on one device"):
        attnsel.flash_attn_varlen_func(qv, kv.to(**meta), vv.to(**meta), cu_q, cu_k, 3, 3, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q/cu_seqlens_k must be int32"):
        attnsel.flash_attn_varlen_func(qv, kv, vv, cu_q.long(), cu_k, 3, 3, causal=True)
    with pytest.raises(ValueError, match=r"q's last dimension must be contiguous"):
        attnsel.flash_attn_varlen_func(torch.randn(5, hq, 2 * d, device=DEV)[..., ::2], kv, vv, cu_q, cu_k, 3, 3,
                                       causal=True)
    with pytest.raises(ValueError, match="k, v .* alike"):
        attnsel.flash_attn_varlen_func(qv, kv, vv[:4], cu_q, cu_k, 3, 3, causal=True)
    with pytest.raises(ValueError, match="softmax_scale must be None"):
        attnsel.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 3, 3, causal=True, softmax_scale=True)
    with pytest.raises(ValueError, match="q, k, v must share a dtype"):
        attnsel.flash_attn_varlen_func(qv, kv, vv.double(), cu_q, cu_k, 3, 3, causal=True)
    assert kc.abs().sum().item() == 0


def test_options_given_as_tensors_are_read_every_call(monkeypatch):
    """causal / softcap / window bounds given as 0-dim tensors hash by identity: a memo keyed on them would keep the
    first call's meaning after the tensor changed in place (it did: a causal tensor set to False still gave causal
    attention). Such calls are checked in full every time."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([2, 3], [2, 3], 4, 2, 8, torch.float32)
    scale = 8 ** -0.5
    flag = torch.tensor(True)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=flag)
    flag.fill_(False)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=flag)
    ref = reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), [2, 3], [2, 3], scale, causal=False)
    assert (out.float().cpu() - ref).abs().max().item() < 1e-5
    cap = torch.tensor(0.0)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softcap=cap)
    cap.fill_(-1.0)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softcap=cap)


def test_a_reset_during_the_checks_is_not_undone_by_the_memo(monkeypatch):
    """configure() between a call's checks and its memo store: the call's (old) selection must not be stored after
    the reset (it was, and every later call used the forgotten backend)."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([2, 3], [2, 3], 4, 2, 8, torch.float32)
    real = flash_api.default()._resolve

    def reset_meanwhile(*args, **kwargs):
        found = real(*args, **kwargs)
        monkeypatch.setattr(flash_api.default(), "_resolve", real)
        flash_api.configure(policy="priority")  # another thread reconfigures here
        return found

    monkeypatch.setattr(flash_api.default(), "_resolve", reset_meanwhile)
    attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True)
    assert not flash_api.default()._calls and not flash_api.default()._selections


@pytest.mark.parametrize("change, error", [
    ({"max_seqlen_q": 2.7}, r"InvalidArgument: .*max_seqlen_q must be a Python int .*got 2\.7"),
    ({"max_seqlen_q": "3"}, r"InvalidArgument: .*max_seqlen_q must be a Python int .*got '3'"),
    ({"max_seqlen_k": True}, r"InvalidArgument: .*max_seqlen_k must be a Python int .*got True"),
    ({"max_seqlen_q": None}, r"InvalidArgument: .*max_seqlen_q must be a Python int .*got None"),
    ({"cu_seqlens_q": [0, 3]}, r"TypeError: .*cu_seqlens_q must be a torch.Tensor, got list"),
    ({"q": [0.0]}, r"TypeError: .*q must be a torch.Tensor, got list"),
    ({"k": None}, r"TypeError: .*k must be a torch.Tensor, got NoneType"),
    ({"cu_seqlens_k": None}, r"TypeError: .*cu_seqlens_k must be a torch.Tensor, got NoneType"),
    ({"q": "numpy"}, r"TypeError: .*q must be a torch.Tensor, got ndarray"),
    ({"cu_seqlens_q": "numpy"}, r"TypeError: .*cu_seqlens_q must be a torch.Tensor, got ndarray"),
    ({"sinks": [0.0] * 4}, r"TypeError: .*sinks must be a torch.Tensor, got list"),
    ({"softcap": "5"}, r"ValueError: .*softcap must be a finite number >= 0 \(0 disables it\), got '5'"),
    ({"softcap": float("nan")}, r"ValueError: .*softcap must be a finite number >= 0 \(0 disables it\), got nan"),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else None)
def test_varlen_arguments_of_a_wrong_type_are_named(monkeypatch, change, error):
    """max_seqlen 2.7 or "3" (int() would truncate or parse them), lists (a bare AttributeError) and a NaN softcap
    (no cap) are refused, each named with what is allowed."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([3], [3], 4, 2, 8, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=3, causal=True)
    attnsel.flash_attn_varlen_func(**args)
    change = {n: args[n].cpu().numpy() if x == "numpy" else x for n, x in change.items()}  # shape and dtype, no tensor
    with pytest.raises((TypeError, ValueError)) as exc:
        attnsel.flash_attn_varlen_func(**{**args, **change})
    assert re.search(error, f"{exc.type.__name__}: {exc.value}"), exc.value


@pytest.mark.parametrize("change, error", [
    ({"cache_seqlens": True}, r"TypeError: .*cache_seqlens must be an int or an int32 torch.Tensor, got bool"),
    ({"cache_seqlens": 5.0}, r"TypeError: .*cache_seqlens must be an int or an int32 torch.Tensor, got float"),
    ({"cache_seqlens": [3, 5]}, r"TypeError: .*cache_seqlens must be an int or an int32 torch.Tensor, got list"),
    ({"page_table": [[0, 1], [2, 3]]}, r"TypeError: .*page_table must be a torch.Tensor, got list"),
    ({"k": [1], "v": [1]}, r"TypeError: .*k must be a torch.Tensor, got list"),
    ({"k_cache": None}, r"TypeError: .*k_cache must be a torch.Tensor, got NoneType"),
    ({"page_table": "numpy"}, r"TypeError: .*page_table must be a torch.Tensor, got ndarray"),
    ({"k_cache": "empty", "v_cache": "empty"}, r"ValueError: .*k_cache/v_cache hold 0 pages \(\(0, 4, 2, 8\)\); "
                                                r"allowed: at least one page"),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else None)
def test_kvcache_arguments_of_a_wrong_type_are_named(monkeypatch, change, error):
    hq, hk, d, ps, kc, table, seqlens, q, k_new = _small_decode(monkeypatch)
    args = dict(q=q, k_cache=kc, v_cache=kc.clone(), cache_seqlens=seqlens, page_table=table, causal=True)
    attnsel.flash_attn_with_kvcache(**args)
    change = {n: args[n].cpu().numpy() if x == "numpy" else kc[:0] if x == "empty" else x for n, x in change.items()}
    with pytest.raises((TypeError, ValueError)) as exc:
        attnsel.flash_attn_with_kvcache(**{**args, **change})
    assert re.search(error, f"{exc.type.__name__}: {exc.value}"), exc.value
    assert kc.abs().sum().item() == 0


def test_softcap_false_means_no_cap_with_or_without_a_window(monkeypatch):
    """softcap=False (FlashAttention reads it as 0) means no cap, with or without a window."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged([3], [3], 4, 2, 8, torch.float32)
    for window in ((-1, -1), (2, 0)):
        plain = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, window_size=window)
        off = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, window_size=window, softcap=False)
        torch.testing.assert_close(off, plain)


def test_state_lives_in_instances_an_engine_can_hold(monkeypatch):
    """No mutable state at module level: options, selections, the call memo and plans belong to a FlashAttention;
    an engine's own instance is independent of the module functions' default one (and of another engine's)."""
    import inspect

    assert mutable_globals(flash_api) == []
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    mine, other = flash_api.FlashAttention(policy="priority"), flash_api.FlashAttention(prefill="torch")
    q, k, v, cu_q, cu_k = ragged([3, 5], [3, 5], 4, 2, 8, torch.float32)
    out = mine.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    ref = flash_api.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)  # the default instance
    assert torch.equal(out, ref)
    assert len(mine._plans) == 1 and not other._plans and not other._selections
    assert mine.options == {"policy": "priority"} and other.options == {"prefill": "torch"}
    assert flash_api.default() is flash_api.default() and flash_api.default() not in (mine, other)
    assert attnsel.flash_attn_varlen_func.__self__ is flash_api.default()  # its methods: no delegation per call
    assert "softmax_scale" in inspect.signature(attnsel.flash_attn_with_kvcache).parameters  # FA3's signature


def mutable_globals(module) -> list[str]:
    """The names a module assigns at its top level to a dict, list or set (imported names are not its state)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    names = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
    return [n for n in names if isinstance(getattr(module, n), (dict, list, set))]


def test_the_first_call_of_a_kind_says_on_stderr_what_it_is_doing(capfd, tmp_path, monkeypatch):
    """The first call of a new kind selects (seconds on a cold cache): one line on stderr says what and where the
    result is cached; a second call of that kind says nothing."""
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    fa = flash_api.FlashAttention(prefill="torch", decode="torch", extend="torch")
    q = torch.randn(5, 4, 64)
    k = torch.randn(5, 2, 64)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    fa.flash_attn_varlen_func(q, k, k.clone(), cu, cu, 5, 5, causal=True)
    err = capfd.readouterr().err
    assert err.count("attnsel: choosing the attention backends for 4/2 heads, head_dim 64, fp32") == 1
    assert str(tmp_path) in err and "once per kind of call" in err
    fa.flash_attn_varlen_func(q, k, k.clone(), cu, cu, 5, 5, causal=True)
    assert "choosing" not in capfd.readouterr().err


@pytest.mark.parametrize("func", ["varlen", "varlen_paged", "kvcache"])
def test_fa3_speed_hints_engines_pass_are_accepted_and_change_nothing(monkeypatch, func):
    """vLLM passes num_splits=0 to flash_attn_varlen_func (FA3's default there is 1), SGLang pack_gqa and
    scheduler_metadata: they only choose how FA3 parallelises, which attnsel's dispatch decides itself. They are
    checked (a wrong type or a negative split count is named) and ignored: the output is the call's without them."""
    call = _hinted_call(monkeypatch, func)
    hints = {"num_splits": 0, "pack_gqa": True}
    if func == "kvcache":
        hints["scheduler_metadata"] = torch.zeros(4, dtype=torch.int32)
    assert torch.equal(call(**hints), call())
    for bad, message in (({"num_splits": 1.0}, r"num_splits=1.0: .*allowed: an int"),
                         ({"num_splits": True}, r"num_splits=True: .*allowed: an int"),
                         ({"pack_gqa": "yes"}, r"pack_gqa='yes': .*allowed: None, True or False")):
        with pytest.raises(ValueError, match=message):
            call(**bad)


@pytest.mark.parametrize("func", ["varlen", "varlen_paged", "kvcache"])
def test_a_numpy_int_split_count_is_taken_as_fa3_takes_it_and_a_tensor_one_is_named(monkeypatch, func):
    """FA3 takes num_splits as an int argument, which torch accepts as a numpy int too (an engine reading it from a
    numpy config passes np.int64): attnsel's speed-hint check refused np.int64(0) as not an int, so such an engine
    could not call attnsel unchanged (max_seqlen_q/k already take numpy ints). FA3 takes a negative count as 0 (its
    heuristic), so a negative one was refused as a value "FA3 would not take either". A 0-dim tensor would be a
    device read: still named."""
    import numpy as np

    call = _hinted_call(monkeypatch, func)
    want = call()
    for splits in (np.int64(0), np.int32(2), -1, np.int64(-1)):  # FA3: num_splits <= 0 is its own heuristic
        assert torch.equal(call(num_splits=splits), want)
    with pytest.raises(ValueError, match=r"num_splits=<tensor \(\) torch.int64>: .*allowed: an int"):
        call(num_splits=torch.tensor(0))


def _hinted_call(monkeypatch, func):
    """One small call of ``func`` ("varlen", "varlen_paged" or "kvcache") on the torch backend, taking extra keyword
    arguments: for the speed-hint tests."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_EXTEND_BACKEND", "torch")
    torch.manual_seed(0)
    if func == "varlen":
        q, k, v, cu_q, cu_k = ragged([3, 5], [3, 5], 2, 1, 8, torch.float32)
        return lambda **kw: attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, **kw)
    kc, vc = torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    if func == "varlen_paged":
        q = torch.randn(3, 2, 8)
        cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
        return lambda **kw: attnsel.flash_attn_varlen_func(q, kc, vc, cu_q, None, 2, None, seqused_k=lens,
                                                           page_table=table, causal=True, **kw)
    q = torch.randn(2, 1, 2, 8)
    return lambda **kw: attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True,
                                                        **kw)
