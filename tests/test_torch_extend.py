"""The torch backend's extend phase (ragged queries over the paged cache) against an independent float32 reference,
row by row (tests/fixtures/extend_cases.py): page sizes, prefixes, shuffled pages, NaN/inf in unused slots, sentinels in
unused page-table columns, MTP rows, ragged rows with 0 queries or 0 keys, every feature, GQA; decode as the
one-query case; the errors a caller sees."""
import pytest
import torch

from attnsel.backends import graph_stale_reason
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.spec import AttentionSpec
from tests.fixtures.extend_cases import make_batch, row_failures

ATOL = {"fp32": 2e-5}  # torch in float32 against the float32 reference; other dtypes: the per-token tolerance


def _check(spec, rows, *, seed=0, sentinel="-1", atol=None):
    batch = make_batch(spec, rows, seed=seed, sentinel=sentinel)
    run = TORCH.plan_extend(spec, *batch.plan_args())
    q_before = batch.q.clone()
    out = run(batch.q, batch.k_cache, batch.v_cache, **batch.run_kwargs())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert torch.equal(batch.q.isnan(), q_before.isnan()) and torch.equal(batch.q.nan_to_num(), q_before.nan_to_num())
    assert torch.isfinite(out[:batch.total_q]).all()
    failures = row_failures(batch, out, atol=ATOL.get(spec.dtype) if atol is None else atol)
    assert not failures, "\n".join(failures)
    return batch, out


# (q_len, seq_len) rows per page size: fresh prompts, a few-token prefix, a ~1000-token prefix, prefixes ending
# mid-page, a row without queries, padding rows (seq_len 0, with and without queries), one-token rows
def _rows(ps: int) -> list[tuple[int, int]]:
    return [(7, 7), (3, 6), (9, 1009), (4, ps + 5 + 4), (0, 13), (0, 0), (2, 0), (1, 1), (5, 2 * ps + 5)]


