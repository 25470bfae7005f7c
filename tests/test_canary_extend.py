"""The canary over the extend phase (Selection.plan_extend): one plan in N recomputed off the serving path against the
float32 reference, each query row judged as validation judges its extend cases, a failing backend demoted for that
extend bucket (eager: requests x query tokens x context; graph: requests) and its cached verdict dropped.

The fault is real: tests/fixtures/canary_backends.py's drops_last_key plugin reads each row's context one key short
from its 51st extend run in a process on, so it passes validation in the worker and goes wrong while serving. The
batches come from tests/fixtures/extend_cases.py (NaN q padding rows, sentinels, NaN/inf in unused slots, rows with
no query or no key); every verdict on them is checked against that module's independent reference too."""
import logging

import pytest
import torch

import attnsel.canary as canary_mod
from attnsel import select
from attnsel.cache import ResultCache
from attnsel.canary import Canary
from attnsel.selection import Candidate, PhaseChoice, Selection, build_table
from attnsel.spec import AttentionSpec
from attnsel.validate import cases, served
from tests.fixtures.canary_backends import DROPS, GOOD_CALLS, DropsLastKey
from tests.fixtures.dispatch import measured
from tests.fixtures.extend_cases import make_batch, row_failures

SPEC = AttentionSpec(4, 2, 64, "bf16", page_size=4)
CPU = torch.device("cpu")
PLUGIN = "tests.fixtures.canary_backends:DROPS"
# (q_len, seq_len) rows: a chunk over a prefix ending mid-page, a row without queries, CUDA-graph padding (queries,
# no context), a fresh prompt
SMALL = [(3, 9), (0, 5), (2, 0), (4, 4)]
OTHER4 = [(1, 30), (2, 17), (1, 1), (3, 50)]  # 4 requests again, other query and context lengths
BIG = [(2, 7), (1, 9), (3, 8), (2, 6)] * 4  # 16 requests


