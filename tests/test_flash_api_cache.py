"""flash_attn_with_kvcache writing new tokens into strided caches, and FA3's window_size / causal combinations.

Numbers against the independent float32 reference of tests/test_flash_api.py (explicit softmax per sequence); the
torch backend runs fp32 and the Triton kernels (interpreted on CPU) fp16.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnsel
from attnsel import flash_api
from attnsel.flash_api import UnsupportedArgument
from tests.test_flash_api import DEV, paged, ragged, reference

BACKENDS = [("torch", torch.float32, 1e-5), ("triton", torch.float16, 2e-3)]
# The selections these calls make validate in a worker thread (tests/fixtures/inproc_worker.py): the calls are
# under test here, not the worker process.
pytestmark = pytest.mark.usefixtures("inproc_worker")


@pytest.fixture(autouse=True)
def _fresh(tmp_path_factory, monkeypatch):
    # One result cache for the module: each distinct spec is validated once, not once per test.
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "flash_api_cache_cache"))
    flash_api.configure(policy="priority")
    yield
    flash_api.configure()


def _caches(layout, kc, vc):
    """(the tensor the caller owns, k_cache, v_cache): "combined" is one [pages, 2, page_size, kvh, d] tensor whose
    k and v halves are strided views (kv[:, 0], kv[:, 1]); "separate" two contiguous caches."""
    if layout == "combined":
        kv = torch.stack((kc, vc), 1).contiguous()
        return kv, kv[:, 0], kv[:, 1]
    return (kc, vc), kc, vc


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS)
@pytest.mark.parametrize("layout", ["combined", "separate"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_new_tokens_are_written_into_the_callers_cache(monkeypatch, backend, dtype, tol, layout, page_size):
    """k/v appended into kv[:, 0] / kv[:, 1] of a combined [pages, 2, page_size, kvh, d] cache raised "view size is
    not compatible" (the write viewed the cache as [slots, kvh, d]); FA3 writes into such caches in place. The new
    tokens must land in the caller's tensor at their slots, nothing else in it may change, and the output must
    attend to them."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", backend)
    lens, hq, hk, d = [1, 5, 17, 21], 4, 2, 16
    kc, vc, table, ks, vs = paged(lens, hk, d, page_size, dtype, seed=3, garbage=1e4)
    owner, k_cache, v_cache = _caches(layout, kc, vc)
    assert layout == "separate" or not k_cache.is_contiguous()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), 1, hq, d, generator=g).to(DEV, dtype)
    k_new = torch.stack([kk[-1:] for kk in ks]).to(DEV, dtype)
    v_new = torch.stack([vv[-1:] for vv in vs]).to(DEV, dtype)
    slots = [(int(table[b, (n - 1) // page_size]), (n - 1) % page_size) for b, n in enumerate(lens)]
    for page, off in slots:  # poison the slots the new tokens go to
        k_cache[page, off] = float("nan")
        v_cache[page, off] = float("nan")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, (page, off) in enumerate(slots):
        expected_k[page, off], expected_v[page, off] = k_new[b, 0], v_new[b, 0]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV) - 1
    out = attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, page_table=table)
    if layout == "combined":  # read back through the caller's own tensor, not the views handed in
        got_k, got_v = owner[:, 0], owner[:, 1]
    else:
        got_k, got_v = owner
    assert torch.equal(got_k.cpu(), expected_k.cpu()) and torch.equal(got_v.cpu(), expected_v.cpu())
    ref = reference(q[:, 0].float().cpu(), torch.cat(ks).to(dtype).float(), torch.cat(vs).to(dtype).float(),
                    [1] * len(lens), lens, d ** -0.5)
    err = (out[:, 0].float().cpu() - ref).abs().max().item()
    assert err < tol, err


class _Outputs(TorchDispatchMode):
    """Records every aten op run under it with the sizes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), [t for t in outs if isinstance(t, torch.Tensor)]))
        return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_write_into_a_strided_cache_copies_no_cache(page_size):
    """The write of new tokens into kv[:, 0] / kv[:, 1] makes no tensor of the cache's size (a .contiguous() copy
    written into and copied back would pass the numbers test at twice the cache's memory traffic per layer): every
    tensor an op returns is the cache itself or at most the new tokens' size."""
    from attnsel import kv_append
    pages, hk, d, batch = 64, 2, 8, 3
    kv = torch.zeros(pages, 2, page_size, hk, d)
    table = torch.arange(batch * 4, dtype=torch.int32).view(batch, 4) * 3 % pages
    seqlens = torch.tensor([0, page_size + 1, 3 * page_size - 1], dtype=torch.int32)
    slots = kv_append.plan_slots(table, seqlens, page_size)
    k_new, v_new = torch.randn(batch, 1, hk, d), torch.randn(batch, 1, hk, d)
    with _Outputs() as seen:
        kv_append.write(kv[:, 0], kv[:, 1], k_new, v_new, slots)
    storage = kv.untyped_storage().data_ptr()
    for op, outs in seen.ops:
        for t in outs:
            assert t.untyped_storage().data_ptr() == storage or t.numel() <= batch * hk * d, (op, tuple(t.shape))
    for b, n in enumerate(seqlens.tolist()):
        page, off = int(table[b, n // page_size]), n % page_size
        assert torch.equal(kv[page, 0, off], k_new[b, 0]) and torch.equal(kv[page, 1, off], v_new[b, 0])
    assert int((kv != 0).any(-1).any(-1).sum()) == 2 * batch  # nothing else written


# FA3 (hopper/flash_api.cpp, mask.h): query i attends to keys [i + Sk - Sq - left, i + Sk - Sq + right] (a negative
# bound: unbounded; causal forces right = 0). One query per sequence (Sq = 1, i = 0) sees [Sk - 1 - left, Sk - 1]
# whatever right is: no key lies past the query. So every pair is a causal window of left + 1 keys (none for left < 0)
# with causal True or False.
KVCACHE_WINDOWS = [(4, 0), (4, -1), (4, 3), (4, 100), (-1, 0), (-1, 7), (-1, -1), (-2, 0), (0, 0), (50, 0)]


def _window_of(left):
    return left + 1 if left >= 0 else None


# torch runs every window; the interpreted Triton kernel (slow on CPU) the ones that differ in kind
WINDOW_CASES = ([(*BACKENDS[0], w) for w in KVCACHE_WINDOWS]
                + [(*BACKENDS[1], w) for w in ((4, 0), (-1, 0), (4, 3))])


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("backend,dtype,tol,window_size", WINDOW_CASES, ids=str)
def test_kvcache_takes_every_window_with_or_without_causal(monkeypatch, backend, dtype, tol, causal, window_size):
    """window_size=(w, 0) with FA3's default causal=False was refused, although one query per sequence makes it the
    causal window FA3 computes; (-1, 0) too (plain causal)."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", backend)
    lens, hq, hk, d, ps = [1, 3, 9, 13], 4, 2, 16, 4
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, dtype, seed=6, garbage=1e4)
    q = torch.randn(len(lens), 1, hq, d, generator=torch.Generator().manual_seed(6)).to(DEV, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = attnsel.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=causal,
                                          window_size=window_size)
    ref = reference(q[:, 0].float().cpu(), torch.cat(ks).to(dtype).float(), torch.cat(vs).to(dtype).float(),
                    [1] * len(lens), lens, d ** -0.5, window=_window_of(window_size[0]))
    err = (out[:, 0].float().cpu() - ref).abs().max().item()
    assert err < tol, err


@pytest.mark.parametrize("window_size", [(2, 0), (2, 5)], ids=str)
def test_kvcache_window_counts_the_new_token(monkeypatch, window_size):
    """With k/v the query is the new token at position cache_seqlens: a window of left + 1 keys ends there."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    lens, hq, hk, d, ps = [1, 4, 9], 4, 2, 16, 4
    kc, vc, table, ks, vs = paged(lens, hk, d, ps, torch.float32, seed=8, garbage=1e4)
    owner, k_cache, v_cache = _caches("combined", kc, vc)
    q = torch.randn(len(lens), 1, hq, d, generator=torch.Generator().manual_seed(8)).to(DEV)
    k_new = torch.stack([kk[-1:] for kk in ks]).to(DEV)
    v_new = torch.stack([vv[-1:] for vv in vs]).to(DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV) - 1
    out = attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                          page_table=table, window_size=window_size)
    ref = reference(q[:, 0].cpu(), torch.cat(ks), torch.cat(vs), [1] * len(lens), lens, d ** -0.5,
                    window=_window_of(window_size[0]))
    assert (out[:, 0].cpu() - ref).abs().max().item() < 1e-5


LENS_Q, LENS_K = [1, 4, 6], [1, 9, 6]  # one query, a chunk after cached keys (Sq < Sk), Sq == Sk


@pytest.mark.parametrize("causal,window_size", [(False, (2, 0)), (False, (-1, 0)), (False, (-3, 0)),
                                                (True, (2, 0)), (True, (2, 4)), (True, (-1, 3))], ids=str)
def test_varlen_noncausal_window_closed_on_the_right_is_causal(monkeypatch, causal, window_size):
    """FA3 masks keys past i + Sk - Sq + right: causal=False with right = 0 is the bottom-right causal mask, with a
    window of left + 1 keys (left >= 0) or none (left < 0). It was refused with causal=False."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged(LENS_Q, LENS_K, 4, 2, 16, torch.float32, seed=9)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal,
                                         window_size=window_size)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), LENS_Q, LENS_K, 16 ** -0.5, window=_window_of(window_size[0]))
    assert (out.cpu() - ref).abs().max().item() < 1e-5
    spec = next(iter(flash_api.default()._specs.values()))[0]
    assert spec.causal and spec.sliding_window == _window_of(window_size[0])


@pytest.mark.parametrize("window_size", [(2, 1), (2, -1), (-1, 3), (0, 2)], ids=str)
def test_varlen_noncausal_window_open_on_the_right_is_refused(monkeypatch, window_size):
    """causal=False with a right bound past the diagonal (right > 0, or -1: unbounded) lets queries see later keys:
    not a mask attnsel serves. The error names the window and what is allowed."""
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v, cu_q, cu_k = ragged(LENS_Q, LENS_K, 4, 2, 16, torch.float32, seed=9)
    allowed = (r"with causal=False: not supported by attnsel; allowed: \(-1, -1\) \(no window\), or \(left, 0\) "
               r".*with causal=True any \(left, right\)")
    with pytest.raises(UnsupportedArgument, match=rf"window_size={window_size!r} ".replace("(", r"\(")
                       .replace(")", r"\)") + allowed):
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), window_size=window_size)
    assert not flash_api.default()._specs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_strided_append_captured_in_a_cuda_graph(page_size):
    """The write into kv[:, 0] / kv[:, 1] (page and offset indexing) captured with the decode and replayed after
    cache_seqlens and the new tokens changed in place: the replay writes the new tokens at the new positions of the
    caller's tensor and attends to them."""
    flash_api.configure(policy="priority", mode="graph")
    lens, hq, hk, d = [5, 16, 33], 8, 2, 128
    kc, vc, table, ks, vs = paged(lens, hk, d, page_size, torch.bfloat16, seed=5, spare_pages=8)
    kv, k_cache, v_cache = _caches("combined", kc, vc)
    q = torch.randn(len(lens), 1, hq, d, device=DEV, dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV) - 1
    k_new = torch.stack([kk[-1:] for kk in ks]).to(DEV, torch.bfloat16)
    v_new = torch.stack([vv[-1:] for vv in vs]).to(DEV, torch.bfloat16)
    attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, page_table=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                              page_table=table)
    new_lens = [3, 9, 30]
    slots = [(int(table[b, (n - 1) // page_size]), (n - 1) % page_size) for b, n in enumerate(new_lens)]
    for b, (page, off) in enumerate(slots):
        kv[page, :, off] = float("nan")
        k_new[b, 0], v_new[b, 0] = ks[b][new_lens[b] - 1], vs[b][new_lens[b] - 1]
    seqlens.copy_(torch.tensor(new_lens, dtype=torch.int32) - 1)
    graph.replay()
    torch.cuda.synchronize()
    for b, (page, off) in enumerate(slots):
        assert torch.equal(kv[page, 0, off], k_new[b, 0]) and torch.equal(kv[page, 1, off], v_new[b, 0])
    ref = reference(q[:, 0].float().cpu(), torch.cat([kk[:n] for kk, n in zip(ks, new_lens)]).bfloat16().float(),
                    torch.cat([vv[:n] for vv, n in zip(vs, new_lens)]).bfloat16().float(), [1] * len(lens), new_lens,
                    d ** -0.5)
    assert (out[:, 0].float().cpu() - ref).abs().max().item() < 2e-2