@pytest.mark.parametrize("sentinel", ["-1", "num_pages"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prefixes_and_traps_at_page_sizes(page_size, sentinel):
    _check(AttentionSpec(4, 2, 32, "fp32", page_size=page_size), _rows(page_size), sentinel=sentinel)


FEATURES = {
    "window3": {"sliding_window": 3},
    "window40": {"sliding_window": 40},
    "window1": {"sliding_window": 1},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": True},
    "fp8": {"kv_dtype": "fp8_e4m3"},
    "gpt-oss": {"sliding_window": 7, "sinks": True},
    "gemma2": {"sliding_window": 9, "softcap": 20.0},
    "all": {"sliding_window": 5, "softcap": 20.0, "sinks": True, "kv_dtype": "fp8_e4m3"},
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, page_size):
    rows = [(6, 6), (5, 47), (0, 9), (3, 0), (12, 300), (2, 2 * page_size + 1)]
    _check(AttentionSpec(8, 2, 32, "fp32", page_size=page_size, **FEATURES[feature]), rows, seed=1)


@pytest.mark.parametrize("queries", [2, 3, 4])
def test_mtp_rows(queries):
    """Multi-token decode / speculative verify: every row the same few queries over long, different contexts."""
    rows = [(queries, n) for n in (17, 64, 200, 333, queries)]
    _check(AttentionSpec(8, 1, 32, "fp32", page_size=16, sliding_window=50, sinks=True), rows, seed=queries)


@pytest.mark.parametrize("shape", [(8, 2, 64), (8, 1, 32), (4, 4, 32)], ids=["gqa4", "mqa", "mha"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_activation_dtypes_within_the_per_token_tolerance(shape, dtype):
    spec = AttentionSpec(*shape, dtype, page_size=16, softcap=30.0, kv_dtype="fp8_e4m3")
    _check(spec, [(5, 40), (0, 3), (16, 16), (2, 130)], seed=3)
    _check(AttentionSpec(*shape, dtype, page_size=16), [(5, 40), (0, 3), (16, 16), (2, 130)], seed=4)


def test_non_causal_spec_sees_every_key_of_its_row():
    _check(AttentionSpec(4, 2, 32, "fp32", page_size=4, causal=False), [(3, 10), (5, 5), (0, 2)])


def test_decode_is_extend_with_one_query_per_row():
    spec = AttentionSpec(8, 2, 32, "fp32", page_size=16, sliding_window=20, sinks=True, kv_dtype="fp8_e4m3")
    batch = make_batch(spec, [(1, n) for n in (1, 15, 16, 17, 100, 0)], seed=5)
    extend = TORCH.plan_extend(spec, *batch.plan_args())(batch.q, batch.k_cache, batch.v_cache,
                                                          **batch.run_kwargs())
    decode = TORCH.plan_decode(spec, batch.page_table, batch.seq_lens)(
        batch.q[:batch.total_q], batch.k_cache, batch.v_cache, **batch.run_kwargs())
    assert torch.allclose(extend[:batch.total_q], decode, atol=1e-6, rtol=0)
    assert not row_failures(batch, extend, atol=2e-5)


def test_lightllm_token_level_table_and_strided_caches():
    """LightLLM's call: the caches viewed as [tokens, 1, kvh, d] with a table of token slots; and caches that are
    strided views of one [pages, 2, page, kvh, d] tensor (gathered by page and offset, never copied whole)."""
    spec16 = AttentionSpec(4, 2, 32, "fp32", page_size=16)
    batch = make_batch(spec16, [(4, 40), (3, 3), (0, 7), (2, 21)], seed=6)
    out16 = TORCH.plan_extend(spec16, *batch.plan_args())(batch.q, batch.k_cache, batch.v_cache)
    spec1 = AttentionSpec(4, 2, 32, "fp32", page_size=1)
    pages = batch.page_table.long().clamp(min=0)
    token_table = (pages[:, :, None] * 16 + torch.arange(16)).flatten(1).int()  # token slots of each row's pages
    kvh, d = spec1.num_kv_heads, spec1.head_dim
    k1, v1 = batch.k_cache.view(-1, 1, kvh, d), batch.v_cache.view(-1, 1, kvh, d)
    out1 = TORCH.plan_extend(spec1, batch.cu_seqlens_q, token_table, batch.seq_lens, batch.max_seqlen_q,
                             batch.max_seq_len)(batch.q, k1, v1)
    total = batch.total_q
    assert torch.allclose(out1[:total], out16[:total], atol=1e-6, rtol=0)
    assert not row_failures(batch, out16, atol=2e-5)
    both = torch.stack((batch.k_cache, batch.v_cache), 1)  # [pages, 2, ps, kvh, d]
    strided = TORCH.plan_extend(spec16, *batch.plan_args())(batch.q, both[:, 0], both[:, 1])
    assert torch.equal(strided[:total], out16[:total])


def test_unsupported_and_graph_stale():
    spec = AttentionSpec(4, 2, 64, "bf16", sliding_window=8, softcap=30.0, sinks=True, kv_dtype="fp8_e4m3")
    assert TORCH.unsupported(spec, "extend") is None
    assert "extend plan splits the batch into rows on the host" in graph_stale_reason(TORCH, "extend")
    assert graph_stale_reason(TORCH, "decode") is None


def test_bad_metadata_is_named():
    spec = AttentionSpec(4, 2, 32, "fp32", page_size=4)
    batch = make_batch(spec, [(2, 9), (3, 5)])
    cu, table, lens = batch.cu_seqlens_q, batch.page_table, batch.seq_lens
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have batch \+ 1 = 3 entries \(seq_lens has 2\)"):
        TORCH.plan_extend(spec, cu[:2], table, lens, 3, 9)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing \(row 1: 2 then 1\)"):
        TORCH.plan_extend(spec, torch.tensor([0, 2, 1], dtype=torch.int32), table, lens, 3, 9)
    with pytest.raises(ValueError, match="row 1 has 3 queries, more than max_seqlen_q=2"):
        TORCH.plan_extend(spec, cu, table, lens, 2, 9)
    with pytest.raises(ValueError, match="row 0 has seq_len 9, more than max_seq_len=8"):
        TORCH.plan_extend(spec, cu, table, lens, 3, 8)
    with pytest.raises(ValueError, match=r"seq_lens must be >= 0 .* got -1 in row 1"):
        TORCH.plan_extend(spec, cu, table, torch.tensor([9, -1], dtype=torch.int32), 3, 9)
    with pytest.raises(ValueError, match="page_table has 2 pages per sequence, too few for 9 tokens at page_size 4"):
        TORCH.plan_extend(spec, cu, table[:, :2], lens, 3, 9)
    with pytest.raises(ValueError, match=r"page_table must be \[batch=2, max_pages\], got \(1, 5\)"):
        TORCH.plan_extend(spec, cu, table[:1], lens, 3, 9)
    run = TORCH.plan_extend(spec, *batch.plan_args())
    with pytest.raises(ValueError, match="k_scale/v_scale were passed but the spec has no fp8 KV cache"):
        run(batch.q, batch.k_cache, batch.v_cache, k_scale=torch.ones(1), v_scale=torch.ones(1))
    with pytest.raises(ValueError, match="sinks were passed but the spec has sinks=False"):
        run(batch.q, batch.k_cache, batch.v_cache, sinks=torch.zeros(4))
