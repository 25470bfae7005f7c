"""Selection.plan_extend: the bucket from host ints without a sync (requests, query tokens, contexts; the defaults when
totals are absent), graph-mode tables keyed by requests, every bad argument named with what is allowed, the
ATTNSEL_CHECK_METADATA value checks, and a selection whose extend phase cannot be served (extend is optional unless
named). Tables come from select() with the worker replaced by injected timings (tests/fixtures/dispatch.py)."""
import re

import pytest
import torch

from attnsel import AttentionSpec, SelectionError, select
from attnsel.errors import InvalidArgument
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.selection import PhaseChoice, build_table
from attnsel.validate.cases import cumulative
from attnsel.validate.extend_grid import EXTEND_AXES
from tests.fixtures.dispatch import SPEC, Recorder, _selection, fake_worker, measured
from tests.fixtures.extend_cases import make_batch, row_failures

A_WINS, B_WINS = {"rec_a": 1.0, "rec_b": 2.0}, {"rec_a": 9.0, "rec_b": 2.0}
# rec_a wins only the smallest bucket: a step along any one axis (requests, q_len, context) hands it to rec_b
EAGER = {(r, q, c): A_WINS if (r, q, c) == (1, 2, 1024) else B_WINS
         for r in (1, 64) for q in (2, 1024) for c in (1024, 16384)}
# graph mode: rec_a wins every shape of 4 requests, rec_b every shape of 64
GRAPH = {(r, q, c): A_WINS if r == 4 else B_WINS for r in (4, 64) for q in (2, 4) for c in (1024, 8192)}
META = dict(device="meta", dtype=torch.int32)


