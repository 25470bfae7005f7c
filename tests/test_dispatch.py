"""Dispatch table (issue 10): bucket boundaries, dispatch from injected timings, untimed shapes, graph-mode decode by
batch size, the cache round trip, the JSON schema, and the checked run functions. No GPU: timings are made by hand
(the real worker runs once, on the CPU grid)."""
import dataclasses
import json
import logging
import math
import re
import types

import pytest
import torch

import attnsel.backends as backends_mod
import attnsel.selection as selection
from attnsel import AttentionSpec, SelectionError, select
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.selection import DispatchTable, PhaseChoice, Selection, build_table
from attnsel.validate import runner, timing
from attnsel.validate.cases import cumulative

SPEC = AttentionSpec(4, 2, 64, "fp16")


def measured(phase, mode, cells, axes=None):
    """timing.measure's result from {key tuple: {name: us}}."""
    axes = axes or (timing.PREFILL_AXES if phase == "prefill" else timing.DECODE_AXES)
    buckets = [{"key": list(k), "label": "x".join(map(str, k)), "us": dict(t), "spread": {n: 0.01 for n in t},
                "errors": {}} for k, t in cells.items()]
    return {"phase": phase, "mode": mode, "grid_version": timing.GRID_VERSION, "axes": list(axes), "reps": 7,
            "buckets": buckets, "skipped": [], "wall_s": 1.0}


DECODE = {(1, 256): {"a": 10.0, "b": 12.0}, (1, 1024): {"a": 20.0, "b": 19.0},
          (4, 256): {"a": 30.0, "b": 20.0}, (4, 1024): {"a": 40.0, "b": 60.0},
          (16, 256): {"a": 50.0, "b": 49.6}, (16, 1024): {"a": 80.0, "b": 70.0}}


def test_bucket_boundaries_are_log_midpoints_and_clamp():
    table = build_table(measured("decode", "eager", DECODE), ["a", "b"])
    assert table.axes == ("batch", "context")
    # batch boundaries at sqrt(1*4)=2 and sqrt(4*16)=8; context boundary at sqrt(256*1024)=512
    assert table.cell((1, 256)) == (0, 0)
    assert table.cell((2, 256)) == (1, 0)  # a boundary value belongs to the upper bucket
    assert table.cell((7, 511)) == (1, 0)
    assert table.cell((8, 512)) == (2, 1)
    assert table.cell((0, 0)) == (0, 0)  # clamped at the low end
    assert table.cell((10**6, 10**9)) == (2, 1)  # and at the high end
    assert table.bucket_for((3, 300)).key == (4, 256)
    assert table.bucket_for((100_000, 2_000_000)).key == (16, 1024)


def test_dispatch_from_injected_timings_ties_go_by_priority():
    table = build_table(measured("decode", "eager", DECODE), ["a", "b"])
    got = {b.key: (b.backend, b.runner_up) for b in table.buckets}
    assert got[(1, 256)] == ("a", "b")  # fastest
    assert got[(1, 1024)] == ("b", "a")  # 20 vs 19: a is 5.3% slower, outside the tie band
    assert got[(4, 256)] == ("b", "a")
    assert got[(4, 1024)] == ("a", "b")
    assert got[(16, 256)] == ("a", "b")  # 50 vs 49.6: within 1%, "a" is first in priority
    assert got[(16, 1024)] == ("b", "a")
    b = table.bucket_for((4, 256))
    assert b.us == 20.0 and b.runner_up_us == 30.0 and b.ratio == pytest.approx(1.5)
    # the priority order decides ties: with b first, b keeps the 50-vs-49.6 bucket
    assert build_table(measured("decode", "eager", DECODE), ["b", "a"]).backend_for((16, 256)) == "b"
    # only usable candidates may win: a rejected candidate's times are ignored
    only_b = build_table(measured("decode", "eager", DECODE), ["a", "b"], usable={"b"})
    assert {b.backend for b in only_b.buckets} == {"b"}


def test_tie_band_is_one_percent():
    cells = {(1, 256): {"a": 10.1, "b": 10.0}, (4, 256): {"a": 10.11, "b": 10.0}, (16, 256): {"a": 10.2, "b": 10.0}}
    table = build_table(measured("decode", "eager", cells), ["a", "b"])
    assert table.backend_for((1, 256)) == "a"  # 1.0% slower: a tie, priority decides
    assert table.backend_for((4, 256)) == "b"  # 1.1% slower: b wins
    assert table.backend_for((16, 256)) == "b"  # 2% slower (a tie under the earlier 3% band): b wins


def test_untimed_shapes_take_the_nearest_timed_bucket():
    cells = dict(DECODE)
    del cells[(16, 1024)]  # e.g. capped: its KV would exceed the timing memory cap
    table = build_table(measured("decode", "eager", cells), ["a", "b"])
    # batch 16 x ctx 4096 (clamped to 16 x 1024: the longest timed context) is nearest to 4x1024 and 16x256, both
    # 2 octaves away in log space: the tie goes to the earlier timed bucket (grids are timed coarse first)
    assert table.bucket_for((16, 4096)).key == (4, 1024)
    assert table.bucket_for((20, 200)).key == (16, 256)
    # prefill: a ragged batch that matches no representative goes to the nearest in (seqs, tokens, longest)
    pre = {(1, 64, 64): {"a": 5.0, "b": 9.0}, (1, 4096, 4096): {"a": 900.0, "b": 800.0},
           (16, 1024, 64): {"a": 50.0, "b": 20.0}, (16, 3008, 2048): {"a": 300.0, "b": 500.0}}
    ptable = build_table(measured("prefill", "eager", pre), ["a", "b"])
    assert ptable.axes == ("num_seqs", "total_tokens", "longest")
    assert ptable.backend_for((1, 100, 100)) == "a"
    assert ptable.backend_for((1, 12000, 12000)) == "b"  # clamped to the longest timed prompt
    assert ptable.backend_for((12, 800, 70)) == "b"  # many short sequences
    assert ptable.bucket_for((10, 2500, 2000)).key == (16, 3008, 2048)  # one long prompt among short ones


def test_graph_mode_decode_buckets_by_batch_only():
    cells = {(1, 256): {"a": 10.0, "b": 12.0}, (1, 16384): {"a": 200.0, "b": 100.0},
             (8, 256): {"a": 10.0, "b": 30.0}, (8, 16384): {"a": 300.0, "b": 290.0}}
    table = build_table(measured("decode", "graph", cells), ["a", "b"])
    assert table.axes == ("batch",)
    assert [b.key for b in table.buckets] == [(1,), (8,)]
    # batch 1: geometric means a sqrt(10*200)=44.7, b sqrt(12*100)=34.6 -> b, although a wins the short context
    one = table.bucket_for((1,))
    assert one.backend == "b" and one.us == pytest.approx(math.sqrt(1200)) and one.runner_up == "a"
    assert table.backend_for((8,)) == "a"
    assert one.label == "batch 1 (ctx 256-16384)"
    sel = _selection({"decode": PhaseChoice("b", "auto", [], table)}, mode="graph")
    assert sel.decode_backend_for(1, 256) == "b"  # the context length plays no part
    assert sel.decode_backend_for(1, 10**6) == "b"
    assert sel.decode_backend_for(6, 256) == "a"


def test_headline_backend_is_the_best_single_backend():
    table = build_table(measured("decode", "eager", DECODE), ["a", "b"])
    ga = math.prod(t["a"] for t in DECODE.values()) ** (1 / 6)
    gb = math.prod(t["b"] for t in DECODE.values()) ** (1 / 6)
    assert table.default == ("a" if ga <= gb * 1.03 else "b")
    assert table.wins() == {"a": 3, "b": 3}


def test_table_json_round_trip():
    table = build_table(measured("decode", "graph", DECODE), ["a", "b"])
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.to_json() == table.to_json()
    assert again.backend_for((3,)) == table.backend_for((3,))


def test_table_json_keeps_the_lookup_tie_band():
    """Review finding: to_json dropped ``tie``; a table with another band came back with the default one (and
    served other backends between timed shapes)."""
    table = dataclasses.replace(build_table(measured("decode", "eager", DECODE), ["a", "b"]), tie=0.5)
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.tie == 0.5 and again == table


def test_a_key_of_the_wrong_length_is_named():
    """Review finding: zip() truncated (4,) or (4, 512, 99) on a (batch, context) table and answered anyway."""
    table = build_table(measured("decode", "eager", DECODE), ["a", "b"])
    for key in ((4,), (4, 512, 99), ()):
        for lookup in (table.backend_for, table.bucket_for, table.cell):
            with pytest.raises(ValueError, match=r"^a decode dispatch table \(eager\) is keyed by \(batch, context\), "
                                                 rf"got {re.escape(repr(key))}$"):
                lookup(key)


# ---- end to end through select(), with the worker replaced by injected results ----

def fake_worker(monkeypatch, timings: dict, calls: list):
    """runner.run_tasks that validates every candidate as valid and returns ``timings[phase]`` for timing tasks."""

    def run_tasks(spec, tasks, *, device, timeout=None, measure=False, mode="eager"):
        calls.append((list(tasks), measure))
        out = {}
        for name, phase in tasks:
            if name == timing.TIMING_TASK:
                wanted = [n for n in measure[phase]["backends"]]
                data = json.loads(json.dumps(timings[phase]))
                for b in data["buckets"]:
                    b["us"] = {n: t for n, t in b["us"].items() if n in wanted}
                out[(name, phase)] = {"status": "timed", "reason": "", "measured": data, "time_s": 1.0}
            else:
                out[(name, phase)] = {"status": "valid", "reason": "", "max_abs_err": 1e-3, "tolerance": 1e-2,
                                      "time_s": 0.1}
        return out, runner.RunStats(spawns=1, wall_s=1.0)

    monkeypatch.setattr(runner, "run_tasks", run_tasks)


PRE = {(1, 64, 64): {"torch": 5.0, "triton": 9.0}, (16, 1024, 64): {"torch": 50.0, "triton": 20.0}}
DEC = {(1, 256): {"torch": 10.0, "triton": 20.0}, (64, 256): {"torch": 90.0, "triton": 30.0}}


