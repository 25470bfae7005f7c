"""ATTNSEL_CHECK_METADATA=1: plan metadata values are checked (one host copy per plan) and named when wrong.

The faults are real: without the check, Triton's kernels (interpreted on CPU) return NaN rows for a max_seqlen_q
shorter than a sequence and read memory past the caches for a page id past them, silently; the torch backend raises
torch's own IndexError. With it, a ValueError names the argument, the row and what is allowed, before any kernel.
"""
import pytest
import torch

import attnsel.metadata_values as mv
from attnsel import AttentionSpec, select
from attnsel.selection import PhaseChoice, Selection
from attnsel.validate.cases import cumulative

SPEC = AttentionSpec(4, 2, 64, "fp16")
F16 = dict(dtype=torch.float16)


def _sel(backend: str) -> Selection:
    phases = {p: PhaseChoice(backend, "explicit", []) for p in ("prefill", "decode")}
    return Selection(SPEC, phases, "measure", "eager", "off", {}, {})


def _prefill_tensors(lens):
    torch.manual_seed(0)
    n = sum(lens)
    return torch.randn(n, 4, 64, **F16), torch.randn(n, 2, 64, **F16), torch.randn(n, 2, 64, **F16)


def _ref_prefill(q, k, v, lens):
    """float32 causal GQA attention per sequence, written here (equal query and key lengths)."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(2, dim=1), vs.repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / 8.0
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        start += n
    return torch.cat(out)


def test_without_the_check_triton_gives_nan_for_a_short_max_seqlen_q_with_it_a_named_error(monkeypatch):
    lens = [5, 70]
    cu = cumulative(lens, "cpu")
    q, k, v = _prefill_tensors(lens)
    monkeypatch.delenv(mv.ENV, raising=False)
    run = _sel("triton").plan_prefill(cu, cu, 20, 70)
    # the output's memory as a GPU may hand it over: NaN, not whatever malloc returns (on the CPU that was often
    # finite, sometimes an earlier test's freed output: the assertion below was flaky, seen failing once in 2 runs)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, *a, **kw: empty_like(t, *a, **kw).fill_(float("nan"))
                        if t.is_floating_point() else empty_like(t, *a, **kw))
    silent = run(q, k, v)  # max_seqlen_q 20 < 70: rows never written
    monkeypatch.setattr(torch, "empty_like", empty_like)
    assert torch.isfinite(silent[:25]).all() and not torch.isfinite(silent[25:]).all()
    monkeypatch.setenv(mv.ENV, "1")
    with pytest.raises(ValueError, match=r"^sequence 1 has 70 tokens by cu_seqlens_q \(5 -> 75\), more than "
                                         r"max_seqlen_q=20; allowed: max_seqlen_q >= every sequence's length$"):
        _sel("triton").plan_prefill(cu, cu, 20, 70)
    out = _sel("triton").plan_prefill(cu, cu, 70, 70)(q, k, v)  # right values: planned and run as before
    assert (out.float() - _ref_prefill(q, k, v, lens)).abs().max().item() <= 2e-3


def _decode_tensors(pages=4):
    torch.manual_seed(1)
    return (torch.randn(2, 4, 64, **F16), torch.randn(pages, 16, 2, 64, **F16), torch.randn(pages, 16, 2, 64, **F16))


def _ref_decode(q, kc, vc, pages, n):
    """float32 attention of one decode row [4, 64] over the first n tokens of the given pages, written here."""
    k = kc[pages].reshape(-1, 2, 64)[:n].float().repeat_interleave(2, dim=1)
    v = vc[pages].reshape(-1, 2, 64)[:n].float().repeat_interleave(2, dim=1)
    return torch.einsum("hk,khd->hd", (torch.einsum("hd,khd->hk", q.float(), k) / 8.0).softmax(-1), v)


def test_a_page_id_past_the_cache_is_named_at_run_where_triton_read_past_it_silently(monkeypatch):
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)  # row 1 reads page 9 of a 4-page cache
    lens = torch.tensor([20, 30], dtype=torch.int32)
    q, k_mem, v_mem = _decode_tensors(pages=10)
    kc, vc = k_mem[:4], v_mem[:4]  # the caches: 4 pages of a larger allocation (memory past them is defined)
    monkeypatch.delenv(mv.ENV, raising=False)
    silent = _sel("triton").plan_decode(table, lens)(q, kc, vc)
    # no error: row 1 attended over page 9 of the memory past the cache
    assert (silent[1].float() - _ref_decode(q[1], k_mem, v_mem, [2, 9], 30)).abs().max().item() <= 2e-3
    with pytest.raises(IndexError):  # the torch backend: torch's own words
        _sel("torch").plan_decode(table, lens)(q, kc, vc)
    monkeypatch.setenv(mv.ENV, "1")
    for backend in ("triton", "torch"):
        run = _sel(backend).plan_decode(table, lens)
        with pytest.raises(ValueError, match=r"^page_table reads page 9 but k_cache/v_cache hold 4 pages; allowed: "
                                             r"page ids < k_cache.shape\[0\] \(\$ATTNSEL_CHECK_METADATA found this\)$"):
            run(q, kc, vc)
        out = run(q, k_mem, v_mem)  # caches that hold page 9
        assert (out[0].float() - _ref_decode(q[0], k_mem, v_mem, [0, 1], 20)).abs().max().item() <= 2e-3


@pytest.mark.parametrize("cu_q, cu_k, max_q, max_k, totals, message", [
    ([1, 5, 8], [0, 5, 8], 5, 5, {}, r"^cu_seqlens_q\[0\] is 1; allowed: 0 "),
    ([0, 5, 3], [0, 5, 8], 5, 5, {}, r"^cu_seqlens_q decreases at sequence 1 \(5 -> 3\); allowed: non-decreasing"),
    ([0, 5, 8], [0, 5, 8], 5, 4, {}, r"^sequence 0 has 5 tokens by cu_seqlens_k \(0 -> 5\), more than max_seqlen_k=4"),
    ([0, 5, 9], [0, 5, 8], 5, 5, {"total_q": 8}, r"^cu_seqlens_q\[-1\] is 9, past q's 8 tokens \(total_q\); allowed"),
    ([0, 5, 8], [0, 5, 9], 5, 5, {"total_k": 8}, r"^cu_seqlens_k\[-1\] is 9, past k's 8 tokens \(total_k\); allowed"),
], ids=["q-not-from-0", "q-decreasing", "k-longer-than-max", "total-q", "total-k"])
def test_every_wrong_prefill_value_is_named(monkeypatch, cu_q, cu_k, max_q, max_k, totals, message):
    monkeypatch.setenv(mv.ENV, "1")
    with pytest.raises(ValueError, match=message):
        _sel("torch").plan_prefill(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                   max_q, max_k, totals.get("total_q"), total_k=totals.get("total_k"))


def test_a_checked_prefill_plan_holds_q_and_k_to_the_offsets_token_counts(monkeypatch):
    """Without total_q/total_k the run cannot compare q's tokens with the offsets; a checked plan read them: fewer
    rows than the offsets cover are refused, more are padding, as without the check (the unchecked plan serves
    padded q, so the checked one does too)."""
    monkeypatch.setenv(mv.ENV, "1")
    cu = cumulative([5, 7], "cpu")
    run = _sel("torch").plan_prefill(cu, cu, 7, 7)
    q, k, v = _prefill_tensors([5, 7, 1])
    with pytest.raises(ValueError, match=r"^q has 11 tokens but cu_seqlens_q\[-1\] is 12 \(\$ATTNSEL_CHECK_METADATA "
                                         r"found this\); allowed: at least cu_seqlens_q\[-1\] rows"):
        run(q[:11], k, v)
    with pytest.raises(ValueError, match=r"^k has 10 tokens but cu_seqlens_k\[-1\] is 12 "):
        run(q, k[:10], v[:10])
    out = run(q, k, v)  # one padding row in q, k and v
    assert (out[:12].float() - _ref_prefill(q[:12], k[:12], v[:12], [5, 7])).abs().max().item() <= 2e-3


@pytest.mark.parametrize("table, lens, max_len, message", [
    ([[0, 1], [2, 3]], [20, -1], None, r"^seq_lens\[1\] is -1; allowed: 0 \(a padding row\) or more$"),
    ([[0, 1], [2, 3]], [20, 33], None, r"^seq_lens\[1\] is 33, more than page_table's 2 pages x page size 16 = 32 "),
    ([[0, 1], [2, 3]], [20, 30], 25, r"^seq_lens\[1\] is 30, more than max_seq_len=25; allowed: max_seq_len >= "),
    ([[0, -1], [2, 3]], [20, 30], None, r"^page_table\[0, 1\] is -1 \(read by seq_lens\[0\]=20\); allowed: page ids"),
], ids=["negative-length", "past-the-table", "past-max-seq-len", "negative-page"])
def test_every_wrong_decode_value_is_named(monkeypatch, table, lens, max_len, message):
    monkeypatch.setenv(mv.ENV, "1")
    with pytest.raises(ValueError, match=message):
        _sel("torch").plan_decode(torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                  max_len)


def test_unread_columns_and_padding_rows_pass(monkeypatch):
    """What engines really send: -1 sentinels past a row's pages, padding rows of length 0 (CUDA-graph batches),
    a page table wider than needed; the output matches the unchecked plan's."""
    monkeypatch.setenv(mv.ENV, "1")
    table = torch.tensor([[3, -1, -1], [-1, -1, -1], [0, 1, 99]], dtype=torch.int32)
    lens = torch.tensor([16, 0, 17], dtype=torch.int32)
    q, kc, vc = torch.randn(3, 4, 64, **F16), torch.randn(4, 16, 2, 64, **F16), torch.randn(4, 16, 2, 64, **F16)
    checked = _sel("torch").plan_decode(table, lens, 17)(q, kc, vc)
    monkeypatch.delenv(mv.ENV)
    assert torch.equal(checked, _sel("torch").plan_decode(table, lens, 17)(q, kc, vc))


