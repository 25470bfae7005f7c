"""Engine call patterns of the FA-compatible extend calls (attnsel.flash_extend) on the torch backend, each query row
judged against a float64 reference written here (no attnsel code): LightLLM's call as is at page sizes 1 to 256 with
window and sinks, huge sentinel page ids and NaN/inf in unused slots, max_seqlen_q as a loose bound, rows and whole
batches without queries, q and metadata as strided views (q split off a fused qkv buffer, lengths and offsets taken
from wider tensors, a column-sliced page table), and in-place metadata updates between steps."""
import math

import pytest
import torch

import attnsel
from attnsel import flash_api

pytestmark = pytest.mark.usefixtures("inproc_worker")
HQ, HK, D = 4, 2, 16


@pytest.fixture(autouse=True)
def _torch_everywhere():
    flash_api.configure(prefill="torch", decode="torch", extend="torch", policy="priority")
    yield
    flash_api.configure()


def _reference(q, k, v, window=None, sinks=None):
    """float64 attention of q [lq, H, D], its row's last tokens, over k/v [n, KVH, D], bottom-right causal; a window
    of ``window`` keys; a query that sees no key gives zeros."""
    lq, n, g = q.shape[0], k.shape[0], HQ // HK
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    out = torch.zeros(lq, HQ, D, dtype=torch.float64)
    for i in range(lq):
        pos = n - lq + i
        lo = 0 if window is None else max(0, pos - window + 1)
        if pos < 0:
            continue
        s = torch.einsum("hd,nhd->hn", q[i].double(), k[lo:pos + 1]) * D ** -0.5
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        p = s.softmax(-1)[:, :pos + 1 - lo]
        out[i] = torch.einsum("hn,nhd->hd", p, v[lo:pos + 1])
    return out