def test_select_builds_and_caches_the_tables(monkeypatch):
    calls = []
    fake_worker(monkeypatch, {"prefill": measured("prefill", "eager", PRE),
                              "decode": measured("decode", "eager", DEC)}, calls)
    order = ["triton", "torch"]
    cold = select(SPEC, prefill_priority=order, decode_priority=order)
    assert cold.cache == "miss" and len(calls) == 1
    tasks = calls[0][0]
    assert tasks[-2:] == [(timing.TIMING_TASK, "prefill"), (timing.TIMING_TASK, "decode")]  # after validation
    assert calls[0][1]["decode"]["backends"] == order
    assert cold.dispatch["decode"].backend_for((1, 300)) == "torch"
    assert cold.dispatch["decode"].backend_for((100, 300)) == "triton"
    assert cold.prefill_backend_for(1, 64, 64) == "torch" and cold.prefill_backend_for(20, 1200, 60) == "triton"
    statuses = {c.name: c.status for c in cold.candidates["decode"]}
    assert statuses[cold.decode] == "selected"
    assert all(c.score_us for c in cold.candidates["decode"])
    warm = select(SPEC, prefill_priority=order, decode_priority=order)
    assert len(calls) == 1  # no worker: validation and tables from the cache
    assert warm.cache == "hit"
    for phase in ("prefill", "decode"):
        assert warm.dispatch[phase].to_json() == cold.dispatch[phase].to_json()
    # another bucket grid version is another table: timed again, validation still cached
    monkeypatch.setattr(timing, "GRID_VERSION", timing.GRID_VERSION + 1)
    again = select(SPEC, prefill_priority=order, decode_priority=order)
    assert len(calls) == 2 and all(t[0] == timing.TIMING_TASK for t in calls[1][0])
    assert calls[1][1]["decode"]["vouched"] == order
    assert again.cache == "miss"


def test_priority_and_explicit_choices_have_no_table(monkeypatch):
    calls = []
    fake_worker(monkeypatch, {}, calls)
    sel = select(SPEC, policy="priority", prefill_priority=["triton", "torch"], decode_priority=["triton", "torch"])
    assert sel.dispatch == {"prefill": None, "decode": None}
    assert all(t[0] != timing.TIMING_TASK for t in calls[0][0])
    assert sel.decode_backend_for(1, 10) == sel.decode_backend_for(256, 10**5) == "triton"
    explicit = select(SPEC, prefill="torch", decode="torch")
    assert explicit.dispatch == {"prefill": None, "decode": None}
    assert explicit.prefill_backend_for(64, 4096, 64) == "torch"


def test_timing_failure_falls_back_to_priority_with_a_reason(monkeypatch):
    def run_tasks(spec, tasks, *, device, timeout=None, measure=False, mode="eager"):
        out = {t: {"status": "valid", "reason": "", "max_abs_err": 1e-3, "tolerance": 1e-2, "time_s": 0.1}
               for t in tasks if t[0] != timing.TIMING_TASK}
        for t in tasks:
            if t[0] == timing.TIMING_TASK:
                out[t] = {"status": "rejected", "reason": "worker died with SIGSEGV while running @timing decode",
                          "time_s": None}
        return out, runner.RunStats(spawns=1)

    monkeypatch.setattr(runner, "run_tasks", run_tasks)
    sel = select(SPEC, prefill_priority=["triton", "torch"], decode_priority=["triton", "torch"])
    assert sel.dispatch["decode"] is None and sel.decode == "triton"
    assert "not timed: worker died with SIGSEGV" in sel.candidates["decode"][0].reason


def test_the_real_worker_times_the_cpu_grid_interleaved():
    sel = select(SPEC, prefill_priority=["triton", "torch"], decode_priority=["triton", "torch"])
    for phase in ("prefill", "decode"):
        table = sel.dispatch[phase]
        assert table is not None and table.grid_version == timing.GRID_VERSION
        labels = [b.label for b in table.buckets]
        assert labels == ([timing.prefill_label(l) for l in timing.CPU_PREFILL] if phase == "prefill"
                          else [f"{b}x{c}" for b, c in timing.CPU_DECODE])
        for b in table.buckets:
            assert set(b.times_us) == {"triton", "torch"} and all(v > 0 for v in b.times_us.values())
            assert set(b.spread) == {"triton", "torch"}
    assert sel.stats["spawns"] == 1 and sel.stats["timing_wall_s"] > 0


# ---- plan-time dispatch and the checked run functions ----

class Recorder:
    """torch's kernels under another name; remembers which backend planned."""

    planned: list = []

    def __init__(self, name):
        self.name = name
        self.version = "test"

    def unsupported(self, spec, phase):
        return None

    def plan_prefill(self, spec, *args):
        Recorder.planned.append(self.name)
        return TORCH.plan_prefill(spec, *args)

    def plan_decode(self, spec, page_table, seq_lens):
        Recorder.planned.append(self.name)
        if page_table.is_meta:  # dispatch must not need the data: a meta tensor has none
            return lambda q, k, v: q
        return TORCH.plan_decode(spec, page_table, seq_lens)


RECORDERS = [Recorder("rec_a"), Recorder("rec_b")]


def _selection(phases, mode="eager", spec=SPEC):
    full = {"prefill": PhaseChoice("torch", "explicit", []), "decode": PhaseChoice("torch", "explicit", [])}
    full.update(phases)
    return Selection(spec, full, "measure", mode, "off", {}, {})


def test_plan_decode_dispatches_from_host_sizes_without_reading_tensors(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_dispatch:RECORDERS")
    cells = {(1, 256): {"rec_a": 1.0, "rec_b": 2.0}, (1, 4096): {"rec_a": 9.0, "rec_b": 2.0},
             (32, 256): {"rec_a": 9.0, "rec_b": 2.0}, (32, 4096): {"rec_a": 9.0, "rec_b": 2.0}}
    sel = _selection({"decode": PhaseChoice("rec_b", "auto", [],
                                            build_table(measured("decode", "eager", cells), ["rec_a", "rec_b"]))})
    Recorder.planned.clear()
    meta = dict(device="meta", dtype=torch.int32)
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), max_seq_len=300)
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), max_seq_len=5000)
    # without max_seq_len the page table's width decides: 20 pages x 16 = 320 tokens
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta))
    sel.plan_decode(torch.empty(40, 20, **meta), torch.empty(40, **meta), max_seq_len=300)
    # context_tokens (the batch's context tokens, summed) decides over max_seq_len: one long row among short ones is
    # bucketed by its mean context, 2 rows x 300 tokens on average
    sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), max_seq_len=5000, context_tokens=600)
    assert Recorder.planned == ["rec_a", "rec_b", "rec_a", "rec_b", "rec_a"]
    with pytest.raises(ValueError, match="^context_tokens: expected None or a non-negative Python int"):
        sel.plan_decode(torch.empty(2, 20, **meta), torch.empty(2, **meta), context_tokens=torch.tensor(600))