@pytest.fixture
def recorders(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    monkeypatch.delenv("ATTNSEL_CHECK_METADATA", raising=False)
    Recorder.planned.clear()
    return Recorder.planned


def _select(monkeypatch, cells):
    """select() with prefill and decode torch, extend measured over rec_a and rec_b (injected timings)."""
    fake_worker(monkeypatch, {"extend": measured("extend", "eager", cells)}, [])
    return select(SPEC, "torch", "torch", extend_priority=["rec_a", "rec_b"])


def _meta_plan(sel, requests, width, max_q, max_len=None, **kwargs):
    """plan_extend on meta tensors: no data, so any read of a value (a device sync on the GPU) would raise."""
    return sel.plan_extend(torch.empty(requests + 1, **META), torch.empty(requests, width, **META),
                           torch.empty(requests, **META), max_q, max_len, **kwargs)


def test_bucket_from_host_ints_without_reading_tensors(monkeypatch, recorders):
    sel = _select(monkeypatch, EAGER)
    assert sel.dispatch["extend"].axes == EXTEND_AXES
    ps = SPEC.page_size
    _meta_plan(sel, 1, 64, 2, total_q=2, context_tokens=1024)  # (1, 2, 1024)
    _meta_plan(sel, 1, 1024, 2, total_q=2, context_tokens=16384)  # context
    _meta_plan(sel, 1, 64, 1024, total_q=1024, context_tokens=1024)  # query tokens
    _meta_plan(sel, 64, 64, 2, total_q=128, context_tokens=64 * 1024)  # requests = seq_lens.shape[0]
    assert recorders == ["rec_a", "rec_b", "rec_b", "rec_b"]
    recorders.clear()
    # defaults: total_q = requests x max_seqlen_q; context = requests x max_seq_len, else the page table's reach
    _meta_plan(sel, 1, 1024, 2, 1024)  # (1, 2, 1024): max_seq_len, not the table's 1024 x 16 tokens
    _meta_plan(sel, 1, 1024 // ps, 2)  # the table holds 1024 tokens
    _meta_plan(sel, 1, 16384 // ps, 2)  # 16384
    _meta_plan(sel, 1, 64, 1024, 1024)  # 1024 query tokens
    _meta_plan(sel, 64, 1024 // ps, 2, total_q=128)  # 64 requests x 1024 context each
    assert recorders == ["rec_a", "rec_a", "rec_b", "rec_b", "rec_b"]
    # means round up: 2 requests, 3 query tokens -> 2 per request; the lookup is the one plan_extend makes
    assert sel.extend_backend_for(1, 2, 1024) == "rec_a" and sel.extend_backend_for(1, 2, 16384) == "rec_b"


def test_graph_mode_tables_are_keyed_by_requests(recorders):
    """select() refuses mode "graph" without CUDA: the table is built from the same timings by hand."""
    table = build_table(measured("extend", "graph", GRAPH), ["rec_a", "rec_b"])
    sel = _selection({"extend": PhaseChoice("rec_b", "auto", [], table)}, mode="graph")
    assert table.axes == ("requests",) and [b.key for b in table.buckets] == [(4,), (64,)]
    _meta_plan(sel, 4, 4096, 1024, total_q=4 * 1024, context_tokens=4 * 65536)  # far from every timed shape
    _meta_plan(sel, 4, 4, 2)
    _meta_plan(sel, 64, 4, 2, total_q=128, context_tokens=64)
    _meta_plan(sel, 64, 4096, 1024)
    assert recorders == ["rec_a", "rec_a", "rec_b", "rec_b"]
    assert sel.extend_backend_for(4, 10**4, 10**6) == "rec_a"


def test_the_checked_run_changes_nothing_and_is_right():
    spec = AttentionSpec(4, 2, 64, "fp16", page_size=4)
    sel = _selection({"extend": PhaseChoice("torch", "explicit", [])}, spec=spec)
    batch = make_batch(spec, [(3, 9), (0, 5), (2, 0), (4, 4)], seed=1)
    run = sel.plan_extend(*batch.plan_args(), total_q=batch.q.shape[0], context_tokens=18)
    out = run(batch.q, batch.k_cache, batch.v_cache)
    bare = TORCH.plan_extend(spec, *batch.plan_args())(batch.q, batch.k_cache, batch.v_cache)
    assert torch.equal(out, bare) and row_failures(batch, out) == []
    assert sel.plan_extend(*batch.plan_args(), checked=False).__name__ == "run"  # the backend's own


def _id(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype)[6:]}{list(value.shape)}{value.device.type}".replace(" ", "")
    return repr(value)


CU = cumulative([2, 3], "cpu")
TABLE = torch.zeros(2, 4, dtype=torch.int32)
LENS = torch.tensor([9, 5], dtype=torch.int32)
_CU = r"^cu_seqlens_q: expected a 1-D int32 tensor of 3 offsets \(batch \+ 1, one row per sequence of seq_lens\) " \
      r"on cpu, got "
_TABLE = r"^page_table: expected an int32 tensor \[2, max_pages\] on cpu \(one row per sequence of seq_lens\), got "
_LENS = r"^seq_lens: expected a 1-D int32 tensor \[batch\], got "
_MAX_Q = r"^max_seqlen_q: expected a non-negative Python int \(a host-side bound on each row's queries\), got "
_MAX_LEN = r"^max_seq_len: expected None or a non-negative Python int, got "
_TOTAL_Q = r"^total_q: expected None or a non-negative Python int \(q's rows: the batch's query tokens, padding " \
           r"included\), got "
_CONTEXT = r"^context_tokens: expected None or a non-negative Python int \(the requests' contexts summed\), got "


@pytest.mark.parametrize("change,message", [
    ({"cu": CU.long()}, _CU + r"\[3\] int64 on cpu$"),
    ({"cu": CU.float()}, _CU + r"\[3\] fp32 on cpu$"),
    ({"cu": CU[None]}, _CU + r"\[1, 3\] int32 on cpu$"),
    ({"cu": CU[:2]}, _CU + r"\[2\] int32 on cpu$"),
    ({"cu": CU.to("meta")}, _CU + r"\[3\] int32 on meta$"),
    ({"cu": [0, 2, 5]}, _CU + "list$"),
    ({"table": TABLE.long()}, _TABLE + r"\[2, 4\] int64 on cpu$"),
    ({"table": TABLE.float()}, _TABLE + r"\[2, 4\] fp32 on cpu$"),
    ({"table": TABLE[0]}, _TABLE + r"\[4\] int32 on cpu$"),
    ({"table": TABLE[:1]}, _TABLE + r"\[1, 4\] int32 on cpu$"),
    ({"table": TABLE.to("meta")}, _TABLE + r"\[2, 4\] int32 on meta$"),
    ({"lens": LENS.long()}, _LENS + r"\[2\] int64 on cpu$"),
    ({"lens": LENS[:, None]}, _LENS + r"\[2, 1\] int32 on cpu$"),
    ({"lens": [9, 5]}, _LENS + "list$"),
    ({"max_q": 3.0}, _MAX_Q + "3.0$"), ({"max_q": True}, _MAX_Q + "True$"), ({"max_q": -1}, _MAX_Q + "-1$"),
    ({"max_q": torch.tensor(3)}, _MAX_Q + r"tensor\(3\)$"), ({"max_q": "3"}, _MAX_Q + "'3'$"),
    ({"max_q": None}, _MAX_Q + "None$"),
    ({"max_len": torch.tensor(9)}, _MAX_LEN + r"tensor\(9\)$"), ({"max_len": -1}, _MAX_LEN + "-1$"),
    ({"max_len": 9.0}, _MAX_LEN + "9.0$"),
    ({"total_q": -1}, _TOTAL_Q + "-1$"), ({"total_q": torch.tensor(5)}, _TOTAL_Q + r"tensor\(5\)$"),
    ({"total_q": True}, _TOTAL_Q + "True$"), ({"total_q": 5.0}, _TOTAL_Q + "5.0$"),
    ({"context_tokens": -1}, _CONTEXT + "-1$"), ({"context_tokens": torch.tensor(14)}, _CONTEXT + r"tensor\(14\)$"),
], ids=lambda v: "" if isinstance(v, str) else "-".join(f"{k}={_id(x)}" for k, x in v.items()))
def test_every_bad_argument_is_named_with_what_is_allowed(change, message, recorders):
    """Checked on the host before any backend plans (a tensor where a host int belongs would be read: a sync)."""
    sel = _selection({"extend": PhaseChoice("rec_a", "explicit", [])})
    args = {"cu": CU, "table": TABLE, "lens": LENS, "max_q": 3, "max_len": None, **change}
    totals = {k: v for k, v in args.items() if k in ("total_q", "context_tokens")}
    with pytest.raises(ValueError, match=message):
        sel.plan_extend(args["cu"], args["table"], args["lens"], args["max_q"], args["max_len"], **totals)
    assert recorders == []


def test_the_run_names_a_bad_tensor():
    sel = _selection({"extend": PhaseChoice("torch", "explicit", [])})
    run = sel.plan_extend(CU, TABLE, LENS, 3, total_q=6)
    q, cache = torch.zeros(6, 4, 64, dtype=torch.float16), torch.zeros(1, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^q: expected \[6, 4, 64\] fp16 on cpu, got \[5, 4, 64\] fp16 on cpu$"):
        run(q[:5], cache, cache)
    with pytest.raises(ValueError, match=r"^k_cache: expected \[\*, 16, 2, 64\] fp16 on cpu, got \[1, 8, 2, 64\]"):
        run(q, cache[:, :8], cache)
    with pytest.raises(ValueError, match=r"^v_cache: expected \[1, 16, 2, 64\] fp16 on cpu, got \[1, 16, 2, 64\] bf16"):
        run(q, cache, cache.bfloat16())
    with pytest.raises(ValueError, match=r"^k_cache/v_cache hold 0 pages .*; allowed: at least one page"):
        run(q, cache[:0], cache[:0])
    with pytest.raises(ValueError, match="^sinks: given, but the spec has no attention sinks"):
        run(q, cache, cache, sinks=torch.zeros(4))
    assert run(q, cache, cache).shape == (6, 4, 64)


def _table(rows):
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("args,message", [
    # a row with more queries than its context (its queries are its last tokens)
    ((cumulative([3, 5], "cpu"), _table([[0, 1], [2, 3]]), [9, 4], 5, None, {}),
     r"^row 1 has 5 queries \(cu_seqlens_q\) but seq_lens\[1\] is 4; allowed: seq_lens counts the whole context, the "
     r"row's new tokens included \(>= its queries\), or 0 for a padding row$"),
    # offsets past q's rows
    ((cumulative([3, 5], "cpu"), _table([[0, 1], [2, 3]]), [9, 5], 5, None, {"total_q": 6}),
     r"^cu_seqlens_q\[-1\] is 8, past q's 6 tokens \(total_q\); allowed: offsets within q's tokens$"),
    # a page id < 0 that a row reads
    ((cumulative([3, 5], "cpu"), _table([[0, 1], [-1, 3]]), [9, 5], 5, None, {}),
     r"^page_table\[1, 0\] is -1 \(read by seq_lens\[1\]=5\); allowed: page ids >= 0$"),
    ((cumulative([3, 5], "cpu"), _table([[0, 1], [2, 3]]), [9, 5], 4, None, {}),
     r"^sequence 1 has 5 tokens by cu_seqlens_q \(3 -> 8\), more than max_seqlen_q=4; allowed: max_seqlen_q >= "),
    ((_table([0, 3, 2]), _table([[0, 1], [2, 3]]), [9, 5], 5, None, {}),
     r"^cu_seqlens_q decreases at sequence 1 \(3 -> 2\); allowed: non-decreasing offsets$"),
    ((_table([1, 3, 8]), _table([[0, 1], [2, 3]]), [9, 5], 5, None, {}),
     r"^cu_seqlens_q\[0\] is 1; allowed: 0"),
    ((cumulative([3, 5], "cpu"), _table([[0, 1], [2, 3]]), [9, 5], 5, 8, {}),
     r"^seq_lens\[0\] is 9, more than max_seq_len=8; allowed: max_seq_len >= every length"),
    ((cumulative([3, 5], "cpu"), _table([[0], [2]]), [20, 5], 5, None, {}),
     r"^seq_lens\[0\] is 20, more than page_table's 1 pages x page size 16 = 16 tokens"),
])
def test_check_metadata_catches_bad_values_before_any_backend_plans(args, message, monkeypatch, recorders):
    monkeypatch.setenv("ATTNSEL_CHECK_METADATA", "1")
    sel = _selection({"extend": PhaseChoice("rec_a", "explicit", [])})
    cu, table, lens, max_q, max_len, totals = args
    with pytest.raises(ValueError, match=message):
        sel.plan_extend(cu, table, torch.tensor(lens, dtype=torch.int32), max_q, max_len, **totals)
    assert recorders == []


def test_check_metadata_accepts_what_engines_pass(monkeypatch, recorders):
    """Padding rows (queries, no context), rows without queries, sentinels past a row's pages, and with a sliding
    window the pages before the window of a row's first query freed (-1), as engines free them."""
    monkeypatch.setenv("ATTNSEL_CHECK_METADATA", "1")
    sel = _selection({"extend": PhaseChoice("rec_a", "explicit", [])})
    sel.plan_extend(cumulative([3, 2, 0], "cpu"), _table([[0, -1], [-1, -1], [1, 99]]),
                    torch.tensor([9, 0, 20], dtype=torch.int32), 3, total_q=8)
    spec = AttentionSpec(4, 2, 64, "fp16", page_size=4, sliding_window=8)
    windowed = _selection({"extend": PhaseChoice("rec_a", "explicit", [])}, spec=spec)
    # row 0: 40 tokens, 2 queries at positions 38, 39: keys from 31 on (page 7); row 1: 3 queries over 12 tokens
    table = _table([[-1] * 7 + [5, 6, 7], [1, 2, 3] + [-1] * 7])
    windowed.plan_extend(cumulative([2, 3], "cpu"), table, torch.tensor([40, 12], dtype=torch.int32), 3)
    assert recorders == ["rec_a", "rec_a"]
    table[0, 7] = -1  # the page of key 31, which query 38 sees
    with pytest.raises(ValueError, match=r"^page_table\[0, 7\] is -1 \(read by seq_lens\[0\]=40\)"):
        windowed.plan_extend(cumulative([2, 3], "cpu"), table, torch.tensor([40, 12], dtype=torch.int32), 3)


def test_check_metadata_holds_the_caches_to_the_pages_read(monkeypatch):
    """A page id past the caches faults a kernel: the checked run (and the unchecked one) refuses caches with fewer
    pages than the plan's rows read."""
    monkeypatch.setenv("ATTNSEL_CHECK_METADATA", "1")
    sel = _selection({"extend": PhaseChoice("torch", "explicit", [])})
    q, cache = torch.zeros(5, 4, 64, dtype=torch.float16), torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    for checked in (True, False):
        run = sel.plan_extend(CU, _table([[0, 99], [6, 99]]), LENS, 3, checked=checked)
        with pytest.raises(ValueError, match=r"^page_table reads page 6 but k_cache/v_cache hold 4 pages; allowed: "
                                             r"page ids < k_cache.shape\[0\] \(\$ATTNSEL_CHECK_METADATA found this\)$"):
            run(q, cache, cache)
    run = sel.plan_extend(CU, _table([[0, 99], [3, 99]]), LENS, 3)
    assert run(q, cache, cache).shape == q.shape


def test_an_extend_phase_that_cannot_be_served_raises_at_plan_while_prefill_and_decode_serve(monkeypatch):
    """Extend is optional unless named: a selection whose extend candidates are all unavailable is made, serves
    prefill and decode, and plan_extend raises SelectionError with the reason; named explicitly, select raises."""
    fake_worker(monkeypatch, {}, [])
    sel = select(SPEC, "torch", "torch", extend_priority=["fa3"])
    assert sel.extend == "" and sel.phases["extend"].error.startswith("no backend can serve extend: fa3: unavailable")
    with pytest.raises(SelectionError) as exc:
        sel.plan_extend(CU, TABLE, LENS, 3)
    assert str(exc.value) == ("this selection cannot serve extend (ragged queries over the paged cache): "
                              + sel.phases["extend"].error)
    assert exc.value.selection is sel
    with pytest.raises(ValueError, match=_LENS):  # bad arguments are still named first
        sel.plan_extend(CU, TABLE, LENS.long(), 3)
    q, cache = torch.zeros(2, 4, 64, dtype=torch.float16), torch.randn(4, 16, 2, 64, dtype=torch.float16)
    out = sel.plan_decode(TABLE, LENS, 9)(q, cache, cache)
    assert torch.equal(out, TORCH.plan_decode(SPEC, TABLE, LENS)(q, cache, cache))
    k = torch.randn(5, 2, 64, dtype=torch.float16)
    assert sel.plan_prefill(CU, CU, 3, 3, 5)(torch.zeros(5, 4, 64, dtype=torch.float16), k, k).shape == (5, 4, 64)
    with pytest.raises(SelectionError, match=re.escape("extend backend 'fa3' was requested explicitly but is "
                                                       "unavailable")):
        select(SPEC, "torch", "torch", "fa3")


def test_a_non_causal_spec_has_no_extend_phase_with_the_reason():
    """Extend is causal by contract (validation's reference is): a non-causal spec's extend phase is unavailable on
    every backend, torch included, and its prefill and decode still serve."""
    from attnsel.backends import availability, get
    from attnsel.selection import select as _select

    spec = AttentionSpec(4, 2, 64, "fp32", causal=False)
    reason, _ = availability(get("torch"), spec, "extend")
    assert reason and "non-causal" in reason and "extend is causal" in reason
    sel = _select(spec, policy="priority", prefill_priority=["torch"], decode_priority=["torch"])
    assert sel.extend == "" and "non-causal" in sel.phases["extend"].error
    assert (sel.prefill, sel.decode) == ("torch", "torch")


def test_extend_grid_times_factor_two_steps_last():
    """The eager grid: coarse corners first, the factor-4 grid next, then the factor-2 steps of requests and
    context (prompt-cache hits over 8k, multi-token decode over 2k) that a tight budget may skip; graph mode keys by
    requests alone."""
    from attnsel.validate.extend_grid import extend_grid

    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    grid = extend_grid(spec, torch.device("cuda"), free_bytes=80 << 30)
    levels = [level for level, _ in grid]
    assert levels == sorted(levels) and set(levels) == {0, 1, 2}
    by_shape = dict((shape, level) for level, shape in grid)
    assert by_shape[(1, 2, 1024)] == 0 and by_shape[(4, 16, 4096)] == 1
    assert by_shape[(8, 256, 8192)] == 2 and by_shape[(8, 4, 2048)] == 2
    assert not any(c == 2048 and q > 4 for _, (_, q, c) in grid)
    assert all(r * q <= 16384 and q <= c for _, (r, q, c) in grid)
    graph = extend_grid(spec, torch.device("cuda"), free_bytes=80 << 30, mode="graph")
    assert {q for _, (_, q, _) in graph} == {2, 4} and {r for _, (r, _, _) in graph} >= {1, 2, 8, 128, 256}


# rec_a reads a row's keys in one program (a row alone takes what a full batch of such rows takes); rec_b splits them
# (a lone row is 10x faster) at 1.2x rec_a's time on uniform batches
WHOLE_VS_SPLIT = {(r, q, c): {"rec_a": c / 100, "rec_b": c / 100 * (1.2 if r > 1 else 0.1)}
                  for r in (1, 16, 64) for q in (2, 1024) for c in (1024, 16384)}


def test_a_skewed_batch_goes_to_the_backend_that_does_not_wait_for_its_longest_row(monkeypatch, recorders):
    """Multi-token decode over ragged contexts: 32 rows x 2 queries, mean context 1500, one row of 12000. At its
    means rec_a is faster (1.2x), but rec_a ends with its longest row (12000 keys in one program: 120 us) where
    rec_b splits it (12 us alone, 18 for the batch). Given the longest row (``longest=``), plan_extend picks rec_b; a batch
    skewed less than timing.RAGGED_SKEW, or planned with max_seq_len alone (a bound), goes by its means."""
    sel = _select(monkeypatch, WHOLE_VS_SPLIT)
    _meta_plan(sel, 32, 1024, 2, 12000, total_q=64, context_tokens=32 * 1500, longest=12000)
    _meta_plan(sel, 32, 1024, 2, 12000, total_q=64, context_tokens=32 * 1500, longest=3000)  # skew 2 < 2.5
    _meta_plan(sel, 32, 1024, 2, 12000, total_q=64, context_tokens=32 * 1500)  # a bound, no longest row given
    assert recorders == ["rec_b", "rec_a", "rec_a"]
    with pytest.raises(InvalidArgument, match=r"^longest: expected None or a non-negative Python int \(the longest "
                                              r"row's exact context\), got 1.5$"):
        _meta_plan(sel, 32, 1024, 2, total_q=64, longest=1.5)
    assert sel.extend_backend_for(32, 2, 1500, 12000) == "rec_b" and sel.extend_backend_for(32, 2, 1500) == "rec_a"
    table = sel.dispatch["extend"]
    assert table.without("ragged").backend_for((32, 2, 1500), 12000) == "rec_a"  # the rule, switched off