class Rows:
    """Rows of ``ctx[b]`` tokens in a paged cache (shuffled pages; unused slots NaN in k, -inf in v; unused table
    columns ``sentinel``) with their last ``qlen[b]`` positions queried."""

    def __init__(self, ctx, qlen, page_size, sentinel=-1, seed=0):
        g = torch.Generator().manual_seed(seed)
        pages = [math.ceil(n / page_size) for n in ctx]
        total = sum(pages) + 3
        order = torch.randperm(total, generator=g).tolist()
        self.kc = torch.full((total, page_size, HK, D), float("nan"))
        self.vc = torch.full((total, page_size, HK, D), float("-inf"))
        self.table = torch.full((len(ctx), max(pages, default=0) + 2), sentinel, dtype=torch.int32)
        self.k, self.v = [], []
        for b, n in enumerate(ctx):
            self.k.append(torch.randn(n, HK, D, generator=g))
            self.v.append(torch.randn(n, HK, D, generator=g))
            for p in range(pages[b]):
                self.table[b, p] = order.pop()
            for pos in range(n):
                self.kc[self.table[b, pos // page_size], pos % page_size] = self.k[b][pos]
                self.vc[self.table[b, pos // page_size], pos % page_size] = self.v[b][pos]
        self.qs = [torch.randn(n, HQ, D, generator=g) for n in qlen]
        self.q = torch.cat(self.qs) if qlen else torch.zeros(0, HQ, D)
        self.ctx, self.qlen = ctx, qlen

    def check(self, out, lens=None, window=None, sinks=None):
        lens = self.ctx if lens is None else lens
        refs = [_reference(q, k[:n], v[:n], window, sinks) for q, k, v, n in zip(self.qs, self.k, self.v, lens)]
        ref = torch.cat(refs) if refs else torch.zeros(0, HQ, D, dtype=torch.float64)
        err = (out[:ref.shape[0]].double() - ref).abs().amax((1, 2))
        assert not (err >= 2e-5).any() and not err.isnan().any(), err


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 64, 128, 256])
@pytest.mark.parametrize("sentinel", [-1, 2 ** 31 - 1])
@pytest.mark.parametrize("mask", ["causal", "window-sinks"])
def test_lightllm_call_as_is(page_size, sentinel, mask):
    """LightLLM's call: page size 1 caches as k.view(-1, 1, kvh, d) with a token-level table, cache_seqlens the
    whole context, cu_seqlens_k_new its cumulative context lengths, max_seqlen_q a loose bound. Rows: a prefix ending
    mid-page, a fresh prompt, no queries, 0 tokens with queries, a one-token decode row."""
    s = Rows([page_size + 3, 5, 2 * page_size + 7, 0, 9], [4, 5, 0, 2, 1], page_size, sentinel)
    kc, vc = s.kc, s.vc
    if page_size == 1:
        kc, vc = kc.reshape(-1, HK, D).view(-1, 1, HK, D), vc.reshape(-1, HK, D).view(-1, 1, HK, D)
    window, sinks = ((6, 0), torch.randn(HQ)) if mask == "window-sinks" else ((-1, -1), None)
    out = attnsel.flash_attn_with_kvcache(q=s.q, k_cache=kc, v_cache=vc, page_table=s.table,
                                          cache_seqlens=torch.tensor(s.ctx, dtype=torch.int32),
                                          cu_seqlens_q=_cu(s.qlen), cu_seqlens_k_new=_cu(s.ctx), max_seqlen_q=64,
                                          softmax_scale=D ** -0.5, causal=True, window_size=window, softcap=0.0,
                                          k_descale=None, v_descale=None, return_softmax_lse=False, sinks=sinks)
    s.check(out, window=None if sinks is None else 7, sinks=sinks)


def test_batches_without_queries():
    s = Rows([5, 7, 0], [0, 0, 0], 16)
    lens = torch.tensor(s.ctx, dtype=torch.int32)
    out = attnsel.flash_attn_with_kvcache(s.q, s.kc, s.vc, cache_seqlens=lens, page_table=s.table,
                                          cu_seqlens_q=_cu(s.qlen), max_seqlen_q=0, causal=True)
    assert out.shape == (0, HQ, D)
    out = attnsel.flash_attn_varlen_func(s.q, s.kc, s.vc, _cu(s.qlen), None, 4, None, seqused_k=lens,
                                         page_table=s.table, causal=True)
    assert out.shape == (0, HQ, D)


@pytest.mark.parametrize("func", ["with_kvcache", "varlen"])
def test_strided_q_and_metadata_views(func):
    """q split off a fused [tokens, H + 2 KVH, D] buffer; lengths, offsets and the table as views of wider tensors."""
    s = Rows([9, 20, 33], [2, 5, 3], 4)
    qkv = torch.zeros(s.q.shape[0], HQ + 2 * HK, D)
    qkv[:, :HQ] = s.q
    lens = torch.stack([torch.tensor(s.ctx, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)], 1)[:, 0]
    cuq = torch.stack([_cu(s.qlen), torch.zeros(4, dtype=torch.int32)], 1)[:, 0]
    wide = torch.full((3, 40), -1, dtype=torch.int32)
    wide[:, :s.table.shape[1]] = s.table
    table = wide[:, :s.table.shape[1]]
    assert not (qkv[:, :HQ].is_contiguous() or lens.is_contiguous() or cuq.is_contiguous() or table.is_contiguous())
    if func == "varlen":
        out = attnsel.flash_attn_varlen_func(qkv[:, :HQ], s.kc, s.vc, cuq, None, 5, None, seqused_k=lens,
                                             page_table=table, causal=True, softmax_scale=D ** -0.5)
    else:
        out = attnsel.flash_attn_with_kvcache(qkv[:, :HQ], s.kc, s.vc, cache_seqlens=lens, page_table=table,
                                              cu_seqlens_q=cuq, max_seqlen_q=5, causal=True, softmax_scale=D ** -0.5)
    s.check(out)


def test_metadata_updated_in_place_between_steps():
    """One set of metadata tensors rewritten in place (copy_) each step, real rows shrinking to padding rows of 0
    tokens and 0 queries; every step judged against its own lengths."""
    s = Rows([40, 30, 50], [4, 4, 4], 8)
    lens = torch.tensor(s.ctx, dtype=torch.int32)
    cuq = _cu(s.qlen)
    for ctx, qlen in (([40, 30, 50], [4, 4, 4]), ([12, 30, 0], [3, 1, 0]), ([7, 0, 0], [2, 0, 0]),
                      ([0, 0, 0], [0, 0, 0]), ([40, 3, 9], [4, 3, 1])):
        lens.copy_(torch.tensor(ctx))
        cuq.copy_(_cu(qlen))
        s.qs = [torch.randn(n, HQ, D) for n in qlen]
        q = torch.cat([*s.qs, torch.full((12 - sum(qlen), HQ, D), float("nan"))])  # padding rows after the last
        out = attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, cache_seqlens=lens, page_table=s.table,
                                              cu_seqlens_q=cuq, max_seqlen_q=4, causal=True, softmax_scale=D ** -0.5)
        s.check(out, lens=ctx)