def test_off_by_default_no_host_copy(monkeypatch):
    """The default trusts values: no plan reads a tensor's values (an engine's step loop must not sync)."""
    monkeypatch.delenv(mv.ENV, raising=False)
    monkeypatch.setattr(mv, "check_prefill", lambda *a: pytest.fail("values read with the check off"))
    monkeypatch.setattr(mv, "check_decode", lambda *a: pytest.fail("values read with the check off"))
    _sel("triton").plan_decode(torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 64, dtype=torch.int32), 64)
    cu = cumulative([5, 7], "cpu")
    _sel("torch").plan_prefill(cu, cu, 7, 7, 12)


@pytest.mark.parametrize("value, on", [("1", True), ("on", True), ("0", False), ("", False), ("off", False)])
def test_the_variable_reads_yes_and_no(monkeypatch, value, on):
    monkeypatch.setenv(mv.ENV, value)
    assert mv.enabled() is on


def test_a_bad_value_of_the_variable_is_refused_by_select(monkeypatch):
    monkeypatch.setenv(mv.ENV, "maybe")
    with pytest.raises(ValueError, match=r"^ATTNSEL_CHECK_METADATA='maybe': expected 1/true/yes/on "):
        select(SPEC, prefill="torch", decode="torch", use_cache=False)