@pytest.fixture
def drops(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", PLUGIN)
    DROPS[0].calls, DROPS[0].good = 0, GOOD_CALLS
    return DROPS[0]


def _plan(sel, batch, **kwargs):
    """Selection.plan_extend as an engine calls it: host totals (q's rows, the contexts summed), no sync."""
    return sel.plan_extend(batch.cu_seqlens_q, batch.page_table, batch.seq_lens, batch.max_seqlen_q,
                           batch.max_seq_len, total_q=batch.q.shape[0],
                           context_tokens=sum(n for _, n in batch.rows), **kwargs)


def _step(sel, batch, drops) -> str:
    """One engine step (plan, one layer); which backend ran it."""
    before = drops.calls
    _plan(sel, batch)(batch.q, batch.k_cache, batch.v_cache, **batch.run_kwargs())
    return "drops_last_key" if drops.calls > before else "torch"


def _hand_made(extend: PhaseChoice, every: int, mode: str = "eager", spec=SPEC, device: str = "cpu") -> Selection:
    """A Selection as select() makes it (no worker), with a canary checking one plan in ``every``."""
    phases = {"prefill": PhaseChoice("torch", "explicit", []), "decode": PhaseChoice("torch", "explicit", []),
              "extend": extend}
    canary = Canary(every, spec, fingerprint={}, device=device, cache=None)
    return Selection(spec, phases, "measure", mode, "off", {}, {}, canary=canary)


def _auto(*names):
    return [Candidate(names[0], "selected")] + [Candidate(n, "valid") for n in names[1:]]


def _table(mode, cells):
    return build_table(measured("extend", mode, cells), ["drops_last_key", "torch"])


def test_drops_last_key_is_wrong_on_every_row_with_keys_after_50_runs():
    """The fault the canary must catch, shown by the independent reference without it."""
    backend = DropsLastKey()
    batch = make_batch(SPEC, SMALL, seed=1)
    verdicts = []
    for _ in range(GOOD_CALLS + 2):
        out = batch.plan(backend)(batch.q, batch.k_cache, batch.v_cache)
        verdicts.append(row_failures(batch, out))
    assert verdicts[:GOOD_CALLS] == [[]] * GOOD_CALLS
    assert [f[:13] for f in verdicts[GOOD_CALLS]] == ["row 0 (q_len ", "row 3 (q_len "]  # the rows with keys


@pytest.mark.parametrize("spec", [SPEC, AttentionSpec(4, 2, 64, "bf16", page_size=4, sliding_window=6, sinks=True),
                                  AttentionSpec(4, 1, 64, "fp16", page_size=4, softcap=20.0, kv_dtype="fp8_e4m3")],
                         ids=["plain", "window-sinks", "softcap-fp8"])
def test_served_extend_reference_is_the_validation_reference(spec):
    """The canary's copy of an extend call over the validation's extend case (its traps: rows without queries,
    padding rows without context, window-boundary rows, NaN/inf in unused slots, sentinel page ids) gives the
    validation case's own float32 reference and check_output's verdict; a wrong row is named."""
    case = cases.extend_case(spec, CPU)
    kwargs = cases.run_kwargs(spec, case)
    pages = -(-case.max_len // spec.page_size)  # the plan's bound: what the canary copies
    rows = case.ref.shape[0]  # the case's q has padding rows past its last offset: served as engines pad
    out = torch.cat([case.ref, torch.zeros(case.q.shape[0] - rows, *case.ref.shape[1:])]).to(spec.torch_dtype)
    snap = served.take("extend", (case.cu_q, case.page_table, case.seq_lens), (case.q, case.k_cache, case.v_cache),
                       kwargs, out, pages)
    refs = served.reference(spec, snap)
    assert refs.problem is None and torch.equal(refs.ref[:rows], case.ref)
    assert served.judge(spec, snap, refs)["status"] == "valid"
    row = int(case.cu_q[2])  # sequence 2's first query
    snap.out[row] += 5.0
    verdict = served.judge(spec, snap, refs)
    assert verdict["status"] == "rejected", verdict
    assert f"in sequence 2 (q_len {int(case.cu_q[3] - case.cu_q[2])}, seq_len {int(case.seq_lens[2])})" in \
        verdict["reason"]


def test_served_extend_padding_rows_and_unjudgeable_batches():
    """q rows past cu_seqlens_q[-1] hold NaN and their output is unspecified (NaN here): not judged. A batch whose
    metadata the copies cannot judge is skipped with the reason, never called right or wrong."""
    batch = make_batch(SPEC, SMALL, seed=2)
    out = batch.plan(DropsLastKey())(batch.q, batch.k_cache, batch.v_cache)
    out[batch.total_q:] = float("nan")
    args = (batch.cu_seqlens_q, batch.page_table, batch.seq_lens)
    snap = served.take("extend", args, (batch.q, batch.k_cache, batch.v_cache), {}, out)
    assert served.judge(SPEC, snap, served.reference(SPEC, snap))["status"] == "valid"
    more_queries = make_batch(SPEC, [(3, 9), (5, 4)], seed=2)  # row 1: 5 queries over a context of 4
    snap = served.take("extend", (more_queries.cu_seqlens_q, more_queries.page_table, more_queries.seq_lens),
                       (more_queries.q, more_queries.k_cache, more_queries.v_cache), {}, more_queries.q.clone())
    verdict = served.judge(SPEC, snap, served.reference(SPEC, snap))
    assert verdict == {"status": "skipped", "reason": "row 1 has 5 queries but a context of 4 tokens (seq_lens "
                                                      "counts the row's queries too)"}
    short = served.take("extend", args, (batch.q[:5], batch.k_cache, batch.v_cache), {}, out[:5])
    verdict = served.judge(SPEC, short, served.reference(SPEC, short))
    assert verdict["status"] == "skipped" and "cu_seqlens_q[-1] is 9, past q's 5 rows" in verdict["reason"]


def test_canary_every_extend_plan_detects_logs_demotes_and_drops_the_verdict(drops, caplog):
    """Through select(): drops_last_key passes validation in the worker, is selected for extend, goes wrong at its
    51st run; the canary reads that plan's check at the next plan, torch serves extend from then on, and the cached
    extend verdict of drops_last_key is gone (prefill and decode keep theirs)."""
    sel = select(SPEC, "torch", "torch", "auto", policy="priority", extend_priority=["drops_last_key", "torch"],
                 canary_every=1, device="cpu")
    assert sel.extend == "drops_last_key" and sel.canary is not None
    batch = make_batch(SPEC, SMALL, seed=3)
    with caplog.at_level(logging.WARNING, logger="attnsel.canary"):
        ran = [_step(sel, batch, drops) for _ in range(GOOD_CALLS + 6)]
    assert ran == ["drops_last_key"] * (GOOD_CALLS + 1) + ["torch"] * 5
    assert sel.canary.mismatches() == {("extend", "drops_last_key"): 1}
    [record] = [r for r in caplog.records if r.name == "attnsel.canary"]
    message = record.getMessage()
    for words in ("extend backend drops_last_key", "4 requests, mean 3 query tokens over a mean context of 5",
                  "in sequence 3 (q_len 4, seq_len 4), query 0 at position 0",
                  "served extend batch of 4 requests, 9 query tokens", "torch serves", "cached verdict dropped"):
        assert words in message, message
    sel.canary.drain()
    report = sel.canary.report()
    assert report["phases"]["extend"]["drops_last_key"] == {"plans": 51, "sampled": 51, "checked": 51,
                                                            "mismatches": 1, "skipped": 0, "errors": 0}
    assert report["phases"]["extend"]["torch"]["checked"] == 5
    assert report["phases"]["extend"]["torch"]["mismatches"] == 0
    assert report["demoted"] == [{"phase": "extend", "bucket": "every shape", "backends": ["drops_last_key"],
                                  "serves": "torch"}]
    cached = ResultCache().entries().values()
    assert not [e for e in cached if e.get("backend") == "drops_last_key" and e.get("phase") == "extend"]
    again = select(SPEC, "torch", "torch", "auto", policy="priority", extend_priority=["drops_last_key", "torch"],
                   device="cpu")
    assert {c.name: c.from_cache for c in again.candidates["extend"]} == {"drops_last_key": False, "torch": True}


def test_extend_demotion_is_per_bucket_of_the_eager_table(drops):
    """drops_last_key wins both timed buckets (4 and 16 requests); a mismatch at 4 requests demotes it there only:
    torch, that bucket's runner-up, serves it; drops_last_key still serves 16 requests until its own check there."""
    table = _table("eager", {(4, 3, 8): {"drops_last_key": 1.0, "torch": 2.0},
                             (16, 3, 8): {"drops_last_key": 1.0, "torch": 2.0}})
    sel = _hand_made(PhaseChoice("drops_last_key", "auto", _auto("drops_last_key", "torch"), table), every=1)
    drops.good = 0  # wrong from its first run
    small, big = make_batch(SPEC, SMALL, seed=4), make_batch(SPEC, BIG, seed=5)
    assert _step(sel, small, drops) == "drops_last_key"  # wrong, sampled
    assert _step(sel, small, drops) == "torch"  # the check was read: demoted in the bucket of 4 requests
    assert _step(sel, big, drops) == "drops_last_key"  # 16 requests: not demoted there; wrong, sampled
    assert _step(sel, big, drops) == "torch"
    assert _step(sel, small, drops) == "torch"
    report = sel.canary.report()
    assert {(d["bucket"], d["serves"]) for d in report["demoted"]} == {("4x3x8", "torch"), ("16x3x8", "torch")}
    assert report["phases"]["extend"]["torch"]["mismatches"] == 0


def test_extend_demotion_under_cuda_graphs_is_keyed_by_requests(drops):
    """Mode "graph": the extend table has one bucket per number of requests; a mismatch at 4 requests demotes
    drops_last_key for every batch of 4 requests, whatever its query and context lengths, and for no other size."""
    table = _table("graph", {(r, q, c): {"drops_last_key": 1.0, "torch": 2.0}
                             for r in (4, 16) for q in (2, 4) for c in (1024, 8192)})
    assert table.axes == ("requests",)
    sel = _hand_made(PhaseChoice("drops_last_key", "auto", _auto("drops_last_key", "torch"), table), every=1,
                     mode="graph")
    drops.good = 0
    small, other, big = (make_batch(SPEC, rows, seed=6) for rows in (SMALL, OTHER4, BIG))
    assert _step(sel, small, drops) == "drops_last_key"
    assert _step(sel, other, drops) == "torch"  # same bucket (4 requests), other lengths
    assert [d["bucket"] for d in sel.canary.report()["demoted"]] == [table.bucket_for((4,)).label]
    assert _step(sel, big, drops) == "drops_last_key"  # 16 requests: not demoted there; wrong, sampled
    assert _step(sel, big, drops) == "torch"
    assert [(d["bucket"], d["serves"]) for d in sel.canary.report()["demoted"]] == [
        (table.bucket_for((4,)).label, "torch"), (table.bucket_for((16,)).label, "torch")]


@pytest.mark.parametrize("spec", [SPEC, AttentionSpec(8, 2, 32, "bf16", page_size=16, sliding_window=7, sinks=True),
                                  AttentionSpec(4, 1, 32, "fp16", page_size=1, softcap=20.0, kv_dtype="fp8_e4m3")],
                         ids=["plain", "window-sinks", "softcap-fp8"])
def test_a_correct_extend_backend_is_never_demoted_and_copies_are_taken_at_run_time(spec):
    """torch (right) checked on every plan over batches with every trap; the engine overwrites q and the output
    right after each run (as it reuses buffers): the canary judges the copies taken at run time."""
    sel = _hand_made(PhaseChoice("torch", "explicit", []), every=1, spec=spec)
    batches = [make_batch(spec, rows, seed=i, sentinel=s, q_mul=2.0 if spec.softcap else 1.0)
               for i, (rows, s) in enumerate([(SMALL, "nan_page"), (OTHER4, "-1"), (BIG, "num_pages")])]
    for i in range(30):
        batch = batches[i % 3]
        q = batch.q.clone()
        out = _plan(sel, batch)(q, batch.k_cache, batch.v_cache, **batch.run_kwargs())
        if i < 3:
            assert row_failures(batch, out) == []  # right by the independent reference too
        q.fill_(float("nan"))
        out.fill_(7.0)
    sel.canary.drain()
    report = sel.canary.report()
    assert report["phases"]["extend"]["torch"] == {"plans": 30, "sampled": 30, "checked": 30, "mismatches": 0,
                                                   "skipped": 0, "errors": 0}
    assert report["demoted"] == [] and report["mismatches"] == []


def test_canary_every_10_samples_extend_plans_0_10_20(drops):
    sel = _hand_made(PhaseChoice("drops_last_key", "auto", _auto("drops_last_key", "torch")), every=10)
    batch = make_batch(SPEC, SMALL, seed=7)
    for i in range(25):
        assert _step(sel, batch, drops) == "drops_last_key"
    stats = sel.canary.report()["phases"]["extend"]["drops_last_key"]
    assert (stats["plans"], stats["sampled"], stats["checked"]) == (25, 3, 3)


def test_no_extend_sampling_while_capturing(drops, monkeypatch):
    """A plan made while a CUDA graph is captured is neither counted nor sampled (CPU: capture simulated)."""
    sel = _hand_made(PhaseChoice("drops_last_key", "auto", _auto("drops_last_key", "torch")), every=1)
    batch = make_batch(SPEC, SMALL, seed=8)
    monkeypatch.setattr(canary_mod, "capturing", lambda t: True)
    for _ in range(3):
        run = _plan(sel, batch, checked=False)
        assert run.__name__ == "short_run"  # the backend's own run function: no wrapper
        run(batch.q, batch.k_cache, batch.v_cache)
    assert sel.canary.report()["phases"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_canary_gpu_extend_sampled_run_makes_no_host_sync(drops):
    """On the GPU the sampled extend run copies its inputs on a side stream without a host sync (torch's sync debug
    mode raises on one); a later plan reads the check once the side stream is done and demotes drops_last_key."""
    spec = AttentionSpec(8, 2, 128, "bf16", page_size=16)
    sel = _hand_made(PhaseChoice("drops_last_key", "auto", _auto("drops_last_key", "torch")), every=1, spec=spec,
                     device="cuda")
    batch = make_batch(spec, [(3, 300), (0, 17), (2, 0), (64, 1000), (1, 1)] * 4, seed=9, device="cuda")
    drops.good = 0
    run = _plan(sel, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(batch.q, batch.k_cache, batch.v_cache)  # wrong, sampled
        out.fill_(0.0)  # the engine reuses the buffer at once: the canary judges its copy
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ran = []
    for _ in range(100):  # later plans read the check once the side stream is done
        ran.append(_step(sel, batch, drops))
        if ran[-1] == "torch":
            break
        torch.cuda.synchronize()
    assert ran[-1] == "torch", ran
    assert sel.canary.mismatches()[("extend", "drops_last_key")] >= 1
    sel.canary.drain()
    assert sel.canary.report()["phases"]["extend"]["torch"]["mismatches"] == 0
