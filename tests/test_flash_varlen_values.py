"""flash_attn_varlen_func (packed k/v, no page table) reads its offsets once per plan, as flash_attn_with_kvcache
reads its lengths: offsets past q's or k's rows, offsets that run backwards and a sequence longer than max_seqlen_q /
max_seqlen_k are a ValueError naming the argument, not a kernel writing past out (the Triton kernel's grid covers
max_seqlen_q rows per sequence: a longer sequence kept torch.empty's garbage in its last rows; offsets past q made it
write past out's memory) or the torch backend attending over a truncated slice."""
import pytest
import torch

import attnsel
from attnsel import flash_api
from attnsel.validate.yardstick import reference_attention

pytestmark = pytest.mark.usefixtures("inproc_worker")
HQ, HK, D = 4, 2, 16


@pytest.fixture(autouse=True)
def _fresh(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "varlen_values_cache"))
    yield
    flash_api.configure()


def packed(lens, dtype, rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(lens) if rows is None else rows
    q, k, v = (torch.randn(rows, h, D, generator=g).to(dtype) for h in (HQ, HK, HK))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def test_a_sequence_longer_than_max_seqlen_q_is_refused_not_left_unwritten():
    """Triton's grid covers max_seqlen_q rows of each sequence: the 200-token sequence's rows past the first tile
    were never written (torch.empty). The reference check shows the call with the true bound is right."""
    flash_api.configure(prefill="triton", decode="triton", policy="priority")
    q, k, v, cu = packed([3, 200], torch.float16)
    with pytest.raises(ValueError, match=r"max_seqlen_q=4.*sequence 1 has 200"):
        attnsel.flash_attn_varlen_func(q, k, v, cu, cu, 4, 200, causal=True)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True).float()
    for s, e in ((0, 3), (3, 203)):
        ref = reference_attention(q[s:e].float(), k[s:e].float(), v[s:e].float(), D ** -0.5, True)
        assert (out[s:e] - ref).abs().max().item() < 3e-3


@pytest.mark.parametrize("case,message", [
    ("q rows", r"cu_seqlens_q\[-1\] is 12 but q holds 10 rows"),
    ("k rows", r"cu_seqlens_k\[-1\] is 12 but k and v hold 10 rows"),
    ("backwards", r"cu_seqlens_q runs backwards: sequence 0 has -2 tokens"),
    ("negative start", r"cu_seqlens_k\[0\] is -1"),
    ("max_seqlen_k", r"max_seqlen_k=5.*sequence 1 has 9"),
])
def test_offsets_that_do_not_fit_the_tensors_or_bounds_are_named(case, message):
    """The torch backend (the one that runs whatever the offsets say on the host) attended over slices cut short by
    q's end and returned without a word; the Triton kernel wrote past out (heap corruption on the CPU)."""
    flash_api.configure(prefill="torch", decode="torch", policy="priority")
    q, k, v, cu = packed([3, 9], torch.float32, rows=10)
    cu_q, cu_k, max_k = cu, cu.clone(), 9
    if case == "k rows":
        q, cu_q = torch.cat([q, q[:2]]), cu.clone()  # q holds its 12 rows, k only 10
    elif case == "backwards":
        cu_q, cu_k = torch.tensor([0, -2, 8], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32)
    elif case == "negative start":
        cu_q, cu_k = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([-1, 2, 4], dtype=torch.int32)
    elif case == "max_seqlen_k":
        q, k, v, cu = packed([3, 9], torch.float32)
        cu_q, cu_k, max_k = cu, cu.clone(), 5
    with pytest.raises(ValueError, match=message):
        attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, max_k, causal=True)


def test_an_empty_batch_and_padding_rows_past_the_offsets_still_run():
    """What the read allows: no sequences (cu_seqlens [0]), and q/k rows past the last offset (padding)."""
    flash_api.configure(prefill="torch", decode="torch", policy="priority")
    q, k, v, cu = packed([3, 5], torch.float32, rows=11)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    ref = reference_attention(q[3:8], k[3:8], v[3:8], D ** -0.5, True)
    assert (out[3:8] - ref).abs().max().item() < 1e-5
    empty = torch.zeros(1, dtype=torch.int32)
    assert attnsel.flash_attn_varlen_func(q[:0], k[:0], v[:0], empty, empty, 0, 0, causal=True).shape == (0, HQ, D)