def test_the_fa_compatible_calls_check_values_too(monkeypatch):
    """flash_attn_varlen_func / flash_attn_with_kvcache plan through Selection: the same named errors."""
    import attnsel

    monkeypatch.setenv(mv.ENV, "1")
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    q, k, v = _prefill_tensors([5, 7])
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    # flash_attn_varlen_func reads its offsets with or without the variable (flash_checks.varlen_offsets)
    with pytest.raises(ValueError, match=r"^attnsel.flash_attn_varlen_func: max_seqlen_q=6 but sequence 1 has 7 "
                                         r"tokens by cu_seqlens_q"):
        attnsel.flash_attn_varlen_func(q, k, v, cu, cu, 6, 7, causal=True)
    qd, kc, vc = _decode_tensors(pages=4)
    table = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^page_table reads page 7 but k_cache/v_cache hold 4 pages"):
        attnsel.flash_attn_with_kvcache(qd[:, None], kc, vc, cache_seqlens=lens, page_table=table, causal=True)


def test_new_kv_past_the_cache_is_refused_before_it_is_written(monkeypatch):
    """flash_attn_with_kvcache checks the pages before writing the new token (index_copy_ into page 9 of a 4-page
    cache would raise IndexError on CPU, a device-side fault on CUDA)."""
    import attnsel

    monkeypatch.setenv(mv.ENV, "1")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    qd, kc, vc = _decode_tensors(pages=4)
    before = kc.clone()
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    new = torch.randn(2, 1, 2, 64, **F16)
    with pytest.raises(ValueError, match=r"^page_table reads page 9 but k_cache/v_cache hold 4 pages"):
        attnsel.flash_attn_with_kvcache(qd[:, None], kc, vc, k=new, v=new, cache_seqlens=torch.tensor(
            [20, 20], dtype=torch.int32), page_table=table, causal=True)
    assert torch.equal(kc, before)


