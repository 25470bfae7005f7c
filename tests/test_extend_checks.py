"""The checks of the extend phase catch faulty backends: the CUDA-graph replay check, validation's extend cases (a
window one key too wide on chunk rows, q padding rows past cu_seqlens_q), a plugin's load error as its extend reason,
and the tests' own extend fixture. Each test states what should hold and fails where it does not. CPU only."""
import dataclasses

import pytest
import torch

from attnsel import AttentionSpec, backends
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.validate import cases, graph_replay, paged_cases

CPU = torch.device("cpu")
SPEC = AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bf16", page_size=16)


def fake_capture(run, inputs):
    """A replay on the CPU: the captured call made again with the same tensor objects (tests/test_graph_replay.py)."""
    return lambda: run(*inputs)


class FreezesCuSeqlensQ:
    """Reads seq_lens and the page table at every run (as the contract asks) but keeps the cu_seqlens_q its plan was
    given as a copy: a replay after the engine rewrote cu_seqlens_q in place (transformers' flash route does, every
    step) splits q into the planned rows."""
    name = "freezes_cu_seqlens_q"

    def plan_extend(self, spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len):
        frozen = cu_seqlens_q.clone()
        return lambda q, k, v, **kw: TORCH.plan_extend(spec, frozen, page_table, seq_lens, max_seqlen_q,
                                                       max_seq_len)(q, k, v, **kw)


def test_graph_replay_of_extend_catches_a_plan_that_froze_cu_seqlens_q():
    """The CUDA-graph check of the extend phase must replay with other query offsets, as it replays decode with other
    lengths: otherwise a backend stale on cu_seqlens_q is cleared for mode "graph"."""
    result = graph_replay.check(FreezesCuSeqlensQ(), SPEC, "extend", CPU, fake_capture)["graph_capture"]
    assert result.startswith("wrong under CUDA graph replay"), result


def test_a_plugin_that_failed_to_load_names_its_load_error_for_extend(monkeypatch):
    """A plugin that fails to load is kept 'so reports show it instead of hiding it' (backends/__init__.py): its
    extend reason must be the import error, not 'no plan_extend'."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "attnsel_no_such_module:BACKEND")
    broken = backends.get("attnsel_no_such_module:BACKEND")
    reasons = {p: backends.availability(broken, SPEC, p)[0] for p in backends.PHASES}
    assert "failed to load" in reasons["prefill"]
    assert "failed to load" in reasons["extend"], reasons["extend"]


class WindowOffByOneOnChunks:
    """Right on rows of up to 3 queries (multi-token decode: the rows validation traps at the window's edge), one key
    too wide a window on longer rows (chunked prefill, a cache hit): a kernel whose long-tile window mask is off."""
    name = "window_off_by_one_on_chunks"

    def plan_extend(self, spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len):
        wide = dataclasses.replace(spec, sliding_window=spec.sliding_window + 1)
        right = TORCH.plan_extend(spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)
        wrong = TORCH.plan_extend(wide, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        chunk_token = torch.repeat_interleave(q_lens > 3, q_lens)

        def run(q, k, v, **kw):
            pad = torch.zeros(q.shape[0] - chunk_token.shape[0], dtype=torch.bool)  # q's padding rows
            chosen = torch.cat([chunk_token, pad])
            return torch.where(chosen[:, None, None], wrong(q, k, v, **kw), right(q, k, v, **kw))

        return run


def test_extend_validation_catches_a_window_off_by_one_on_chunk_rows(monkeypatch):
    """Validation's GPU-sized extend cases (built here on the CPU) for a bf16 spec with a 4096-token window
    (Mistral-7B-v0.1, Gemma 2): a backend whose window is one key too wide on rows of more than 3 queries must be
    rejected by the ragged case or the single case. The window-edge trap (inputs._sequence, boundary=True) sits only
    on the 3-query boundary rows, so chunked prefill under a window is judged on random data alone."""
    gpu_lengths = paged_cases.extend_lengths
    monkeypatch.setattr(paged_cases, "extend_lengths", lambda spec, device: gpu_lengths(spec, torch.device("cuda")))
    spec = AttentionSpec(8, 2, 128, "bf16", page_size=16, sliding_window=4096)
    verdicts = []
    for case in (paged_cases.extend_case(spec, CPU), paged_cases.extend_case(spec, CPU, seed=5,
                                                                             lengths=([257], [4099]))):
        out = cases.run_case(WindowOffByOneOnChunks(), spec, case)
        verdicts.append(cases.check_output(spec, out, case)["status"])
    assert "rejected" in verdicts, verdicts


class NoPaddingRows:
    """Zeroes the queries of zero-length rows (CUDA-graph padding) through a per-token row lookup, as FA3's extend
    run does, but without FA3's guard for q rows past cu_seqlens_q[-1] (row id = batch): it works on every batch whose
    q has exactly cu_seqlens_q[-1] rows and fails on the padded q engines pass under CUDA graphs."""
    name = "no_padding_rows"

    def plan_extend(self, spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len):
        inner = TORCH.plan_extend(spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)

        def run(q, k, v, **kw):
            rows = torch.searchsorted(cu_seqlens_q[1:], torch.arange(q.shape[0], dtype=cu_seqlens_q.dtype),
                                      right=True)
            empty = seq_lens[rows] == 0  # rows == batch for padding tokens: out of range
            return inner(q, k, v, **kw).masked_fill(empty[:, None, None], 0.0)

        return run


def test_extend_validation_gives_q_padding_rows_past_cu_seqlens_q():
    """flash_extend and the transformers routes hand plan_extend's run a q with rows past cu_seqlens_q[-1] (padding;
    their output is unspecified, but the run must take them): validation must exercise such a q, else a backend that
    cannot take it is validated and then fails while serving."""
    from tests.fixtures.extend_cases import make_batch  # q with 3 NaN padding rows past cu_seqlens_q[-1]

    served = make_batch(SPEC, [(3, 9), (2, 0), (4, 40)])
    with pytest.raises(IndexError):  # what serving meets
        served.plan(NoPaddingRows())(served.q, served.k_cache, served.v_cache)
    verdicts = []
    for case in (cases.make_case(SPEC, "extend", CPU), cases.single_case(SPEC, "extend", CPU)):
        try:
            out = cases.run_case(NoPaddingRows(), SPEC, case)
            verdicts.append(cases.check_output(SPEC, out, case)["status"])
        except Exception as exc:  # validation's worker records a raising candidate as rejected
            verdicts.append(f"rejected ({type(exc).__name__})")
    assert any(v.startswith("rejected") for v in verdicts), verdicts


def test_extend_fixture_flags_wrong_outputs_on_queries_before_the_first_key():
    """tests/fixtures/extend_cases.row_failures judges the extend tests. A row with 0 < seq_len < q_len has
    queries before its first key (FlashAttention's and every backend's answer there: zeros). The fixture's reference
    is NaN on those queries, so the row's tolerance comes out inf and any finite output passes."""
    from tests.fixtures.extend_cases import make_batch, row_failures

    batch = make_batch(SPEC, [(5, 2), (2, 9)])
    out = batch.plan(TORCH)(batch.q, batch.k_cache, batch.v_cache)
    assert row_failures(batch, out) == []
    out[:3] = 7.0  # the 3 queries of row 0 that see no key: garbage instead of zeros
    assert row_failures(batch, out), "garbage on queries that see no key passed the fixture's check"
