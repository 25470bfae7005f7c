"""The extend phase of FA3 and FlashInfer, checked on the CPU: what they declare (libraries faked as installed), and
the host/device helpers of their plans that need no GPU: FA3's token rows and per-row fp8 query scales (against the
float32 reference through an emulation of FA3's fp8 products), FlashInfer's CSR layout with rows without keys."""
import pytest
import torch

from attnsel.backends import get, graph_stale_reason
from attnsel.backends.fa3 import FP8_MAX, quantize_q_rows, token_rows
from attnsel.backends.flashinfer import _extend_layout
from attnsel.priority import DEFAULT_PRIORITY
from attnsel.spec import AttentionSpec
from attnsel.validate import yardstick
from tests.fixtures.extend_cases import make_batch, reference
from tests.test_backend_support import FA3_FLAGS, hopper_with_libraries  # noqa: F401  (a fixture)


def _reason(name, **fields):
    return get(name).unsupported(AttentionSpec(32, 8, 128, **fields), "extend")


@pytest.mark.parametrize("name", ["fa3", "fa3_packgqa", "fa3_split", "flashinfer", "flashinfer_fa2"])
def test_extend_variants_serve_window_and_fp8(name, hopper_with_libraries):
    assert _reason(name) is None
    assert _reason(name, sliding_window=64) is None
    if name != "flashinfer_fa2":  # with an fp8 cache flashinfer runs the FA2 template itself
        assert _reason(name, sliding_window=64, kv_dtype="fp8_e4m3") is None
    for page_size in (1, 16, 64, 256):
        assert get(name).unsupported(AttentionSpec(32, 8, 128, page_size=page_size), "extend") is None


def test_extend_limits_are_named(hopper_with_libraries, monkeypatch):
    assert "logit softcap (30): not supported in extend" in _reason("fa3", softcap=30.0)
    assert "FLASHATTENTION_DISABLE_SOFTCAP" in _reason("fa3", softcap=30.0)
    assert _reason("fa3", sinks=True) is None and _reason("flashinfer", sinks=True) is None
    assert "does not dequantise" in _reason("flashinfer", sinks=True, kv_dtype="fp8_e4m3")
    assert "no softcap" in _reason("flashinfer", sinks=True, softcap=30.0)
    assert "trtllm-gen" in _reason("flashinfer_fa2", sinks=True)
    for name in ("flashinfer_cuda_cores", "flashinfer_fa3"):
        assert _reason(name).startswith("this variant differs from flashinfer only in decode")
    assert "is the kernel flashinfer runs" in _reason("flashinfer_fa2", kv_dtype="fp8_e4m3")
    monkeypatch.setitem(FA3_FLAGS, "FLASHATTENTION_DISABLE_PAGEDKV", True)
    assert "compiled with FLASHATTENTION_DISABLE_PAGEDKV: extend needs it" in _reason("fa3")
    assert "PAGEDKV" not in (get("fa3").unsupported(AttentionSpec(32, 8, 128), "prefill") or "")


def test_fa2_extend_with_an_fp8_cache_says_it_is_what_flashinfer_runs(hopper_with_libraries):
    """flashinfer_fa2 is a default extend candidate, but with an fp8 KV cache FlashInfer's own template choice (the
    flashinfer candidate) is its FA2 template already: the variant would time the same kernel twice."""
    assert "flashinfer_fa2" in DEFAULT_PRIORITY["extend"]
    fp8 = AttentionSpec(32, 8, 128, kv_dtype="fp8_e4m3")
    assert get("flashinfer").unsupported(fp8, "extend") is None
    why = get("flashinfer_fa2").unsupported(fp8, "extend")
    assert why is not None and "is the kernel flashinfer runs" in why
    # without fp8, and in prefill (which takes k/v in spec.dtype), the variant is a candidate of its own
    assert get("flashinfer_fa2").unsupported(AttentionSpec(32, 8, 128), "extend") is None
    assert get("flashinfer_fa2").unsupported(fp8, "prefill") is None


def test_graph_contract_declarations():
    for name in ("flashinfer", "flashinfer_fa2"):
        assert "its plan copies the lengths" in graph_stale_reason(get(name), "extend")
    for name in ("fa3", "fa3_packgqa", "fa3_split"):  # FA3's runs read the metadata at replay (live_int32)
        assert graph_stale_reason(get(name), "extend") is None


def test_token_rows_skip_empty_rows_and_mark_padding():
    cu = torch.tensor([0, 2, 2, 5, 5, 6], dtype=torch.int32)
    assert token_rows(cu, 9).tolist() == [0, 0, 2, 2, 2, 4, 5, 5, 5]