def test_plan_prefill_dispatches_on_seqs_tokens_longest(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_dispatch:RECORDERS")
    cells = {(1, 64, 64): {"rec_a": 1.0, "rec_b": 2.0}, (16, 1024, 64): {"rec_a": 9.0, "rec_b": 2.0}}
    sel = _selection({"prefill": PhaseChoice("rec_a", "auto", [],
                                             build_table(measured("prefill", "eager", cells), ["rec_a", "rec_b"]))})
    Recorder.planned.clear()
    cu = cumulative([40, 50], "cpu")
    run = sel.plan_prefill(cu, cu, 50, 50, total_q=90)
    sel.plan_prefill(cumulative([60] * 12, "cpu"), cumulative([60] * 12, "cpu"), 60, 60)  # total_q: 12 x 60
    assert Recorder.planned == ["rec_a", "rec_b"]
    q = torch.randn(90, 4, 64, dtype=torch.float16)
    k, v = torch.randn(90, 2, 64, dtype=torch.float16), torch.randn(90, 2, 64, dtype=torch.float16)
    ref = TORCH.plan_prefill(SPEC, cu, cu, 50, 50)(q, k, v)
    assert torch.equal(run(q, k, v), ref)  # the check changes nothing


@pytest.mark.parametrize("arg,value,allowed", [
    ("total_q", torch.tensor(9), "a non-negative Python int"), ("total_k", torch.tensor(9), "a non-negative Python int"),
    ("total_q", -3, "a non-negative Python int"), ("total_q", "9", "a non-negative Python int"),
    ("total_q", float("nan"), "a non-negative Python int"), ("total_q", True, "a non-negative Python int"),
    ("total_k", 2.0, "a non-negative Python int"),
])
def test_plan_prefill_names_a_bad_total(arg, value, allowed):
    """total_q / total_k key the dispatch and check the run's token counts: a tensor there was read (a device sync;
    on a meta tensor a RuntimeError), a negative or impossible count was accepted at plan time and failed only at
    run time without naming the argument (review, 2026-12-05). A count above sequences x longest stays allowed: q
    may carry padding rows past the last sequence."""
    sel = _selection({})
    cu = cumulative([5, 7], "cpu")
    with pytest.raises(ValueError, match=rf"^{arg}: expected None or {re.escape(allowed)}"):
        sel.plan_prefill(cu, cu, 7, 7, **{arg: value})


def _prefill_run(total_k=None):
    sel = _selection({})
    cu = cumulative([5, 7], "cpu")
    return sel.plan_prefill(cu, cu, 7, 7, 12, total_k=total_k)


H = dict(dtype=torch.float16)


@pytest.mark.parametrize("args, message", [
    (((12, 3, 64), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [12, 3, 64] fp16 on cpu"),
    (((12, 4, 32), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [12, 4, 32] fp16 on cpu"),
    (((11, 4, 64), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [11, 4, 64] fp16 on cpu"),
    (((12, 4, 64), (12, 4, 64), (12, 4, 64)), "k: expected [*, 2, 64] fp16 on cpu, got [12, 4, 64] fp16 on cpu"),
    (((12, 4, 64), (12, 2, 64), (10, 2, 64)), "v: expected [12, 2, 64] fp16 on cpu, got [10, 2, 64] fp16 on cpu"),
    (((4, 64), (12, 2, 64), (12, 2, 64)), "q: expected [12, 4, 64] fp16 on cpu, got [4, 64] fp16 on cpu"),
])
def test_prefill_run_names_the_bad_argument(args, message):
    run = _prefill_run()
    tensors = [torch.zeros(s, **H) for s in args]
    with pytest.raises(ValueError) as exc:
        run(*tensors)
    assert str(exc.value) == message


def test_prefill_run_checks_dtype_token_count_and_features():
    run = _prefill_run(total_k=12)
    q, k, v = torch.zeros(12, 4, 64, **H), torch.zeros(12, 2, 64, **H), torch.zeros(12, 2, 64, **H)
    with pytest.raises(ValueError, match=r"^q: expected \[12, 4, 64\] fp16 on cpu, got \[12, 4, 64\] bf16 on cpu$"):
        run(q.bfloat16(), k, v)
    with pytest.raises(ValueError, match=r"^k: expected \[12, 2, 64\] fp16 on cpu, got \[13, 2, 64\] fp16 on cpu$"):
        run(q, torch.zeros(13, 2, 64, **H), torch.zeros(13, 2, 64, **H))
    with pytest.raises(ValueError, match=r"^v: expected \[12, 2, 64\] fp16 on cpu, got \[12, 2, 64\] fp32 on cpu$"):
        run(q, k, v.float())
    with pytest.raises(ValueError, match="^sinks: given, but the spec has no attention sinks"):
        run(q, k, v, sinks=torch.zeros(4))
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        run(q, k, v, window=3)
    assert run(q, k, v).shape == (12, 4, 64)


def test_decode_run_names_the_bad_argument():
    sel = _selection({})
    page_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    run = sel.plan_decode(page_table, seq_lens, 20)
    q, kc = torch.zeros(2, 4, 64, **H), torch.zeros(4, 16, 2, 64, **H)
    with pytest.raises(ValueError) as exc:
        run(torch.zeros(3, 4, 64, **H), kc, kc)
    assert str(exc.value) == "q: expected [2, 4, 64] fp16 on cpu, got [3, 4, 64] fp16 on cpu"
    with pytest.raises(ValueError) as exc:
        run(q, torch.zeros(4, 8, 2, 64, **H), kc)
    assert str(exc.value) == "k_cache: expected [*, 16, 2, 64] fp16 on cpu, got [4, 8, 2, 64] fp16 on cpu"
    with pytest.raises(ValueError) as exc:
        run(q, kc, kc.bfloat16())
    assert str(exc.value) == "v_cache: expected [4, 16, 2, 64] fp16 on cpu, got [4, 16, 2, 64] bf16 on cpu"
    with pytest.raises(ValueError, match="^v_cache: expected .* got None$"):
        run(q, kc, None)
    look_alike = types.SimpleNamespace(shape=(4, 16, 2, 64), dtype=torch.float16)  # no tensor methods
    with pytest.raises(ValueError, match="^v_cache: expected .* got SimpleNamespace$"):
        run(q, kc, look_alike)
    with pytest.raises(ValueError, match="^k_scale: given, but the spec's KV cache is fp16"):
        run(q, kc, kc, k_scale=torch.ones(1))
    assert torch.equal(run(q, kc, kc), TORCH.plan_decode(SPEC, page_table, seq_lens)(q, kc, kc))


def test_decode_run_checks_feature_inputs_the_spec_asks_for():
    spec = AttentionSpec(4, 2, 64, "fp16", sinks=True)
    sel = _selection({}, spec=spec)
    run = selection.checked_decode(lambda q, k, v, **kw: q, spec, -1, 2)
    q, kc = torch.zeros(2, 4, 64, **H), torch.zeros(4, 16, 2, 64, **H)
    with pytest.raises(ValueError, match=r"^sinks: expected \[4\] fp32 \(the spec has attention sinks\), got None$"):
        run(q, kc, kc)
    assert run(q, kc, kc, sinks=torch.zeros(4)) is q
    assert sel.spec.sinks


def test_selection_error_carries_what_was_found(monkeypatch):
    with pytest.raises(SelectionError) as exc:
        select(SPEC, prefill="fa3", policy="priority", decode_priority=["torch"])
    found = exc.value.selection
    assert found is not None and found.phases["prefill"].backend == ""
    assert "requested explicitly but is unavailable" in found.phases["prefill"].error
    assert found.decode == "torch"
    import pickle

    assert pickle.loads(pickle.dumps(exc.value)).selection.decode == "torch"  # survives the rank-0 broadcast


# ---- the timing rules (HBM rotation, interleaving) and the bench grid ----

@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (28, 4)])
def test_every_timed_bucket_rotates_more_than_twice_the_l2(monkeypatch, heads):
    """Rotation covers the H200's 50 MB L2 twice over for every bucket of the real (GPU) grids."""
    monkeypatch.setattr(timing, "l2_bytes", lambda device: 50 << 20)
    spec = AttentionSpec(*heads, 128, "bf16", 16)
    cuda = torch.device("cuda")  # only its type is read: nothing is allocated
    item = 2
    for _, b, c in timing.decode_grid(spec, cuda, sms=132):
        kv_set = 2 * b * math.ceil(c / 16) * 16 * spec.num_kv_heads * 128 * item + b * spec.num_q_heads * 128 * item
        assert timing.num_sets(kv_set, cuda) * kv_set >= 2 * (50 << 20), (b, c)
    for _, lens in timing.prefill_grid(spec, cuda):
        t = sum(lens)
        qkv = t * (spec.num_q_heads + 2 * spec.num_kv_heads) * 128 * item
        assert timing.num_sets(qkv, cuda) * qkv >= 2 * (50 << 20), lens


def test_grids_are_coarse_first_and_within_the_caps():
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")
    dec = timing.decode_grid(spec, cuda)
    levels = [lvl for lvl, _, _ in dec]
    assert levels == sorted(levels) and levels[0] == 0
    coarse = {(b, c) for lvl, b, c in dec if lvl == 0}
    first, last = timing.DECODE_CTX[0], timing.DECODE_CTX[-1]
    assert (1, first) in coarse and (256, first) in coarse and (1, last) in coarse  # both ends of every axis
    assert timing.DECODE_CTX == (288, 544, 1056, 2080, 4128, 8224, 16416)  # half a 64-token tile past a power of 2
    assert {c for lvl, _, c in dec if lvl == 0} == {288, 1056, 4128, 16416}  # every other one and both ends
    base = dict(zip(timing.DECODE_CTX, timing.DECODE_CTX_POW2))  # the cap goes by the power of two below
    assert all(timing.decode_bytes(spec, b, base[c]) <= timing.MAX_DECODE_KV_BYTES for _, b, c in dec)
    # every bucket the power-of-two grid had under the cap is there, 32 tokens on (the review found 64 x 16384,
    # 128 x 8192 and 256 x 4096 pushed over the 4 GiB cap by the half tile)
    pow2 = {(b, p) for b in timing.DECODE_BATCHES for p in timing.DECODE_CTX_POW2
            if timing.decode_bytes(spec, b, p) <= timing.MAX_DECODE_KV_BYTES}
    assert {(b, c - timing.DECODE_TILE_TAIL) for _, b, c in dec} == pow2
    assert {(64, 16416), (128, 8224), (256, 4128)} <= {(b, c) for _, b, c in dec}
    assert all(sum(lens) <= timing.MAX_PREFILL_TOKENS for _, lens in timing.prefill_grid(spec, cuda))


class Logged:
    """A fake backend that logs (its name, the id of the q it ran on) for every run call."""

    calls: list = []

    def __init__(self, name):
        self.name = name

    def plan_decode(self, spec, page_table, seq_lens):
        run = TORCH.plan_decode(spec, page_table, seq_lens)
        return lambda q, k, v: (Logged.calls.append((self.name, id(q))), run(q, k, v))[1]


def test_candidates_are_interleaved_and_rotate_the_input_sets(monkeypatch):
    monkeypatch.setattr(timing, "num_sets", lambda nbytes, device: 3)
    Logged.calls.clear()
    cands = {"a": Logged("a"), "b": Logged("b"), "c": Logged("c")}
    out = timing.time_bucket(cands, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=3)
    assert set(out["us"]) == {"a", "b", "c"} and not out["errors"]
    timed = Logged.calls[3 + 3:-6]  # after one warm-up call and one calibration sample each, before the checks (2 each)
    assert [n for n, _ in timed] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # round-robin, rotated start
    sets = [q for _, q in Logged.calls[3:-6]]  # from calibration on: one shared cursor over the 3 input sets
    assert len(set(sets)) == 3
    assert all(sets[i] != sets[i + 1] for i in range(len(sets) - 1))  # never the set the previous call just read


def test_a_candidate_that_fails_in_a_bucket_gets_no_time_there():
    class Broken:
        name = "broken"

        def plan_decode(self, spec, page_table, seq_lens):
            raise RuntimeError("no kernel for this shape\nlong trace")

    out = timing.time_bucket({"torch": TORCH, "broken": Broken()}, SPEC, "decode", (2, 32), torch.device("cpu"),
                             "eager", reps=2)
    assert set(out["us"]) == {"torch"}
    assert out["errors"] == {"broken": "plan or first run failed: RuntimeError: no kernel for this shape"}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("phase,shape", [("prefill", [9, 4]), ("decode", (2, 32))])
def test_a_candidate_fast_and_wrong_when_timed_gets_no_time(phase, shape, mode, monkeypatch):
    """A plan right on its first runs (so it passes validation) that skips work once run many times must not win a
    bucket: the timing checks what the timed plan computed. Graph mode on CPU: the capture is a loop of calls."""
    from tests.fixtures import fault_numerics as faults

    class ReplayLoop:  # what a CUDA graph does on replay: the captured calls write into the captured outputs
        def __init__(self, run, sets):
            self.run, self.sets = run, sets
            self.outs = [run(*s) for s in sets]

        def replay(self):
            for out, s in zip(self.outs, self.sets):
                out.copy_(self.run(*s))

    if mode == "graph":
        monkeypatch.setattr(timing, "capture", lambda run, sets, device: (lambda g: (g, g.outs))(ReplayLoop(run, sets)))
    monkeypatch.setattr(timing, "num_sets", lambda nbytes, device: 3)
    cands = {"torch": TORCH, "stale_when_timed": faults.STALE_WHEN_TIMED, "skip_work": faults.SKIP_WORK,
             "one_buffer": faults.ONE_BUFFER}
    out = timing.time_bucket(cands, SPEC, phase, shape, torch.device("cpu"), mode, reps=2)
    assert set(out["us"]) == {"torch", "one_buffer"}, out  # one plan-owned output buffer is fine when recomputed
    reason = out["errors"]["stale_when_timed"]
    assert reason.startswith(f"wrong output after the timed {mode} runs: input set ") and "exceeds tolerance" in reason
    assert "NaN or inf in the output" in out["errors"]["skip_work"]  # its stale right answer was cleared first


def test_graph_timing_keeps_each_plan_alive_as_long_as_its_graph(monkeypatch):
    """A CUDA graph holds device pointers, not Python references: the timing must keep each candidate's run function
    (and the buffers its plan allocated) alive while the graph is replayed. On the H200 the Triton plan's split buffers
    were freed after capture, handed to the torch plan's gather indices, and overwritten by Triton's replays (device
    assert in torch's gather, 2026-12-03). Here the fake capture, like a real graph, keeps no reference to run."""
    import gc
    import types
    import weakref

    monkeypatch.setattr(timing, "capture", lambda run, sets, device: (
        types.SimpleNamespace(replay=lambda: None), [run(*s) for s in sets]))
    refs = []

    class Tracked:
        name = "tracked"

        def plan_decode(self, spec, page_table, seq_lens):
            inner = TORCH.plan_decode(spec, page_table, seq_lens)

            def run(q, k, v):
                return inner(q, k, v)

            refs.append(weakref.ref(run))
            return run

    plan_args, sets = timing.rotated_workloads(SPEC, "decode", (2, 32), torch.device("cpu"))
    item = timing._prepare(Tracked(), SPEC, "decode", plan_args, sets, "graph", torch.device("cpu"))
    gc.collect()
    assert refs[0]() is not None, "the plan died while its graph can still be replayed"
    item.unit(0)
    del item
    gc.collect()
    assert refs[0]() is None


def test_bench_grid_differs_from_the_timed_buckets():
    from attnsel import bench

    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")
    timed_pre = {timing.prefill_key(lens) for _, lens in timing.prefill_grid(spec, cuda)}
    timed_dec = {(b, c) for _, b, c in timing.decode_grid(spec, cuda, sms=132)}
    pre = bench.shapes(spec, "prefill", quick=False)
    dec = bench.shapes(spec, "decode", quick=False)
    assert pre and dec and not {k for _, k, _, _ in pre} & timed_pre and not {k for _, k, _, _ in dec} & timed_dec
    assert any(label.startswith("ragged") for label, _, _, _ in dec)


def test_bench_compares_selected_one_backend_and_static_priority():
    from attnsel import bench

    cells = {(1, 256): {"fa3": 12.0, "flashinfer": 10.0}, (64, 256): {"fa3": 20.0, "flashinfer": 30.0}}
    table = build_table(measured("decode", "eager", cells), ["flashinfer", "fa3"])
    sel = _selection({"decode": PhaseChoice(table.default, "auto", [], table)})
    row = [bench.Cell({}, "decode", "48x200", "eager", n, us, 1.0, vs_best=us / 20.0)
           for n, us in (("fa3", 20.0), ("flashinfer", 31.0))]
    got = bench.compare(AttentionSpec(32, 8, 128), "decode", "eager", "48x200", (48, 200), row, ["fa3", "flashinfer"],
                        sel)
    assert got["fastest"] == "fa3" and got["selected"] == "fa3" and got["selected_ratio"] == 1.0
    assert got["static"] == "fa3"
    assert got["one_backend"] == table.default
    summary = bench.summarise([got, {**got, "shape": "x", "selected": "flashinfer", "selected_ratio": 1.2}])
    sel_row = next(s for s in summary if s["strategy"] == "selected")
    assert sel_row["within_tie"] == 1 and sel_row["worst"] == 1.2
    assert sel_row["geomean"] == pytest.approx(math.sqrt(1.2))


def test_bench_plumbing_on_tiny_cpu_shapes(monkeypatch, tmp_path):
    """run_grid -> compare -> summarise -> markdown end to end (the real timing on CPU, tiny shapes)."""
    from attnsel import bench

    monkeypatch.setattr(bench, "QUICK_PREFILL", [[8], [5, 3]])
    monkeypatch.setattr(bench, "QUICK_DECODE", [(1, 20), [5, 17]])
    monkeypatch.setattr(timing, "REPS", 2)
    cpu = torch.device("cpu")
    probe = {"copy_tbps": 1.0, "read_tbps": 1.0}
    cells, checks, groups = bench.run_grid(SPEC, ["torch", "triton"], ["eager"], True, cpu, probe, lambda m: None)
    assert checks == {"prefill": {"torch": "", "triton": ""}, "decode": {"torch": "", "triton": ""}}
    assert [g[2] for g in groups] == ["1x8", "2 seqs, 8 tok, max 5", "1x20", "ragged 2 (max 17)"]
    assert all(c.us and c.vs_best >= 1 for c in cells)
    table = build_table(measured("decode", "eager", {(1, 20): {"torch": 1.0, "triton": 2.0},
                                                     (2, 17): {"torch": 2.0, "triton": 1.0}}), ["triton", "torch"])
    sel = _selection({"decode": PhaseChoice(table.default, "auto", [], table)})
    rows = [bench.compare(SPEC, *g[:4], g[4], g[5], sel) for g in groups]
    assert rows[3]["selected"] == "triton" and rows[2]["selected"] == "torch"
    assert rows[0]["selected"] == "torch" and rows[0]["static"] == "triton"
    text = bench.markdown(cells, probe, rows, bench.summarise(rows), "# header")
    assert "| ragged 2 (max 17) |" in text and "| 4/2 d64 fp16 | decode | eager | selected |" in text


def test_bench_repeats_take_the_median_and_check_the_first_pass(monkeypatch):
    """With repeats, a cell's time is the median over whole passes, an error in any pass removes the backend's time,
    and the "repeat" verdict judges the first pass's fastest by the later passes (its noise floor)."""
    from attnsel import bench

    monkeypatch.setattr(bench, "QUICK_PREFILL", [[8]])
    monkeypatch.setattr(bench, "QUICK_DECODE", [(1, 20)])
    monkeypatch.setattr(bench, "valid_backends", lambda spec, phase, names, device: {n: "" for n in names})
    # per pass: (prefill times, decode times); triton is faster in pass 1 and slower in passes 2 and 3 (prefill) or
    # fails in pass 2 (decode)
    script = [({"torch": 10.0, "triton": 9.0}, {"torch": 5.0, "triton": 4.0}),
              ({"torch": 10.0, "triton": 12.0}, {"torch": 5.0, "triton": None}),
              ({"torch": 11.0, "triton": 13.0}, {"torch": 7.0, "triton": 6.0})]
    calls = []

    def fake_time_bucket(cands, spec, phase, shape, device, mode, reps):
        times = script[len(calls) // 2][0 if phase == "prefill" else 1]
        calls.append((phase, shape))
        return {"us": {n: t for n, t in times.items() if t}, "spread": {n: 0.01 for n, t in times.items() if t},
                "errors": {n: "output wrong" for n, t in times.items() if not t}}

    monkeypatch.setattr(bench.timing, "time_bucket", fake_time_bucket)
    probe = {"copy_tbps": 1.0, "read_tbps": 1.0}
    cells, _, groups = bench.run_grid(SPEC, ["torch", "triton"], ["eager"], True, torch.device("cpu"), probe,
                                      lambda m: None, repeats=3)
    assert [c[0] for c in calls] == ["prefill", "decode"] * 3  # whole passes, one after another
    by = {(c.phase, c.backend): c for c in cells}
    assert by["prefill", "triton"].us == 12.0 and by["prefill", "triton"].passes == [9.0, 12.0, 13.0]
    assert by["prefill", "torch"].us == 10.0 and by["prefill", "torch"].vs_best == 1.0
    assert by["decode", "triton"].us is None and by["decode", "triton"].error == "output wrong"
    assert by["decode", "torch"].us == 5.0
    rows = [bench.compare(SPEC, *g[:4], g[4], g[5], None) for g in groups]
    assert rows[0]["fastest"] == "torch" and rows[0]["repeat"] == "triton"
    assert rows[0]["repeat_ratio"] == pytest.approx(12.5 / 10.5)  # medians of passes 2-3: triton 12.5, torch 10.5
    # pass 1's fastest failed in a later pass: the verdict names it, without a ratio (a miss, not a quiet 1.00x)
    assert rows[1]["fastest"] == "torch" and rows[1]["repeat"] == "triton" and rows[1]["repeat_ratio"] is None
    summary = bench.summarise(rows)
    got = {(s["phase"], s["strategy"]): (s["within_tie"], s["timed"], s["no_time"], s["worst"]) for s in summary}
    assert got == {("prefill", "static"): (0, 1, 0, pytest.approx(1.2)), ("prefill", "repeat"): (0, 1, 0,
                   pytest.approx(12.5 / 10.5)), ("decode", "static"): (0, 1, 1, None), ("decode", "repeat"): (0, 1, 1,
                                                                                                        None)}
    text = bench.markdown(cells, probe, rows, summary, "# header")
    assert "| 4/2 d64 fp16 | decode | eager | repeat | 0/1 (1 without a time) | - | - |" in text
    assert "12.0 us ±0% (passes: 9.0 / 12.0 / 13.0)" in text and "| fastest | selected | one backend | static | " \
        "repeat |" in text and "triton (no time)" in text
    with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
        bench.run_grid(SPEC, ["torch"], ["eager"], True, torch.device("cpu"), probe, lambda m: None, repeats=0)


# ---- GPU (skipped without CUDA) ----

class Syncing:
    """torch's kernels plus a host sync in run: correct in eager mode, impossible to capture in a CUDA graph."""

    name = "syncing"
    version = "test"

    def unsupported(self, spec, phase):
        return None

    def plan_prefill(self, spec, *args):
        run = TORCH.plan_prefill(spec, *args)
        return lambda q, k, v: run(q, k, v) if q.sum().item() is not None else None

    def plan_decode(self, spec, *args):
        run = TORCH.plan_decode(spec, *args)
        return lambda q, k, v: run(q, k, v) if q.sum().item() is not None else None


SYNCING = Syncing()
GPU_SPEC = AttentionSpec(32, 8, 128, "bf16", 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graph_mode_rejects_a_backend_that_cannot_be_captured(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_dispatch:SYNCING")
    eager = select(GPU_SPEC, prefill="syncing", decode="syncing", cache_dir=str(tmp_path))
    assert eager.prefill == "syncing"  # valid in eager mode
    with pytest.raises(SelectionError, match="requested explicitly but is rejected: cannot serve under CUDA graphs: "
                                             "CUDA graph capture failed"):
        select(GPU_SPEC, prefill="syncing", decode="torch", mode="graph", cache_dir=str(tmp_path))
    auto = select(GPU_SPEC, mode="graph", policy="priority", prefill_priority=["syncing", "torch"],
                  decode_priority=["syncing", "torch"], cache_dir=str(tmp_path))
    assert auto.prefill == "torch" and auto.candidates["prefill"][0].status == "rejected"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gpu_dispatch_table_serves_correct_outputs(tmp_path, mode):
    from attnsel.validate import cases
    from attnsel.validate.cases import check_output

    sel = select(GPU_SPEC, mode=mode, cache_dir=str(tmp_path), prefill_priority=["triton", "torch"],
                 decode_priority=["triton", "torch"])
    for phase in ("prefill", "decode"):
        table = sel.dispatch[phase]
        assert table is not None and len(table.buckets) >= 4, phase
        if phase == "decode":
            assert table.axes == (("batch",) if mode == "graph" else ("batch", "context"))
        assert all(min(b.spread.values()) < 1.0 for b in table.buckets)
    dev = torch.device("cuda")
    case = cases.make_case(GPU_SPEC, "decode", dev)
    run = sel.plan_decode(case.page_table, case.seq_lens, int(case.seq_lens.max()))
    assert check_output(GPU_SPEC, run(case.q, case.k_cache, case.v_cache), case)["status"] == "valid"
    case = cases.make_case(GPU_SPEC, "prefill", dev)
    run = sel.plan_prefill(case.cu_q, case.cu_k, case.max_q, case.max_k, case.q.shape[0])
    assert check_output(GPU_SPEC, run(case.q, case.k, case.v), case)["status"] == "valid"
    with pytest.raises(ValueError, match=r"^q: expected \[.*\] bf16 on cuda:0, got .* on cpu$"):
        run(case.q.cpu(), case.k, case.v)
    warm = select(GPU_SPEC, mode=mode, cache_dir=str(tmp_path), prefill_priority=["triton", "torch"],
                  decode_priority=["triton", "torch"])
    assert warm.cache == "hit" and warm.dispatch["decode"].to_json() == sel.dispatch["decode"].to_json()


def test_decode_grid_shrinks_with_free_memory():
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")
    full = timing.decode_grid(spec, cuda)
    small = timing.decode_grid(spec, cuda, free_bytes=6 << 30)  # 6 GiB free: KV sets of at most 1 GiB
    assert len(small) < len(full)
    assert all(timing.decode_bytes(spec, b, c - timing.DECODE_TILE_TAIL) <= 1 << 30 for _, b, c in small)
    assert {(b, c) for _, b, c in small} <= {(b, c) for _, b, c in full}


def test_candidates_validated_by_a_worker_that_died_are_still_timed(monkeypatch, caplog):
    """triton decode passes in worker 1, then segfault_decode kills it; the runner vouches in worker 2's timing job
    for what worker 1 validated, so no third worker is needed: the table covers triton and torch, and it is
    cached."""
    import logging

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:ALL")
    kw = dict(prefill="torch", decode_priority=["triton", "segfault_decode", "torch"])
    with caplog.at_level(logging.INFO):
        sel = select(SPEC, **kw)
    assert sel.stats["deaths"] == 1 and sel.stats["spawns"] == 2
    table = sel.dispatch["decode"]
    assert table is not None and all(set(b.times_us) == {"triton", "torch"} for b in table.buckets)
    assert "timing the decode candidates on the bucket grid" in caplog.text  # the progress line says what runs
    again = select(SPEC, **kw)
    assert again.stats["spawns"] == 0 and again.dispatch["decode"].to_json() == table.to_json()


def test_a_table_whose_candidate_the_outlier_rule_rejects_is_reused(monkeypatch, tmp_path):
    """biased passes its own validation but the cross-candidate outlier rule rejects it (applied on every
    selection, from the cached errors); the table of the others was stored under a key without biased while the
    lookup asked with it, so every run timed again (review, 2026-12-05). Now the second run is a hit, no worker."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:PRECISE_AND_BIASED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=16)
    kw = dict(budget_s=2, prefill="torch", decode_priority=["precise", "biased", "torch"])
    first = select(spec, **kw)
    biased = next(c for c in first.candidates["decode"] if c.name == "biased")
    assert biased.status == "rejected" and "far above the best candidate's" in biased.reason
    assert first.dispatch["decode"] is not None and first.stats["spawns"] == 1
    again = select(spec, **kw)
    assert again.cache == "hit" and again.stats["spawns"] == 0
    assert again.dispatch["decode"].to_json() == first.dispatch["decode"].to_json()
    assert next(c for c in again.candidates["decode"] if c.name == "biased").status == "rejected"


def test_a_table_whose_candidate_got_no_time_is_reused_with_its_reason(monkeypatch, tmp_path):
    """stale_when_timed is valid but wrong in every timed bucket: the table (torch alone timed) is complete in the
    sense that matters, every missing time has its recorded reason, so it is stored and the next run reuses it
    (before: never stored, every run spawned a worker and timed again)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:STALE_WHEN_TIMED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "fp32", page_size=16)
    kw = dict(budget_s=2, prefill_priority=["stale_when_timed", "torch"], decode="torch")
    first = select(spec, **kw)
    stale = next(c for c in first.candidates["prefill"] if c.name == "stale_when_timed")
    assert stale.reason.startswith("no time in ") and "wrong output" in stale.reason
    again = select(spec, **kw)
    assert again.cache == "hit" and again.stats["spawns"] == 0
    assert next(c for c in again.candidates["prefill"] if c.name == "stale_when_timed").reason == stale.reason
    assert again.prefill == first.prefill == "torch"


def test_the_time_budget_keeps_the_coarse_grid_and_skips_the_rest(monkeypatch):
    grid = [(0, (1, 16)), (0, (4, 16)), (1, (2, 16))]
    out = timing.measure(SPEC, "decode", ["torch"], torch.device("cpu"), "eager", budget_s=1e-9, reps=1, grid=grid)
    assert [b["label"] for b in out["buckets"]] == ["1x16"]  # the first bucket always runs
    assert out["skipped"] == ["4x16", "2x16"]
    table = build_table(out, ["torch"])
    assert table.skipped == ("4x16", "2x16") and table.backend_for((64, 10**5)) == "torch"
    monkeypatch.setenv(timing.BUDGET_ENV, "-1")
    with pytest.raises(ValueError, match="ATTNSEL_TIMING_BUDGET_S must be positive"):
        select(SPEC)
    with pytest.raises(ValueError, match="budget_s must be a positive number of seconds"):
        select(SPEC, budget_s=0)


def test_a_table_cut_by_the_budget_is_timed_again_under_a_larger_one(monkeypatch, tmp_path):
    """A table the budget cut short (skipped buckets) was cached and served to every later run, whatever budget that
    run had: raising ATTNSEL_TIMING_BUDGET_S changed nothing until `attnsel cache clear` (review, 2026-12-05). Now
    a run with a larger budget than the one that cut the table times it again; the same or a smaller budget reuses
    it, and a table without skipped buckets is reused under any budget."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:TORCH_COPY")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    kw = dict(prefill="torch", decode_priority=["torch", "torch_copy"])
    cut = select(SPEC, budget_s=1e-6, **kw)
    assert cut.dispatch["decode"].skipped and cut.stats["spawns"] == 1
    same = select(SPEC, budget_s=1e-6, **kw)
    assert same.cache == "hit" and same.stats["spawns"] == 0
    larger = select(SPEC, budget_s=60, **kw)
    assert larger.cache == "miss" and larger.stats["spawns"] == 1
    assert not larger.dispatch["decode"].skipped
    assert select(SPEC, budget_s=1e-6, **kw).cache == "hit"  # the full table serves a smaller budget too


def test_the_budget_a_table_records_is_its_phases_share(monkeypatch, tmp_path):
    """Both phases timed share the budget; the table records the decode phase's share, so a later run that times
    decode alone under the same total (decode's share doubles) times it again; and an infinite budget ("no
    limit", capped by the worker) records null, not Infinity, which the cache would read back as malformed and
    time again on every run (second review, 2026-12-05)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:TORCH_COPY")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    both = dict(prefill_priority=["torch", "torch_copy"], decode_priority=["torch", "torch_copy"])
    decode_only = dict(prefill="torch", decode_priority=["torch", "torch_copy"])

    def stored():
        from attnsel.cache import ResultCache
        return sorted((e["phase"], e["budget_s"]) for e in ResultCache().entries().values() if e.get("kind") == "dispatch")

    first = select(SPEC, budget_s=2e-6, **both)
    assert first.dispatch["decode"].skipped and stored() == [("decode", 1e-6), ("prefill", 1e-6)]
    again = select(SPEC, budget_s=2e-6, **decode_only)
    assert again.cache == "miss" and again.stats["spawns"] == 1 and ("decode", 2e-6) in stored()
    assert select(SPEC, budget_s=2e-6, **decode_only).cache == "hit"
    monkeypatch.setenv("ATTNSEL_TIMING_BUDGET_S", "inf")
    unlimited = select(SPEC, **decode_only)
    assert unlimited.cache == "miss" and ("decode", None) in stored()
    warm = select(SPEC, **decode_only)
    assert warm.cache == "hit" and warm.stats["spawns"] == 0


def test_no_table_is_timed_where_the_outlier_rule_leaves_one_candidate(monkeypatch, tmp_path):
    """precise and biased both pass their own checks; the outlier rule rejects biased, leaving one candidate and
    no table. The lookup counted two valid candidates and timed the phase on every run, for a table it then threw
    away (second review, 2026-12-05). Now a warm run applies the rule first: a hit, no worker."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:PRECISE_AND_BIASED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=16)
    kw = dict(budget_s=2, prefill="torch", decode_priority=["precise", "biased"])
    first = select(spec, **kw)
    assert first.decode == "precise" and first.dispatch["decode"] is None
    assert {c.name: c.status for c in first.candidates["decode"]}["biased"] == "rejected"
    again = select(spec, **kw)
    assert again.cache == "hit" and again.stats["spawns"] == 0 and again.decode == "precise"


def test_measure_says_where_the_timing_went(caplog):
    """Each bucket's wall time is split into its steps and summed per phase: what a selection's cold time is made of
    (the budget counts it all), logged by the parent with the bucket count."""

    grid = [(0, (1, 16)), (0, (4, 16))]
    out = timing.measure(SPEC, "decode", ["torch"], torch.device("cpu"), "eager", reps=2, grid=grid)
    steps = out["steps_s"]
    assert list(steps) == ["inputs", "plans", "calibration", "samples", "checks", "freeing"]
    assert all(v >= 0 for v in steps.values()) and 0 < sum(steps.values()) <= out["wall_s"]
    assert all("wall_s" not in b for b in out["buckets"])  # summed, not stored per bucket
    with caplog.at_level(logging.INFO, logger=runner.log.name):
        runner._log_result(("@timing", "decode"), {"status": "timed", "measured": out})
    assert re.search(r"timed decode on 2 bucket\(s\) in [0-9.]+ s, [0-9.]+ s of it against the budget \(inputs "
                     r"[0-9.]+ s, plans [0-9.]+ s, calibration "
                     r"[0-9.]+ s, samples [0-9.]+ s, checks [0-9.]+ s, freeing [0-9.]+ s\)", caplog.text)


def test_first_use_compiles_do_not_eat_the_timing_budget(monkeypatch):
    """Plans and first calls (where Triton compiles) count against the budget only past the allowance
    (PLAN_ALLOWANCE_S, at most PLAN_ALLOWANCE_SHARE of the budget): on a fresh H100 Triton's decode compiles took ~14 s
    of the budget and the table lost 31 of 106 buckets. Under CUDA graphs too (grid version 8; before, the step, which
    holds the captures, counted in full and a cold Triton cache cost an H100 35 of 68 graph decode buckets at 8/1
    heads). A fake clock: each bucket spends 1 s in plans and 0.5 s in samples."""
    clock = [0.0]

    def bucket(cands, spec, phase, shape, device, mode, reps):
        clock[0] += 1.5
        return {"us": {n: 10.0 for n in cands}, "spread": {n: 0.0 for n in cands}, "errors": {},
                "wall_s": {"plans": 1.0, "samples": 0.5}}

    monkeypatch.setattr(timing, "time_bucket", bucket)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    grid = [(0, (b, 16)) for b in (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64)]

    def timed(mode: str, budget: float) -> tuple[int, float, float]:
        out = timing.measure(SPEC, "decode", ["fast"], torch.device("cpu"), mode, budget_s=budget, reps=1, grid=grid)
        return len(out["buckets"]), out["wall_s"], out["counted_s"]

    # budget 6 s: allowance min(30, 0.8 x 6) = 4.8 s; counted = 1.5 k - min(k, 4.8) passes 6 after the 8th bucket
    assert timed("eager", 6.0) == (8, 12.0, pytest.approx(7.2))
    assert timed("graph", 6.0) == (8, 12.0, pytest.approx(7.2))  # the same allowance under CUDA graphs
    assert timed("eager", 100.0) == (12, 18.0, 6.0)  # all 12 s of plans within the 30 s allowance
    monkeypatch.setattr(timing, "PLAN_ALLOWANCE_S", 2.0)  # the allowance itself caps it: counted = 1.5 k - min(k, 2)
    assert timed("eager", 6.0) == (6, 9.0, 7.0)
    monkeypatch.setattr(timing, "PLAN_ALLOWANCE_S", 0.0)
    assert timed("eager", 6.0) == (5, 7.5, 7.5)


def test_plan_metadata_is_checked_before_any_backend_sees_it():
    """Review finding: a page table with fewer rows than seq_lens crashed the Triton decode (SIGSEGV) and
    mismatched cu_seqlens gave NaN; plan_* now refuses them from host metadata, naming the argument."""
    sel = _selection({})
    lens = torch.tensor([20, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^page_table: expected an int32 tensor \[2, max_pages\] on cpu .* "
                                         r"got \[1, 2\] int32 on cpu$"):
        sel.plan_decode(torch.zeros(1, 2, dtype=torch.int32), lens, 20)
    with pytest.raises(ValueError, match=r"^page_table: .* got \[2, 2\] fp32 on cpu$"):
        sel.plan_decode(torch.zeros(2, 2), lens, 20)
    with pytest.raises(ValueError, match=r"^seq_lens: expected a 1-D int32 tensor \[batch\], got \[2, 1\]"):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.int32), lens[:, None], 20)
    with pytest.raises(ValueError, match="^max_seq_len: expected None or a non-negative Python int, got "):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.int32), lens, torch.tensor(20))
    cu = cumulative([5, 7], "cpu")
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: expected the shape and device of cu_seqlens_q"):
        sel.plan_prefill(cu, cumulative([5, 7, 1], "cpu"), 7, 7, 12)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-D int32 tensor"):
        sel.plan_prefill(cu.float(), cu, 7, 7, 12)
    with pytest.raises(ValueError, match=r"^max_seqlen_k: expected a non-negative Python int"):
        sel.plan_prefill(cu, cu, 7, -1, 12)
    # int64 metadata, as FlashAttention refuses it: backends would plan from an int32 copy, which in-place updates
    # of the caller's tensors (between CUDA-graph replays) never reach (was accepted, unlike the FA-compatible calls)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-D int32 tensor .* got \[3\] int64"):
        sel.plan_prefill(cu.long(), cu.long(), 7, 7, 12)
    with pytest.raises(ValueError, match=r"^seq_lens: expected a 1-D int32 tensor \[batch\], got \[2\] int64"):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.int32), lens.long(), 20)
    with pytest.raises(ValueError, match=r"^page_table: .* got \[2, 2\] int64 on cpu$"):
        sel.plan_decode(torch.zeros(2, 2, dtype=torch.long), lens, 20)


def test_run_refuses_a_strided_last_dimension():
    """Review finding: Triton indexes the last dimension with stride 1, so q[..., ::2] gave errors of 1.56."""
    run = _prefill_run()
    wide = torch.zeros(12, 4, 128, **H)
    k, v = torch.zeros(12, 2, 64, **H), torch.zeros(12, 2, 64, **H)
    with pytest.raises(ValueError, match=r"^q: its last dimension must be contiguous \(stride 1\), got strides "
                                         r"\(512, 128, 2\); pass q.contiguous\(\)$"):
        run(wide[..., ::2], k, v)
    assert run(wide[..., ::2].contiguous(), k, v).shape == (12, 4, 64)


def test_shapes_between_timed_ones_take_the_least_interpolated_slowdown():
    """Graph-mode decode, 32/8 heads on the H200 (2026-12-03, geometric means over contexts): FA3 won batch 16 by
    0.9% and lost batch 8 by 6.5%; Triton was within 1% at both. At batch 12 the bench then measured FA3 1.24-1.31x
    slower than Triton: the nearest bucket (16) was the wrong guide, the interpolated slowdown is not."""
    cells = {}
    for batch, times in ((8, {"fa3": 32.8, "triton": 30.8}), (16, {"fa3": 48.6, "triton": 49.04})):
        for ctx in (256, 16384):
            cells[(batch, ctx)] = dict(times)
    table = build_table(measured("decode", "graph", cells), ["fa3", "triton"])
    assert [b.backend for b in table.buckets] == ["triton", "fa3"]
    assert table.bucket_for((12,)).backend == "fa3"  # the nearest bucket in log space
    assert table.backend_for((12,)) == "triton"  # 0.6 x 0.9% vs 0.4 x 6.3% (log scale)
    assert table.backend_for((16,)) == "fa3" and table.backend_for((8,)) == "triton"  # timed shapes: their choice
    assert table.backend_for((64,)) == "fa3" and table.backend_for((1,)) == "triton"  # clamped beyond the ends
    # within the tie band the candidate whose worst corner is least wins, not the nearest corner's choice: at
    # batch 5, a (chosen at batch 4) and b are within 1% interpolated, but a is 3% slower at batch 16, b at most
    # 0.5% anywhere
    ties = build_table(measured("decode", "graph", {(4, 256): {"a": 100.0, "b": 100.5},
                                                    (16, 256): {"a": 103.0, "b": 100.0}}), ["a", "b"])
    assert ties.backend_for((4,)) == "a" and ties.backend_for((5,)) == "b" and ties.backend_for((12,)) == "b"


def test_a_near_tie_goes_to_the_candidate_that_is_never_far_behind_in_the_box():
    """Eager decode, 28/4 heads on the H200 (round 11, 2026-12-04), the four timed buckets around 100 rows x 9000
    tokens (us): at 91 x 8192 fa3_packgqa, Triton and FlashInfer were within 1% (priority chose fa3_packgqa); at 128
    rows fa3_packgqa was 5% behind FlashInfer. Interpolated, all three were within the 1% band, and the nearest
    corner's choice (fa3_packgqa) served 100 x 9000, where the bench measured it 1.24x slower than FlashInfer (FA3's
    work tiles fill a fourth wave of SMs between 91 and 128 rows). The candidate whose worst corner is least serves
    it now: FlashInfer (at most 1% behind anywhere in the box)."""
    cells = {(91, 8192): {"flashinfer": 412.7, "fa3_packgqa": 408.7, "triton": 408.6},
             (91, 16384): {"flashinfer": 813.0, "fa3_packgqa": 809.6, "triton": 808.0},
             (128, 8192): {"flashinfer": 550.8, "fa3_packgqa": 578.8, "triton": 564.0},
             (128, 16384): {"flashinfer": 1083.0, "fa3_packgqa": 1138.5, "triton": 1116.3}}
    table = build_table(measured("decode", "eager", cells), ["fa3_packgqa", "flashinfer", "triton"])
    assert table.bucket_for((91, 8192)).backend == "fa3_packgqa"  # timed: the tie band and priority decide
    assert table.backend_for((91, 8192)) == "fa3_packgqa"
    assert table.backend_for((100, 9000)) == "flashinfer"


def test_interpolation_needs_every_corner_else_the_nearest_bucket():
    cells = dict(DECODE)
    full = build_table(measured("decode", "eager", cells), ["a", "b"])
    # (8, 512) lies in the middle of the box 4..16 x 256..1024: a's slowdowns there are 0.41, 0.01, 0, 0.13
    # (log scale), b's 0, 0, 0.41, 0 -> means 0.14 and 0.10: b
    assert full.backend_for((8, 512)) == "b"
    del cells[(16, 1024)]
    sparse = build_table(measured("decode", "eager", cells), ["a", "b"])
    assert sparse.backend_for((8, 512)) == sparse.bucket_for((8, 512)).backend
    assert sparse.backend_for((2, 512)) != "" and sparse.backend_for((0, 0)) == sparse.buckets[0].backend


def test_lookup_does_not_depend_on_the_order_of_earlier_calls():
    """Shapes near a nearest-bucket boundary (here prefill, where corners are sparse and the nearest bucket serves)
    get the same answers whichever came first (a review found an earlier memo handing the first one's answer to the
    second): the answer is a function of the shape (rounded to 1/16 octave per axis), not of the calls before."""
    cells = {(2, 2 * n, n): ({"a": 1.0, "b": 2.0} if n <= 576 else {"a": 2.0, "b": 1.0}) for n in (288, 576, 1152)}
    keys = [(2, 1520, 760), (2, 1620, 810), (2, 1640, 820), (2, 1760, 880)]  # around the midpoint of 576 and 1152
    answers = set()
    for order in (keys, keys[::-1], [keys[1], keys[3], keys[0], keys[2]]):
        table = build_table(measured("prefill", "eager", cells), ["a", "b"])
        got = {k: table.backend_for(k) for k in order}
        assert got == {k: table.bucket_for(k).backend for k in keys}
        answers.add(tuple(sorted(got.items())))
    assert len(answers) == 1
    assert got[keys[0]] == "a" and got[keys[-1]] == "b"  # well inside either side


def test_interpolation_ignores_corners_of_zero_weight_and_bad_times():
    # batch 65 rounds onto batch 64 (512's weight: 32 x log(65/64) / log(8) = 0.24 -> 0/32): a's absence at 512
    # does not matter there; at batch 100 it does (only b was timed at both)
    table = build_table(measured("decode", "graph", {(64, 256): {"a": 10.0, "b": 10.5}, (512, 256): {"b": 30.0}}),
                        ["a", "b"])
    assert table.backend_for((64,)) == "a" and table.backend_for((65,)) == "a"
    assert table.backend_for((100,)) == "b"
    # a hand-made table with a bucket that has no times still loads; its shapes fall back to the nearest bucket
    data = table.to_json()
    data["buckets"][1]["times_us"] = {}
    loaded = DispatchTable.from_json(data)
    assert loaded.backend_for((100,)) == loaded.bucket_for((100,)).backend and loaded.backend_for((512,)) == "b"


class B1hdPlugin:
    """torch's decode that records the q it is given; ``decode_takes_b1hd`` as given (a callable: a property that
    raises)."""

    seen: list = []

    def __init__(self, name, takes):
        self.name, self.version, self._takes = name, "test", takes

    @property
    def decode_takes_b1hd(self):
        if callable(self._takes):
            return self._takes()
        return self._takes

    def unsupported(self, spec, phase):
        return None

    def plan_prefill(self, spec, *args):
        return TORCH.plan_prefill(spec, *args)

    def plan_decode(self, spec, page_table, seq_lens):
        torch_run = TORCH.plan_decode(spec, page_table, seq_lens)

        def run(q, k_cache, v_cache, **kwargs):
            B1hdPlugin.seen.append(q)
            if q.dim() == 4:
                return torch_run(q[:, 0], k_cache, v_cache, **kwargs)[:, None]
            return torch_run(q, k_cache, v_cache, **kwargs)

        return run


def _raises():
    raise RuntimeError("broken attribute")


class B1hdLiar(B1hdPlugin):
    """Declares decode_takes_b1hd but mishandles q [B, 1, H, D]: "shape" returns [B, H, D], "values" is off by 0.01."""

    def __init__(self, name, fault):
        super().__init__(name, True)
        self.fault = fault

    def plan_decode(self, spec, page_table, seq_lens):
        torch_run = TORCH.plan_decode(spec, page_table, seq_lens)

        def run(q, k_cache, v_cache, **kwargs):
            if q.dim() == 3:
                return torch_run(q, k_cache, v_cache, **kwargs)
            out = torch_run(q[:, 0], k_cache, v_cache, **kwargs)
            return out if self.fault == "shape" else (out + 0.01)[:, None]

        return run


B1HD_PLUGINS = [B1hdPlugin("b1hd_native", True), B1hdPlugin("b1hd_views", False),
                B1hdPlugin("b1hd_truthy", 1), B1hdPlugin("b1hd_raises", _raises),
                B1hdLiar("b1hd_liar_shape", "shape"), B1hdLiar("b1hd_liar_values", "values")]


@pytest.mark.parametrize("name,native", [("b1hd_native", True), ("b1hd_views", False), ("b1hd_truthy", False),
                                         ("b1hd_raises", False)])
def test_plan_decode_in_flash_layout_passes_q_only_to_backends_that_take_it(monkeypatch, caplog, name, native):
    """q_layout="b1hd": q [B, 1, H, D] reaches a backend whose decode_takes_b1hd is True as the very tensor given
    (no view); any other backend (attribute missing, not True, or raising: logged) gets q viewed as [B, H, D]. Out is
    [B, 1, H, D] and equal to the [B, H, D] plan's, against the float32 reference either way."""
    from tests.fixtures.feature_cases import decode_case

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_dispatch:B1HD_PLUGINS")
    spec = AttentionSpec(4, 2, 16, "fp32", 16)
    case = decode_case(spec, torch.device("cpu"), [5, 0, 33])
    sel = _selection({"decode": PhaseChoice(name, "explicit", [])}, spec=spec)
    q, k_cache, v_cache = case.inputs
    q4 = q.unsqueeze(1)
    B1hdPlugin.seen.clear()
    monkeypatch.setattr(backends_mod, "_B1HD_RAISED", set())  # the warning is logged once per backend and process
    out = sel.plan_decode(*case.plan_args, q_layout="b1hd")(q4, k_cache, v_cache)
    assert out.shape == q4.shape
    assert (B1hdPlugin.seen[-1] is q4) is native and B1hdPlugin.seen[-1].dim() == (4 if native else 3)
    assert (out[:, 0] - case.ref).abs().max().item() < 1e-5
    assert torch.equal(out[:, 0], sel.plan_decode(*case.plan_args)(q, k_cache, v_cache))
    if name == "b1hd_raises":
        assert "decode_takes_b1hd of b1hd_raises raised RuntimeError: broken attribute" in caplog.text


def test_plan_decode_in_flash_layout_names_a_bad_q_and_a_bad_layout():
    sel = _selection({})
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    cache = torch.zeros(6, SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim, dtype=SPEC.torch_dtype)
    run = sel.plan_decode(table, lens, q_layout="b1hd")
    q3 = torch.zeros(2, SPEC.num_q_heads, SPEC.head_dim, dtype=SPEC.torch_dtype)
    with pytest.raises(ValueError, match=rf"q: expected \[2, 1, {SPEC.num_q_heads}, {SPEC.head_dim}\]"):
        run(q3, cache, cache)
    with pytest.raises(ValueError, match=r"q: expected \[2, 1, "):
        run(q3.unsqueeze(0).expand(2, 2, *q3.shape[1:]), cache, cache)  # [2, 2, H, D]: the axis must be 1
    with pytest.raises(ValueError, match="q_layout: expected 'bhd' .* or 'b1hd' .* got 'bshd'"):
        sel.plan_decode(table, lens, q_layout="bshd")


@pytest.mark.parametrize("name,why", [
    ("b1hd_liar_shape", r"declares decode_takes_b1hd but returned \(\d+, 4, 16\) for q \[B, 1, H, D\], expected "
                        r"\(\d+, 1, 4, 16\)"),
    ("b1hd_liar_values", r"declares decode_takes_b1hd but its out for q \[B, 1, H, D\] differs from its out for "
                         r"q \[B, H, D\] by 0.01")])
def test_a_backend_that_declares_the_flash_layout_is_validated_in_it(monkeypatch, tmp_path, name, why):
    """Validation runs a decode case with q [B, 1, H, D] too when the backend declares decode_takes_b1hd: a plugin
    that returns another shape or other numbers in that layout is rejected with the reason (before, it was selected
    and flash_attn_with_kvcache returned its [B, H, D] out or its wrong numbers)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_dispatch:B1HD_PLUGINS")
    spec = AttentionSpec(4, 2, 16, "fp32", 16)
    with pytest.raises(SelectionError) as err:
        select(spec, prefill="torch", decode=name, cache_dir=str(tmp_path))
    assert re.search(why, str(err.value)), str(err.value)
    sel = select(spec, prefill="torch", decode="b1hd_native", cache_dir=str(tmp_path))  # the honest one is valid
    assert sel.decode == "b1hd_native"


def test_a_layout_failure_is_not_carried_to_the_next_backend_on_the_same_case(monkeypatch):
    """bench.valid_backends runs every backend on one case: a rejection in the [B, 1, H, D] layout belongs to the
    backend that failed it, not to the next one (torch here, which takes no such layout)."""
    from attnsel.bench import valid_backends

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_dispatch:B1HD_PLUGINS")
    valid = valid_backends(AttentionSpec(4, 2, 16, "fp32", 16), "decode", ["b1hd_liar_values", "torch"],
                           torch.device("cpu"))
    assert valid["torch"] == "", valid["torch"]
    assert "declares decode_takes_b1hd" in valid["b1hd_liar_values"]


# ---- finer grid, pruning, calibration, budget carry-over (grid version 3) ----

def test_sqrt2_steps_are_the_finest_level():
    assert timing._level(72, timing.PREFILL_LENS) == 0 and timing._level(18432, timing.PREFILL_LENS) == 0
    assert timing._level(144, timing.PREFILL_LENS) == 1
    assert all(timing._level(v, timing.PREFILL_LENS) == 2 for v in (102, 204, 13033))
    assert [timing._level(b, timing.DECODE_BATCHES) for b in (1, 2, 3, 4, 6, 256)] == [0, 1, 2, 0, 2, 0]
    cuda = torch.device("cuda")
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    graph = timing.decode_grid(spec, cuda, mode="graph")
    assert {c for _, _, c in graph} == set(timing.GRAPH_DECODE_CTX)
    assert {b for _, b, _ in graph} == set(timing.DECODE_BATCHES)
    # every value between powers of two lies within a factor 1.5 of its neighbours
    for values in (timing.PREFILL_LENS, timing.DECODE_BATCHES[1:]):
        assert all(1.3 < b / a <= 1.5 for a, b in zip(values, values[1:])), values


def test_prune_drops_only_candidates_slower_in_every_coarse_bucket():
    coarse = [{"us": {"a": 10.0, "b": 13.0, "c": 30.0, "d": 9.0}}, {"us": {"a": 10.0, "b": 12.0, "c": 40.0}}]
    # d is the fastest where it ran (it failed in the second bucket): kept
    assert timing.prune(coarse, ["a", "b", "c", "d"]) == {"c": pytest.approx(30.0 / 9.0)}
    assert timing.prune(coarse, ["a", "b", "c", "d"], factor=1.2) == {"b": pytest.approx(1.2), "c": pytest.approx(30 / 9)}
    # e failed in one bucket and is 5x slower in the other (the H200's torch prefill at the largest shapes): pruned
    slow = [{"us": {"a": 10.0}}, {"us": {"a": 10.0, "e": 50.0}}]
    assert timing.prune(slow, ["a", "e"]) == {"e": 5.0}
    assert timing.prune([{"us": {"a": 10.0}}], ["a", "f"]) == {}  # f never ran: its failures are reported
    assert timing.prune([{"us": {"a": 10.0, "b": 20.0}}], ["b"]) == {}  # never every candidate
    assert timing.prune([], ["a", "b"]) == {}  # nothing timed: nothing pruned


def test_measure_prunes_after_the_coarse_grid_and_the_table_reports_it(monkeypatch):
    seen = []

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        seen.append((shape, sorted(cands)))
        return {"us": {n: {"fast": 10.0, "close": 12.0, "slow": 40.0}[n] for n in cands},
                "spread": {n: 0.0 for n in cands}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    grid = [(0, (1, 16)), (0, (4, 16)), (1, (2, 16)), (2, (3, 16))]
    out = timing.measure(SPEC, "decode", ["fast", "close", "slow"], torch.device("cpu"), "eager", reps=1, grid=grid)
    assert seen == [((1, 16), ["close", "fast", "slow"]), ((4, 16), ["close", "fast", "slow"]),
                    ((2, 16), ["close", "fast"]), ((3, 16), ["close", "fast"])]
    assert out["pruned"] == {"slow": 4.0}
    table = build_table(out, ["fast", "close", "slow"])
    assert table.pruned == (("slow", 4.0),) and table.backend_for((3, 16)) == "fast"
    assert DispatchTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    from attnsel.cli import dispatch_table
    from rich.console import Console
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("fast", "auto", [], table)}), "decode", 200))
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert "not timed on the finer grid (slower on every coarse bucket): slow (>= 4.00x)" in text


def test_calibration_grows_the_sample_until_it_lasts_sample_s(monkeypatch):
    """A cold first call (5 ms) must not set the sample's length: warm calls take 50 us, so the calibration keeps
    growing the number of calls until a measured sample lasts SAMPLE_S (the old rule stopped at one call)."""
    per_call = iter([5e-3] + [49e-6] * 100)
    sampled = []

    def fake_sample(item, cursor, device):
        sampled.append(item.repeat)
        return next(per_call)

    monkeypatch.setattr(timing, "_sample", fake_sample)
    item = timing._Timed(lambda c: None, 1, lambda: [], None)
    cursor = timing._calibrate(item, 0, torch.device("cuda"))
    assert item.repeat * 49e-6 >= timing.SAMPLE_S and item.repeat == 21
    assert sampled == [1, 1, 21] and cursor == 1 + 1 + 21


def test_the_worker_hands_unspent_timing_budget_to_the_next_phase(monkeypatch):
    from attnsel.validate import worker

    budgets = []

    def fake_measure(spec, phase, names, device, mode, budget_s, max_budget_s=None):
        budgets.append(budget_s)
        return {"phase": phase, "buckets": [], "wall_s": 3.0}

    monkeypatch.setattr(timing, "measure", fake_measure)
    job = {"measure": {"prefill": {"backends": ["torch"], "vouched": ["torch"], "budget_s": 10.0},
                       "decode": {"backends": ["torch"], "vouched": ["torch"], "budget_s": 10.0}}}
    first = worker.time_phase("prefill", SPEC, torch.device("cpu"), job, {})
    second = worker.time_phase("decode", SPEC, torch.device("cpu"), job, {}, first["unspent_s"])
    assert budgets == [10.0, 17.0] and second["unspent_s"] == 14.0


def test_nearest_bucket_is_measured_from_the_shape_not_its_cell():
    """H200 2026-12-04: 40 prompts x 100 tokens lies in the untimed cell (32, 4608, 102); from the cell's centre the
    FA3 bucket (32, 4608, 144) was as near as FlashInfer's (32, 3264, 102) and served it 1.31x slower; from the
    shape itself FlashInfer's bucket is the nearest."""
    pre = {(64, 4608, 72): {"fa3": 51.8, "flashinfer": 52.0}, (32, 2304, 72): {"fa3": 29.4, "flashinfer": 28.6},
           (32, 4608, 144): {"fa3": 51.9, "flashinfer": 65.3}, (32, 3264, 102): {"fa3": 39.8, "flashinfer": 29.7},
           (64, 6528, 102): {"fa3": 70.8, "flashinfer": 54.6}}
    table = build_table(measured("prefill", "graph", pre), ["fa3", "flashinfer"])
    assert table.bucket_for((40, 4000, 100)).key == (32, 3264, 102)
    assert table.backend_for((40, 4000, 100)) == "flashinfer"
    assert table.bucket_for((32, 4608, 144)).key == (32, 4608, 144)  # a timed shape is its own bucket


def test_a_budget_cut_leaves_gaps_spread_over_the_level():
    grid = [(2, b) for b in range(10)] + [(0, "a"), (1, "b")]
    ordered = timing._coarse_first(grid)
    assert [x for _, x in ordered[:2]] == ["a", "b"]
    finest = [x for _, x in ordered[2:]]
    assert sorted(finest) == list(range(10))
    assert finest[:4] == [0, 8, 4, 2]  # the first four of ten: spread over the range, not the smallest four


def test_a_graph_budget_cut_leaves_out_whole_batch_sizes():
    """Graph mode scores a batch size by its geometric mean over contexts; a budget cut must not leave some batch
    sizes timed at context 256 only (the review found a flat bit-reversed order doing that)."""
    cuda = torch.device("cuda")
    grid = timing.decode_grid(AttentionSpec(32, 8, 128, "bf16", 16), cuda, mode="graph", sms=132)
    for cut in range(1, len(grid)):
        per_batch: dict = {}
        for _, b, c in grid[:cut]:
            per_batch.setdefault(b, set()).add(c)
        partial = [b for b, cs in per_batch.items() if len(cs) < sum(1 for _, b2, _ in grid if b2 == b)]
        assert len(partial) <= 1, (cut, partial)  # at most the batch size being timed when the budget ran out


def test_a_finer_bucket_where_the_kept_candidate_fails_is_timed_with_the_pruned_ones(monkeypatch):
    """fast wins the coarse grid and is wrong at 8x4096; slow (pruned) must then serve that bucket, not fast by
    nearest-bucket fallback."""
    seen = []

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        seen.append((shape, sorted(cands)))
        errors = {"fast": "wrong output"} if shape == (8, 4096) and "fast" in cands else {}
        us = {n: {"fast": 10.0, "slow": 14.0}[n] for n in cands if n not in errors}
        return {"us": us, "spread": {n: 0.0 for n in us}, "errors": errors}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    grid = [(0, (4, 4096)), (0, (16, 4096)), (2, (8, 4096))]
    out = timing.measure(SPEC, "decode", ["fast", "slow"], torch.device("cpu"), "eager", reps=1, grid=grid)
    assert out["pruned"] == {"slow": 1.4}
    assert seen[-2:] == [((8, 4096), ["fast"]), ((8, 4096), ["fast", "slow"])]
    table = build_table(out, ["fast", "slow"])
    assert table.backend_for((8, 4096)) == "slow"


def test_the_carried_budget_stays_inside_half_the_task_timeout(monkeypatch):
    from attnsel.validate import worker

    budgets = []
    monkeypatch.setattr(timing, "measure", lambda spec, phase, names, device, mode, budget_s, max_budget_s=None:
                        budgets.append(budget_s) or {"phase": phase, "buckets": [], "wall_s": 1.0})
    job = {"measure": {"decode": {"backends": ["torch"], "vouched": ["torch"], "budget_s": 20.0,
                                  "max_budget_s": 25.0}}}
    worker.time_phase("decode", SPEC, torch.device("cpu"), job, {}, unspent_s=19.0)
    assert budgets == [25.0]


def test_select_names_arguments_of_a_wrong_type(tmp_path):
    """Review finding: a priority given as the CLI's "a,b" text was read letter by letter ("unknown backend 't'"),
    timeout="10" and budget_s="5" raised a bare TypeError, a dict spec an AttributeError after every backend's
    check had logged a traceback."""
    spec = AttentionSpec(4, 2, 64, dtype="fp32")
    sel = select(spec, policy="priority", prefill_priority="triton, torch", decode_priority="torch",
                 cache_dir=str(tmp_path))
    assert sel.candidates["decode"][0].name == "torch"
    assert [c.name for c in sel.candidates["prefill"]] == ["triton", "torch"]
    for kwargs, message in (({"timeout": "10"}, r"^timeout must be a positive number of seconds or None, got '10'$"),
                            ({"budget_s": "5"}, r"^budget_s must be a positive number of seconds or None, got '5'$"),
                            ({"timeout": True}, r"^timeout must be a positive number")):
        with pytest.raises(ValueError, match=message):
            select(spec, policy="priority", cache_dir=str(tmp_path), **kwargs)
    with pytest.raises(TypeError, match=r"^spec must be an attnsel.AttentionSpec, got dict \(AttentionSpec.from_dict"):
        select({"num_q_heads": 4}, policy="priority", cache_dir=str(tmp_path))


# ---- wave edges (grid version 8) ----

def test_wave_batches_bracket_the_first_three_wave_edges():
    """132 SMs (H100, H200): one block per (row, KV head) fills k rounds up to k x 132 / kv_heads rows."""
    h = lambda q, kv: AttentionSpec(q, kv, 128, "bf16", 16)
    # 28/4: edges at 33, 66, 99 rows; 32 and 64 already have 1 and 2 rounds, 91 is more than 5% below 99
    assert timing.wave_batches(h(28, 4), 132) == [34, 67, 99, 100]
    assert timing.wave_batches(h(32, 8), 132) == [17, 34, 49, 50]  # edges 16.5, 33, 49.5
    assert timing.wave_batches(h(8, 1), 132) == [133]  # 264 is past the grid's 256 rows
    assert timing.wave_batches(h(32, 8), None) == [] and timing.wave_batches(h(32, 8), 0) == []
    for heads in ((32, 8), (28, 4), (8, 1), (32, 32), (16, 2), (64, 8)):
        for sms in (78, 108, 114, 132, 170):
            spec = h(*heads)
            waves = timing.wave_batches(spec, sms)
            assert not set(waves) & set(timing.DECODE_BATCHES) and waves == sorted(set(waves))
            assert all(1 <= b <= timing.DECODE_BATCHES[-1] for b in waves)
            for k in range(1, timing.WAVE_EDGES + 1):  # a timed value on each side of each edge
                edge = k * sms / spec.num_kv_heads
                if math.floor(edge) + 1 > timing.DECODE_BATCHES[-1]:
                    break
                rounds = lambda b: math.ceil(b * spec.num_kv_heads / sms)
                values = sorted(set(timing.DECODE_BATCHES) | set(waves))
                below = max(v for v in values if v <= edge)
                above = min(v for v in values if v > edge)
                assert rounds(below) == k and rounds(above) == k + 1, (heads, sms, k, below, above)
                assert below >= 0.95 * math.floor(edge) and above == math.floor(edge) + 1, (heads, sms, k)


def test_wave_batches_join_the_decode_grids_at_the_finest_level():
    cuda = torch.device("cuda")  # only its type is read
    spec = AttentionSpec(28, 4, 128, "bf16", 16)
    for mode, contexts, bases in (("eager", timing.DECODE_CTX, timing.DECODE_CTX_POW2),
                                  ("graph", timing.GRAPH_DECODE_CTX, timing.GRAPH_DECODE_CTX)):
        plain = timing.decode_grid(spec, cuda, mode=mode)
        grid = timing.decode_grid(spec, cuda, mode=mode, sms=132)
        added = [(lvl, b, c) for lvl, b, c in grid if b not in timing.DECODE_BATCHES]
        assert {b for _, b, _ in added} == {34, 67, 99, 100}
        assert all(lvl == 2 for lvl, _, _ in added)
        assert {(b, c) for _, b, c in added} == {(b, c) for b in (34, 67, 99, 100) for c, p in zip(contexts, bases)
                                                  if timing.decode_bytes(spec, b, p) <= timing.MAX_DECODE_KV_BYTES}
        assert sorted(x for x in grid if x[1] in timing.DECODE_BATCHES) == sorted(plain)  # the rest unchanged
        assert [x for x in grid if x[0] < 2] == [x for x in plain if x[0] < 2]  # coarser levels first, in order
        levels = [lvl for lvl, _, _ in grid]
        assert levels == sorted(levels)


def test_a_wave_step_between_timed_batches_is_served_by_the_faster_kernel():
    """Round 19's 28/4 decode at 100 x 9000 on an H100: 'w' (FA3, one block per row and KV head) led 'f'
    (FlashInfer) by 2.5% at 91 rows (3 rounds of 132 SMs) and trailed by 0.5% at 128 (4 rounds); at 100 rows it
    has 4 rounds and was 1.11x slower. Interpolating between 91 and 128 alone serves 'w' there; with the wave
    batches 99 and 100 timed, 100 rows go to 'f' and 99 to 'w'."""
    f = lambda b: 3.1 * b  # FlashInfer: time grows with the rows
    w = lambda b: 0.975 * 3.1 * 91 / 3 * math.ceil(b * 4 / 132)  # FA3: time grows with the rounds
    cells = lambda batches: {(b, c): {"w": w(b) * c / 4096, "f": f(b) * c / 4096} for b in batches
                             for c in (4096, 8192)}
    before = build_table(measured("decode", "eager", cells((64, 91, 128))), ["w", "f"])
    assert before.backend_for((100, 6000)) == "w"  # the miss: w(100) / f(100) = 1.19
    waves = build_table(measured("decode", "eager", cells((64, 91, 99, 100, 128))), ["w", "f"])
    assert w(100) / f(100) > 1.1 and w(99) < f(99)
    for b in (100, 105, 110):
        assert waves.backend_for((b, 6000)) == "f", b
    for b in (92, 96, 99):
        assert waves.backend_for((b, 6000)) == "w", b