def test_pages_before_a_sliding_window_may_be_freed(monkeypatch):
    """Engines free the pages a window has left (-1); no kernel reads them, so the check allows them. Output equals the
    unchecked plan's over the full table."""
    spec = AttentionSpec(4, 2, 64, "fp16", sliding_window=8)
    phases = {p: PhaseChoice("torch", "explicit", []) for p in ("prefill", "decode")}
    sel = Selection(spec, phases, "measure", "eager", "off", {}, {})
    q, kc, vc = _decode_tensors(pages=4)
    lens = torch.tensor([40, 20], dtype=torch.int32)  # row 0 reads tokens 32..39: page 2 only
    full = torch.tensor([[0, 1, 2], [3, 1, 0]], dtype=torch.int32)
    freed = torch.tensor([[-1, -1, 2], [3, 1, -1]], dtype=torch.int32)  # row 1 (tokens 12..19) reads pages 0, 1
    monkeypatch.setenv(mv.ENV, "1")
    assert torch.equal(sel.plan_decode(freed, lens)(q, kc, vc), sel.plan_decode(full, lens)(q, kc, vc))
    with pytest.raises(ValueError, match=r"^page_table\[0, 2\] is -1 \(read by seq_lens\[0\]=40\)"):
        sel.plan_decode(torch.tensor([[0, 1, -1], [3, 1, 0]], dtype=torch.int32), lens)


def test_q_and_k_longer_than_the_offsets_are_padding_as_in_flash_attention(monkeypatch):
    """FA callers pass q with padding tokens past cu_seqlens_q[-1]; the check takes them as padding."""
    import attnsel

    monkeypatch.setenv(mv.ENV, "1")
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    q, k, v = _prefill_tensors([5, 7, 4])  # 16 tokens, the offsets cover 12
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    assert (out[:12].float() - _ref_prefill(q[:12], k[:12], v[:12], [5, 7])).abs().max().item() <= 2e-3


def test_meta_tensors_are_not_read(monkeypatch):
    monkeypatch.setenv(mv.ENV, "1")
    meta = dict(device="meta", dtype=torch.int32)
    assert mv.check_decode(torch.empty(2, 4, **meta), torch.empty(2, **meta), None, 16) is None
    assert mv.check_prefill(torch.empty(3, **meta), torch.empty(3, **meta), 4, 4, None, None) is None