def test_fp8_query_scale_per_row_and_kv_head_group():
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    q = torch.randn(9, 8, 16, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    q[4, 5] *= 50  # one large value: row 2, KV head 2 (heads 4-5)
    q[7:] = float("nan")  # padding past the last query
    rows = token_rows(cu, q.shape[0])
    q8, descale = quantize_q_rows(q, rows, 3, 4)
    assert q8.dtype == torch.float8_e4m3fn and descale.shape == (3, 4)
    grouped = q.float().view(9, 4, 2, 16)
    for b, (s, e) in enumerate([(0, 3), (3, 3), (3, 7)]):
        for g in range(4):
            amax = grouped[s:e, g].abs().amax() if e > s else torch.tensor(0.0)
            assert torch.allclose(descale[b, g], (amax / FP8_MAX).clamp_min(1e-12)), (b, g)
    assert torch.isfinite(descale).all()  # NaN padding reaches no row's scale
    back = q8[:7].float().view(7, 4, 2, 16) * descale[rows[:7]][:, :, None, None]
    assert torch.allclose(back.view(7, 8, 16), q[:7].float(), rtol=2 ** -3, atol=descale.max() * 2 ** -9)


def _fa3_fp8_emulation(spec, batch):
    """FA3's fp8 extend on the CPU: q quantised per row and KV head (quantize_q_rows), k/v the stored e4m3 values,
    scores in float32 times the descales, P rounded to e4m3 before P @ V."""
    rows = token_rows(batch.cu_seqlens_q, batch.q.shape[0])
    q8, descale = quantize_q_rows(batch.q, rows, len(batch.rows), spec.num_kv_heads)
    group = spec.group_size
    out = torch.zeros(batch.q.shape, dtype=torch.float32)
    for b, (lq, n) in enumerate(batch.rows):
        if lq == 0 or n == 0:
            continue
        qs = int(batch.cu_seqlens_q[b])
        qd = (q8[qs:qs + lq].float().view(lq, spec.num_kv_heads, group, -1) * descale[b][None, :, None, None])
        k, v = batch.keys[b], batch.values[b]  # the stored e4m3 values times their scales
        scores = torch.einsum("qhd,khd->hqk", qd.view(lq, spec.num_q_heads, -1),
                              k.repeat_interleave(group, 1)) * spec.scale
        pos = torch.arange(n - lq, n)[:, None]
        keep = torch.arange(n)[None, :] <= pos
        if spec.sliding_window is not None:
            keep &= torch.arange(n)[None, :] > pos - spec.sliding_window
        scores = scores.masked_fill(~keep, float("-inf"))
        w = torch.exp(scores - scores.amax(-1, keepdim=True))
        p = w.to(torch.float8_e4m3fn).float() / w.sum(-1, keepdim=True)
        out[qs:qs + lq] = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(group, 1))
    return out.to(spec.torch_dtype)


@pytest.mark.parametrize("outlier", [1.0, 100.0])
@pytest.mark.parametrize("window", [None, 24])
def test_fp8_queries_per_row_stay_within_the_per_token_tolerance(window, outlier):
    """Per-row query scales (FA3 takes no per-token q_descale) against the yardstick that quantises per token: the
    emulated FA3 output is within the validation's tolerance on every row, long MTP rows and prompts included, also
    with one query token 100x larger than the rest of its row (e4m3 is a float format: the row's other tokens keep
    their relative precision, only their smallest elements go subnormal)."""
    spec = AttentionSpec(8, 2, 64, "bf16", page_size=16, kv_dtype="fp8_e4m3", sliding_window=window)
    batch = make_batch(spec, [(2, 700), (64, 64), (0, 5), (17, 300), (4, 4)], seed=1)
    batch.q[2 + 5] *= outlier  # a token of the prompt row
    out = _fa3_fp8_emulation(spec, batch)
    for b, (lq, n) in enumerate(batch.rows):
        if lq == 0:
            continue
        qs = int(batch.cu_seqlens_q[b])
        ref = reference(batch, b)
        careful = yardstick.careful_attention(batch.q[qs:qs + lq], batch.keys[b], batch.values[b], spec.scale, True,
                                              window=window, dtype=spec.torch_dtype, fp8=True)
        tol = yardstick.row_tolerance(spec, yardstick.row_errors(careful, ref))
        err = yardstick.row_errors(out[qs:qs + lq], ref)
        assert bool((err <= tol).all()), (b, float((err / tol).max()))


def test_flashinfer_layout_reads_only_each_rows_pages_and_names_blind_queries():
    spec = AttentionSpec(4, 2, 32, "bf16", page_size=4)
    batch = make_batch(spec, [(3, 9), (2, 0), (0, 0), (1, 4), (0, 6)], sentinel="num_pages")
    indptr, indices, last, blind = _extend_layout(batch.cu_seqlens_q, batch.page_table, batch.seq_lens, 4)
    table = batch.page_table
    assert indptr.tolist() == [0, 3, 4, 5, 6, 8]
    assert indices.tolist() == table[0, :3].tolist() + [0, 0] + table[3, :1].tolist() + table[4, :2].tolist()
    assert last.tolist() == [1, 1, 1, 4, 2]
    assert blind.tolist() == [3, 4]  # the queries of the row without keys
    assert torch.equal(batch.page_table, table)  # the caller's table is not written
    none = _extend_layout(batch.cu_seqlens_q[:2], batch.page_table[:1], batch.seq_lens[:1], 4)[3]
    assert none is None


