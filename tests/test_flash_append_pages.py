"""New tokens (flash_attn_with_kvcache's k/v) whose slot the page table points outside the cache: a padding row
with a sentinel page id (-1, or num_pages), decode and multi-token forms, contiguous and strided caches. The write
must be refused before anything is written (a -1 indexed into a strided cache wrapped to the last page and
overwrote another sequence's cached token, silently; a contiguous one raised a bare IndexError, a device assert on a
GPU). Outputs of good calls are judged against a float64 reference written here."""
import pytest
import torch

import attnsel
from attnsel import flash_api

pytestmark = pytest.mark.usefixtures("inproc_worker")
HQ, HK, D, PS = 4, 2, 16, 4


@pytest.fixture(autouse=True)
def _torch_everywhere():
    flash_api.configure(prefill="torch", decode="torch", extend="torch", policy="priority")
    yield
    flash_api.configure()


def _reference(q, k, v):
    """float64 attention of q [lq, HQ, D], its row's last tokens, over k/v [n, HK, D], bottom-right causal."""
    lq, n = q.shape[0], k.shape[0]
    k, v = k.double().repeat_interleave(HQ // HK, 1), v.double().repeat_interleave(HQ // HK, 1)
    s = torch.einsum("qhd,nhd->hqn", q.double(), k) * D ** -0.5
    s = s.masked_fill(torch.arange(n)[None] > torch.arange(n - lq, n)[:, None], float("-inf"))
    return torch.einsum("hqn,nhd->qhd", s.softmax(-1), v)


def _caches(layout):
    """Three pages; sequence 0 holds 3 tokens in page 2, the last one (where index -1 lands)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 2, PS, HK, D, generator=g)
    if layout == "strided":  # one [pages, 2, page_size, kvh, d] tensor: k and v are strided views
        return kv[:, 0], kv[:, 1]
    return kv[:, 0].contiguous(), kv[:, 1].contiguous()


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("sentinel", [-1, 3])
@pytest.mark.parametrize("new", [1, 2])
def test_a_new_token_with_no_page_is_refused_before_the_write(layout, sentinel, new):
    k_cache, v_cache = _caches(layout)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    table = torch.tensor([[2], [sentinel]], dtype=torch.int32)  # row 1: a padding row without a page
    lens = torch.tensor([0, 0], dtype=torch.int32) if new == 2 else torch.tensor([1, 0], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, new, HQ, D, generator=g)
    k, v = torch.randn(2, new, HK, D, generator=g), torch.randn(2, new, HK, D, generator=g)
    with pytest.raises(ValueError, match=rf"page_table.*page {sentinel}.*sequence 1.*allowed"):
        attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, page_table=table,
                                         causal=True)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("new", [1, 2])
def test_new_tokens_with_pages_are_written_and_attended(layout, new):
    """The same calls with a real page for the padding row: right answers, the check costs nothing else."""
    k_cache, v_cache = _caches(layout)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    cached = 3 - new + 1 if new == 1 else 1
    lens = torch.tensor([cached, 0], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, new, HQ, D, generator=g)
    k, v = torch.randn(2, new, HK, D, generator=g), torch.randn(2, new, HK, D, generator=g)
    keys0 = torch.cat([k_cache[2, :cached].clone(), k[0]]), torch.cat([v_cache[2, :cached].clone(), v[0]])
    out = attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, page_table=table,
                                           causal=True)
    assert (out[0].double() - _reference(q[0], *keys0)).abs().max() < 1e-5
    assert (out[1].double() - _reference(q[1], k[1], v[1])).abs().max() < 1e-5
    assert torch.equal(k_cache[0, :new], k[1]) and torch.equal(v_cache[0, :new], v[1])


@pytest.mark.parametrize("new", [1, 2])
def test_new_tokens_and_a_page_table_without_columns_are_named(new):
    """The page extremes are planned before the one host read: a table of no columns must still give a ValueError
    naming it, not an index error from planning the slots."""
    k_cache, v_cache = _caches("contiguous")
    q, k, v = torch.randn(2, new, HQ, D), torch.randn(2, new, HK, D), torch.randn(2, new, HK, D)
    with pytest.raises(ValueError, match=r"page_table \(2, 0\).*allowed"):
        attnsel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.zeros(2, dtype=torch.int32),
                                         page_table=torch.zeros(2, 0, dtype=torch.int32), causal=True)
