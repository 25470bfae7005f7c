"""The FA-compatible calls with ragged queries over the paged cache (attnsel.flash_extend): MTP / speculative verify
(q [batch, seqlen_q, H, D] with new k/v appended first), LightLLM's varlen flash_attn_with_kvcache, the ragged
append (cu_seqlens_k_new) and FA3's paged flash_attn_varlen_func.

Numbers on the torch backend in float32 against an independent float32 reference (each row's keys gathered from
the dense tokens the test made, attnsel.validate.yardstick.reference_attention); caches checked after the append;
the bad-argument messages; what a call hands to Selection.plan_extend (a recorder stands in for the selection).
"""
import math
import re

import pytest
import torch

import attnsel
from attnsel import flash_api
from attnsel.errors import InvalidArgument
from attnsel.flash_api import UnsupportedArgument
from attnsel.validate.yardstick import reference_attention

pytestmark = pytest.mark.usefixtures("inproc_worker")
HQ, HK, D = 4, 2, 16
TOL = 1e-5


@pytest.fixture(autouse=True)
def _torch_everywhere(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "flash_extend_cache"))
    flash_api.configure(prefill="torch", decode="torch", extend="torch", policy="priority")
    yield
    flash_api.configure()


class Paged:
    """Sequences in a paged cache: row b has ``ctx[b]`` tokens of context after the call, the last ``new[b]`` of them
    given as k/v (not yet in the cache) and its last ``qlen[b]`` positions queried. Pages are shuffled, unused slots
    and spare pages hold NaN, page-table padding is -1. With ``lightllm`` the caches are LightLLM's token pool: the
    k and v halves of one ``[slots, 2 * kv_heads, head_dim]`` buffer viewed as ``[slots, 1, kv_heads, head_dim]``
    (strided, page size 1)."""

    def __init__(self, ctx, qlen, new=None, page_size=16, seed=0, lightllm=False):
        g = torch.Generator().manual_seed(seed)
        self.ctx, self.qlen, self.new, self.ps = ctx, qlen, new or [0] * len(ctx), page_size
        pages = [math.ceil(n / page_size) for n in ctx]
        total = sum(pages) + 3
        order = torch.randperm(total, generator=g)
        if lightllm:
            assert page_size == 1
            self.buffer = torch.full((total, 2 * HK, D), float("nan"))
            self.kc = self.buffer[:, :HK].reshape(-1, 1, HK, D)
            self.vc = self.buffer[:, HK:].reshape(-1, 1, HK, D)
            assert self.kc.data_ptr() == self.buffer.data_ptr() and not self.kc.is_contiguous()
        else:
            self.kc = torch.full((total, page_size, HK, D), float("nan"))
            self.vc = torch.full((total, page_size, HK, D), float("nan"))
        self.table = torch.full((len(ctx), max(pages, default=0) + 2), -1, dtype=torch.int32)
        self.k, self.v, used = [], [], 0
        for b, n in enumerate(ctx):
            self.k.append(torch.randn(n, HK, D, generator=g))
            self.v.append(torch.randn(n, HK, D, generator=g))
            for p in range(pages[b]):
                self.table[b, p] = int(order[used])
                used += 1
            for pos in range(n - self.new[b]):  # what the cache holds before the call
                self.kc[self.table[b, pos // page_size], pos % page_size] = self.k[b][pos]
                self.vc[self.table[b, pos // page_size], pos % page_size] = self.v[b][pos]
        self.q = [torch.randn(n, HQ, D, generator=g) for n in qlen]
        self.cu_q = cu(qlen)

    def new_kv(self):
        """The new tokens packed ``[total_new, KVH, D]`` and their cu_seqlens_k_new."""
        k = torch.cat([kk[n - m:] for kk, n, m in zip(self.k, self.ctx, self.new)])
        v = torch.cat([vv[n - m:] for vv, n, m in zip(self.v, self.ctx, self.new)])
        return k, v, cu(self.new)

    def cached_lens(self):
        return torch.tensor([n - m for n, m in zip(self.ctx, self.new)], dtype=torch.int32)

    def ctx_lens(self):
        return torch.tensor(self.ctx, dtype=torch.int32)

    def reference(self, window=None, softcap=None, sinks=None):
        """float32 attention per row over its dense keys (queries: the last qlen positions)."""
        return torch.cat([reference_attention(q, k, v, D ** -0.5, True, window=window, softcap=softcap, sinks=sinks)
                          for q, k, v in zip(self.q, self.k, self.v)])

    def assert_cache_holds_every_token(self):
        for b, n in enumerate(self.ctx):
            for pos in range(n):
                slot = (self.table[b, pos // self.ps], pos % self.ps)
                assert torch.equal(self.kc[slot], self.k[b][pos]), (b, pos)
                assert torch.equal(self.vc[slot], self.v[b][pos]), (b, pos)


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def close(out, ref):
    err = (out.float() - ref).abs().max().item()
    assert err < TOL, err


@pytest.mark.parametrize("page_size", [1, 16])
def test_lightllm_varlen_call_over_a_cached_prefix(page_size):
    """LightLLM's prefill call: q [total_q, H, D] with cu_seqlens_q, cache_seqlens the whole context (its new tokens
    are in the cache already), cu_seqlens_k_new its cumulative context lengths (FA3 ignores it without k/v). Rows: a
    decode row, a fresh prompt, a chunk after a cached prefix, a row without queries, a long prefix hit."""
    s = Paged(ctx=[9, 5, 50, 12, 63], qlen=[1, 5, 17, 0, 23], page_size=page_size, seed=1,
              lightllm=page_size == 1)
    q = torch.cat(s.q)
    out = attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, page_table=s.table, cache_seqlens=s.ctx_lens(),
                                          cu_seqlens_q=s.cu_q, cu_seqlens_k_new=cu(s.ctx), max_seqlen_q=23,
                                          softmax_scale=D ** -0.5, causal=True, window_size=(-1, -1), softcap=0.0,
                                          k_descale=None, v_descale=None, return_softmax_lse=False)
    assert out.shape == q.shape
    close(out, s.reference())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seqlen_q", [2, 3, 4])
def test_mtp_verify_appends_the_new_tokens_first(page_size, seqlen_q):
    """Speculative verify / MTP: q [batch, seqlen_q, H, D] and as many new k/v per sequence; the new tokens are
    written at positions cache_seqlens.. (in place) and attended to, bottom-right causal."""
    ctx = [seqlen_q, 7 + seqlen_q, 16, 40 + seqlen_q]  # a row that is only its new tokens; one ending on a page edge
    s = Paged(ctx=ctx, qlen=[seqlen_q] * 4, new=[seqlen_q] * 4, page_size=page_size, seed=seqlen_q)
    k, v, _ = s.new_kv()
    q = torch.stack(s.q)
    out = attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, k.view(4, seqlen_q, HK, D), v.view(4, seqlen_q, HK, D),
                                          cache_seqlens=s.cached_lens(), page_table=s.table, causal=True)
    assert out.shape == q.shape
    close(out.flatten(0, 1), s.reference())
    s.assert_cache_holds_every_token()


@pytest.mark.parametrize("page_size", [1, 16])
def test_varlen_with_ragged_new_tokens(page_size):
    """The varlen form with new tokens: k/v [total_k_new, KVH, D] and cu_seqlens_k_new, appended ragged at
    cache_seqlens (tokens before them); queries ragged too, not always as many as new tokens."""
    s = Paged(ctx=[3, 20, 33, 9], qlen=[3, 4, 1, 0], new=[3, 4, 2, 1], page_size=page_size, seed=5)
    k, v, cu_new = s.new_kv()
    q = torch.cat(s.q)
    out = attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, k, v, cache_seqlens=s.cached_lens(), page_table=s.table,
                                          cu_seqlens_q=s.cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=4, causal=True)
    close(out, s.reference())
    s.assert_cache_holds_every_token()


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_varlen_func(page_size):
    """FA3's paged flash_attn_varlen_func: k/v are the caches, seqused_k the contexts, cu_seqlens_k None."""
    s = Paged(ctx=[30, 6, 17], qlen=[30, 2, 5], page_size=page_size, seed=7)
    q = torch.cat(s.q)
    out = attnsel.flash_attn_varlen_func(q, s.kc, s.vc, s.cu_q, None, 30, 30, seqused_k=s.ctx_lens(),
                                         page_table=s.table, causal=True)
    close(out, s.reference())


def test_window_softcap_and_sinks():
    s = Paged(ctx=[40, 25], qlen=[9, 25], seed=8)
    sinks = torch.randn(HQ)
    out = attnsel.flash_attn_with_kvcache(torch.cat(s.q), s.kc, s.vc, page_table=s.table,
                                          cache_seqlens=s.ctx_lens(), cu_seqlens_q=s.cu_q, max_seqlen_q=25,
                                          causal=True, window_size=(6, 0), softcap=5.0, sinks=sinks)
    close(out, s.reference(window=7, softcap=5.0, sinks=sinks))


def test_one_plan_per_step_and_a_new_one_after_the_lengths_change(monkeypatch):
    """The layers of a step share a plan (the same metadata tensors at the same versions); an in-place update of
    cache_seqlens makes a new one, and the output follows it."""
    planned = []
    real = attnsel.Selection.plan_extend
    monkeypatch.setattr(attnsel.Selection, "plan_extend", lambda self, *a, **kw: planned.append(1) or real(
        self, *a, **kw))
    s = Paged(ctx=[20, 11], qlen=[4, 3], seed=9)
    q, lens = torch.cat(s.q), s.ctx_lens()
    for _ in range(3):
        out = attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, page_table=s.table, cache_seqlens=lens,
                                              cu_seqlens_q=s.cu_q, max_seqlen_q=4, causal=True)
    assert len(planned) == 1
    close(out, s.reference())
    lens[0] = 18  # row 0's queries now end two tokens earlier
    out = attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, page_table=s.table, cache_seqlens=lens, cu_seqlens_q=s.cu_q,
                                          max_seqlen_q=4, causal=True)
    assert len(planned) == 2
    s.ctx[0], s.k[0], s.v[0] = 18, s.k[0][:18], s.v[0][:18]
    close(out, s.reference())


class Recorder:
    """Stands in for the selection: records plan_extend's arguments and runs the float32 reference of the planned
    batch (rows gathered through the page table from the caches the run gets)."""

    def __init__(self, mode="eager"):
        self.mode, self.plans, self.modes = mode, [], []
        self.prefill = self.decode = "recorder"

    def __call__(self, spec, device, mode=None):
        self.modes.append(mode)
        self.spec = spec
        return self

    def plan_extend(self, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len=None, total_q=None,
                    context_tokens=None, *, longest=None, checked=True):
        self.plans.append(dict(cu_seqlens_q=cu_seqlens_q.tolist(), seq_lens=seq_lens.tolist(),
                               max_seqlen_q=max_seqlen_q, max_seq_len=max_seq_len, total_q=total_q,
                               context_tokens=context_tokens, longest=longest, checked=checked))
        return lambda q, k_cache, v_cache, **kw: torch.zeros_like(q)


def test_what_plan_extend_gets(monkeypatch):
    """seq_lens count the new tokens; the dispatch gets the batch's context tokens and its longest context from the
    plan's one host read; a batched q gets offsets of seqlen_q per row; the run is the backend's own (checked=False:
    the call made the checks)."""
    rec = Recorder()
    monkeypatch.setattr(flash_api.default(), "selection_for", rec)
    s = Paged(ctx=[5, 12], qlen=[3, 3], new=[3, 3], seed=10)
    k, v, _ = s.new_kv()
    attnsel.flash_attn_with_kvcache(torch.stack(s.q), s.kc, s.vc, k.view(2, 3, HK, D), v.view(2, 3, HK, D),
                                    cache_seqlens=s.cached_lens(), page_table=s.table, causal=True)
    assert rec.plans == [dict(cu_seqlens_q=[0, 3, 6], seq_lens=[5, 12], max_seqlen_q=3, max_seq_len=12, total_q=6,
                              context_tokens=17, longest=12, checked=False)]
    assert rec.spec.causal and rec.spec.page_size == 16


def test_a_captured_call_plans_on_the_graph_selection_from_host_bounds(monkeypatch):
    """During CUDA-graph capture (stood in for) the plan reads nothing on the host: the longest context is the page
    table's capacity, no context tokens; it plans on the mode "graph" selection and is kept for the process."""
    rec = Recorder()
    monkeypatch.setattr(flash_api.default(), "selection_for", rec)
    monkeypatch.setattr(flash_api.default()._extend, "_captured", [])
    monkeypatch.setattr(flash_api, "_capturing", lambda t: True)
    s = Paged(ctx=[5, 12], qlen=[2, 3], seed=11)
    args = dict(page_table=s.table, cache_seqlens=s.ctx_lens(), cu_seqlens_q=s.cu_q, max_seqlen_q=3, causal=True)
    for _ in range(2):
        attnsel.flash_attn_with_kvcache(torch.cat(s.q), s.kc, s.vc, **args)
    assert [p["max_seq_len"] for p in rec.plans] == [s.table.shape[1] * 16] * 2  # planned afresh each call
    assert [p["context_tokens"] for p in rec.plans] == [None, None]
    assert [p["longest"] for p in rec.plans] == [None, None]  # the table's capacity is no row's length
    assert "graph" in rec.modes and len(flash_api.default()._extend._captured) == 2


def _bad_calls():
    """(what, call, error type, message) of calls that must be refused, each before anything is planned or written."""
    s = Paged(ctx=[6, 9], qlen=[2, 3], new=[2, 3], seed=12)
    k, v, cu_new = s.new_kv()
    q3, lens, cached = torch.cat(s.q), s.ctx_lens(), s.cached_lens()
    q4 = torch.randn(2, 3, HQ, D)
    k4 = torch.randn(2, 3, HK, D)
    kv = dict(k_cache=s.kc, v_cache=s.vc, page_table=s.table)
    varlen = dict(cu_seqlens_q=s.cu_q, max_seqlen_q=3)
    f, fv = attnsel.flash_attn_with_kvcache, attnsel.flash_attn_varlen_func
    return s, [
        ("4-D q with cu_seqlens_q", lambda: f(q4, **kv, cache_seqlens=lens, **varlen, causal=True), InvalidArgument,
         "with cu_seqlens_q, q must be [total_q, heads, head_dim]"),
        ("no max_seqlen_q", lambda: f(q3, **kv, cache_seqlens=lens, cu_seqlens_q=s.cu_q, causal=True),
         InvalidArgument, "max_seqlen_q is required with cu_seqlens_q"),
        ("float max_seqlen_q", lambda: f(q3, **kv, cache_seqlens=lens, cu_seqlens_q=s.cu_q, max_seqlen_q=3.0,
                                         causal=True), InvalidArgument,
         "max_seqlen_q must be a non-negative Python int"),
        ("3-D q alone", lambda: f(q3, **kv, cache_seqlens=lens, causal=True), InvalidArgument,
         "give cu_seqlens_q and max_seqlen_q with it"),
        ("int64 cu_seqlens_q", lambda: f(q3, **kv, cache_seqlens=lens, cu_seqlens_q=s.cu_q.long(), max_seqlen_q=3,
                                         causal=True), InvalidArgument, "cu_seqlens_q must be int32 [3]"),
        ("non-causal", lambda: f(q4, **kv, cache_seqlens=lens), UnsupportedArgument,
         "causal=False with up to 3 queries per sequence"),
        ("window past the diagonal", lambda: f(q4, **kv, cache_seqlens=lens, window_size=(4, 4)),
         UnsupportedArgument, "window_size=(4, 4) with causal=False"),
        ("a row over max_seqlen_q", lambda: f(q3, **kv, cache_seqlens=lens, cu_seqlens_q=s.cu_q, max_seqlen_q=2,
                                              causal=True), ValueError,
         "cu_seqlens_q gives a sequence 3 queries (max_seqlen_q=2)"),
        ("negative first query offset", lambda: f(q3, **kv, cache_seqlens=lens, max_seqlen_q=3, causal=True,
                                                  cu_seqlens_q=torch.tensor([-1, 2, 5], dtype=torch.int32)),
         ValueError, "cu_seqlens_q[0] is -1 (q's rows start at 0)"),
        ("paged varlen negative first offset", lambda: fv(q3, s.kc, s.vc, torch.tensor([-1, 2, 5], dtype=torch.int32),
                                                          None, 3, 9, seqused_k=lens, page_table=s.table,
                                                          causal=True), ValueError, "cu_seqlens_q[0] is -1"),
        ("q shorter than cu_seqlens_q", lambda: f(q3[:4], **kv, cache_seqlens=lens, **varlen, causal=True),
         ValueError, "cu_seqlens_q[-1] is 5 but q holds 4 rows"),
        ("batch mismatch", lambda: f(q4[:1], **kv, cache_seqlens=lens[:1], causal=True), ValueError,
         "page_table must be int32 [batch, max_pages] with batch 1"),
        ("k without v", lambda: f(q3, **kv, k=k, cache_seqlens=cached, cu_seqlens_k_new=cu_new, **varlen,
                                  causal=True), ValueError, "give both k and v"),
        ("packed k alone", lambda: f(q3, **kv, k=k, v=v, cache_seqlens=cached, **varlen, causal=True),
         InvalidArgument, "give cu_seqlens_k_new with it"),
        ("4-D k with cu_seqlens_k_new", lambda: f(q4, **kv, k=k4, v=k4, cache_seqlens=cached,
                                                  cu_seqlens_k_new=cu_new, causal=True), InvalidArgument,
         "with cu_seqlens_k_new, k and v must be [total_k_new, kv_heads, head_dim]"),
        ("cu_seqlens_k_new short of k", lambda: f(q3, **kv, k=k, v=v, cache_seqlens=cached,
                                                  cu_seqlens_k_new=cu([2, 2]), **varlen, causal=True), ValueError,
         "cu_seqlens_k_new must start at 0, not decrease and end at k's 5 rows; got start 0, end 4"),
        ("past the table", lambda: f(q3, **kv, k=k, v=v, cache_seqlens=cached + 40, cu_seqlens_k_new=cu_new,
                                     **varlen, causal=True), ValueError,
         "holds 48 tokens per sequence (3 pages of 16), too few for 49 (the longest cache_seqlens + new tokens)"),
        ("negative length", lambda: f(q3, **kv, cache_seqlens=lens - 7, **varlen, causal=True), ValueError,
         "cache_seqlens holds a negative length -1"),
        ("new tokens into fp8", lambda: f(q3, s.kc.to(torch.float8_e4m3fn), s.vc.to(torch.float8_e4m3fn), k=k, v=v,
                                          page_table=s.table, cache_seqlens=cached, cu_seqlens_k_new=cu_new,
                                          k_descale=torch.ones(1), v_descale=torch.ones(1), **varlen, causal=True),
         UnsupportedArgument, "k=<tensor"),
        ("paged varlen with cu_seqlens_k", lambda: fv(q3, s.kc, s.vc, s.cu_q, s.cu_q, 3, 9, seqused_k=lens,
                                                      page_table=s.table, causal=True), InvalidArgument,
         "cu_seqlens_k with a page_table"),
        ("paged varlen without seqused_k", lambda: fv(q3, s.kc, s.vc, s.cu_q, None, 3, 9, page_table=s.table,
                                                      causal=True), InvalidArgument, "a page_table needs seqused_k"),
        ("paged varlen with seqused_q", lambda: fv(q3, s.kc, s.vc, s.cu_q, None, 3, 9, seqused_q=lens,
                                                   seqused_k=lens, page_table=s.table, causal=True),
         UnsupportedArgument, "seqused_q=<tensor"),
        ("paged varlen int64 seqused_k", lambda: fv(q3, s.kc, s.vc, s.cu_q, None, 3, 9, seqused_k=lens.long(),
                                                    page_table=s.table, causal=True), InvalidArgument,
         "seqused_k must be int32 [2]"),
        ("paged varlen list seqused_k", lambda: fv(q3, s.kc, s.vc, s.cu_q, None, 3, 9, seqused_k=[6, 9],
                                                   page_table=s.table, causal=True), TypeError,
         "seqused_k must be a torch.Tensor, got list"),
    ]


@pytest.mark.parametrize("what", [c[0] for c in _bad_calls()[1]])
def test_bad_arguments_are_named_before_anything_is_written(monkeypatch, what):
    rec = Recorder()
    monkeypatch.setattr(flash_api.default(), "selection_for", rec)
    s, calls = _bad_calls()
    _, call, error, message = next(c for c in calls if c[0] == what)
    before = s.kc.clone(), s.vc.clone()
    with pytest.raises(error, match=re.escape(message)):
        call()
    assert rec.plans == []
    assert torch.equal(s.kc.nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(s.vc.nan_to_num(7.0), before[1].nan_to_num(7.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["torch", "triton", "fa3", "flashinfer"])
def test_gpu_mtp_verify_captured_then_replayed_with_new_lengths(name, tmp_path):
    """MTP verify (q [batch, 2, H, D], two new k/v per sequence) captured in a CUDA graph in mode "graph", then
    replayed after the engine rewrote cache_seqlens, q and k/v in place and poisoned the slots past each sequence:
    each replay appends at the new positions and matches its own float32 reference."""
    from attnsel import AttentionSpec
    from attnsel.backends import availability, get, graph_stale_reason

    d, ps, batch, width, dev = 64, 16, 3, 8, "cuda"
    spec = AttentionSpec(HQ, HK, d, "bf16", page_size=ps)
    reason = availability(get(name), spec, "extend", torch.device(dev))[0] or graph_stale_reason(get(name), "extend")
    if reason:
        pytest.skip(f"{name}: {reason}")
    flash_api.configure(prefill="triton", decode="triton", extend=name, policy="priority", mode="graph",
                        cache_dir=str(tmp_path))
    g = torch.Generator().manual_seed(21)
    dense_k = torch.randn(batch, width * ps, HK, d, generator=g).bfloat16()
    dense_v = torch.randn(batch, width * ps, HK, d, generator=g).bfloat16()
    table = torch.randperm(batch * width + 2, generator=g)[:batch * width].view(batch, width).int().to(dev)
    kc = torch.zeros(batch * width + 2, ps, HK, d, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    q = torch.zeros(batch, 2, HQ, d, dtype=torch.bfloat16, device=dev)
    k_new, v_new = torch.zeros(batch, 2, HK, d, dtype=torch.bfloat16, device=dev), torch.zeros_like(q[:, :, :HK])
    lens = torch.zeros(batch, dtype=torch.int32, device=dev)

    def set_step(cached):
        """The engine's in-place writes before a step: lengths, queries, new tokens, caches (NaN past each row)."""
        lens.copy_(torch.tensor(cached, dtype=torch.int32))
        q.copy_(torch.randn(batch, 2, HQ, d, generator=g).bfloat16())
        for b, n in enumerate(cached):
            k_new[b].copy_(dense_k[b, n:n + 2])
            v_new[b].copy_(dense_v[b, n:n + 2])
            for pos in range(width * ps):
                slot = (table[b, pos // ps], pos % ps)
                kc[slot] = dense_k[b, pos].to(dev) if pos < n else float("nan")
                vc[slot] = dense_v[b, pos].to(dev) if pos < n else float("nan")

    def check(out, cached):
        torch.cuda.synchronize()
        for b, n in enumerate(cached):
            ref = reference_attention(q[b].float().cpu(), dense_k[b, :n + 2].float(), dense_v[b, :n + 2].float(),
                                      d ** -0.5, True)
            assert (out[b].float().cpu() - ref).abs().max().item() < 2e-2, (name, b, n)
            for pos in (n, n + 1):
                assert torch.equal(kc[table[b, pos // ps], pos % ps].cpu(), dense_k[b, pos])

    def call():
        return attnsel.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, page_table=table,
                                               causal=True)

    try:
        set_step([5, 40, 14])
        check(call(), [5, 40, 14])  # eager, outside capture: the selection is made here
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for cached in ([0, 17, 100], [126, 1, 63], [14, 14, 14]):
            set_step(cached)
            graph.replay()
            check(out, cached)
    finally:
        flash_api.configure()