# --- FlashInfer's extend glue (layout, private qo_indptr, blind rows, fp8 scales, sinks) through a CPU stand-in -----

class FakePagedPrefill:
    """FlashInfer 0.6.4's BatchPrefillWithPagedKVCacheWrapper as documented, on the CPU: keys read through the CSR
    layout it was planned with, causal bottom-right, ``window_left``, softcap, ``sm_scale * k_scale``; a query that
    sees no key gives NaN (FlashInfer's prefill returns no zeros there). It keeps the qo_indptr it was given."""

    def __init__(self, workspace, layout, backend="auto", **kwargs):
        self.sinks_variant = False

    def plan(self, qo_indptr, indptr, indices, last, hq, hk, d, page_size, *, causal=False, sm_scale=None,
             window_left=-1, logits_soft_cap=None, q_data_type=None, kv_data_type=None):
        self.qo, self.indptr, self.indices, self.last = qo_indptr, indptr, indices, last
        self.page_size, self.causal, self.sm_scale = page_size, causal, sm_scale
        self.window = window_left + 1 if window_left >= 0 else None
        self.softcap = logits_soft_cap or None

    def _attend(self, q, kv, sm_scale, sinks=None):
        k_cache, v_cache = kv
        out = torch.full(q.shape, float("nan"), dtype=torch.float32)
        for b in range(self.qo.numel() - 1):
            qs, qe = int(self.qo[b]), int(self.qo[b + 1])
            pages = self.indices[int(self.indptr[b]):int(self.indptr[b + 1])].long()
            n = (pages.numel() - 1) * self.page_size + int(self.last[b]) if pages.numel() else 0
            k = k_cache[pages].flatten(0, 1)[:n].float()
            v = v_cache[pages].flatten(0, 1)[:n].float()
            out[qs:qe] = yardstick.reference_attention(q[qs:qe].float(), k, v, sm_scale, self.causal,
                                                       window=self.window, softcap=self.softcap, sinks=sinks)
        return out.to(q.dtype)

    def run(self, q, kv, k_scale=None):
        return self._attend(q, kv, self.sm_scale * (k_scale if k_scale is not None else 1.0))


class FakeSinkWrapper(FakePagedPrefill):
    """The attention-sink variant: run(q, kv, sinks, sm_scale); no softcap (declined by attnsel with sinks)."""

    def __init__(self, workspace, layout, backend="auto", window_left=-1, **kwargs):
        super().__init__(workspace, layout)
        self.window_left = window_left

    def run(self, q, kv, sinks, sm_scale):
        assert self.window == (self.window_left + 1 if self.window_left >= 0 else None)
        return self._attend(q, kv, sm_scale, sinks)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys
    import types

    import attnsel.backends.flashinfer as fi

    module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakePagedPrefill,
                                   BatchAttentionWithAttentionSinkWrapper=FakeSinkWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi, "_pools", {})
    monkeypatch.setattr(fi, "_workspace", lambda device, nbytes: torch.zeros(1))
    return module


FI_FEATURES = {"plain": {}, "window": {"sliding_window": 5}, "softcap": {"softcap": 5.0},
               "fp8": {"kv_dtype": "fp8_e4m3"}, "sinks-window": {"sinks": True, "sliding_window": 9}}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("feature", list(FI_FEATURES))
def test_flashinfer_extend_glue_against_the_reference(feature, page_size, fake_flashinfer):
    from tests.fixtures.extend_cases import row_failures

    spec = AttentionSpec(8, 2, 32, "fp32", page_size=page_size, **FI_FEATURES[feature])
    batch = make_batch(spec, [(4, 40), (0, 3), (3, 0), (6, 6), (2, 2 * page_size + 1), (1, 1)], seed=2)
    for name in ("flashinfer", "flashinfer_fa2"):
        if spec.sinks and name != "flashinfer":
            continue
        cu = batch.cu_seqlens_q.clone()
        run = get(name).plan_extend(spec, cu, *batch.plan_args()[1:])
        cu.fill_(0)  # the engine's next batch, written in place: the plan keeps its own copy
        out = run(batch.q, batch.k_cache, batch.v_cache, **batch.run_kwargs())
        failures = row_failures(batch, out, atol=2e-5)
        assert not failures, "\n".join(failures)


def test_flashinfer_decode_with_sinks_shares_the_paged_sink_plan(fake_flashinfer):
    """Decode with sinks is the paged sink plan with one query per row: rows of length 0 give zeros."""
    from tests.fixtures.extend_cases import row_failures

    spec = AttentionSpec(8, 2, 32, "fp32", page_size=4, sinks=True)
    batch = make_batch(spec, [(1, 9), (1, 0), (1, 1), (1, 4)], seed=3)
    out = get("flashinfer").plan_decode(spec, batch.page_table, batch.seq_lens)(
        batch.q[:batch.total_q], batch.k_cache, batch.v_cache, sinks=batch.sinks)
    assert not row_failures(batch, out, atol=2e-5)
