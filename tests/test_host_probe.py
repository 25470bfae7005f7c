"""The eager host probe (host_probe.host_probe): every eager bucket and bench cell records how fast the host launched
work while it was timed, the report says how much of a table was timed on a slow host; and the plan allowance's
cap (first-use compiles are not counted against the timing budget).

On an H100 a phase's probes spread from 1.0 to ~1.5x its fastest, mostly in two clusters (1.00-1.06x, 1.32-1.47x;
see bench/results/README.md). These tests script the probe and the bucket timings.
"""
from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from rich.console import Console

import attnsel.backends as backends_mod
from attnsel import bench
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.cache import entry_problem
from attnsel.render import dispatch_table
from attnsel.selection import DispatchTable, PhaseChoice, build_table
from attnsel.validate import grid as bucket_grid
from attnsel.validate import host_probe, timing
from tests.fixtures.dispatch import SPEC, _selection

RAGGED = [100, 400, 1500, 2000]  # a ragged decode bucket's context lengths (its own sub-table)
GRID = [(0, (1, 256)), (0, (4, 256)), (0, (16, 256)), (0, RAGGED), (2, (6, 256))]
TIMES = {"triton": 40.0, "flashinfer": 45.0}


@pytest.fixture
def scripted(monkeypatch):
    """time_bucket replaced: per shape its host probe (us, or None), every candidate at TIMES; the calls listed."""
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    calls: list = []

    def install(hosts: dict):
        def fake_bucket(cands, spec, phase, shape, device, mode, reps):
            calls.append(shape)
            return {"us": {n: TIMES[n] for n in cands}, "spread": {n: 0.01 for n in cands}, "errors": {},
                    "host_us": hosts[tuple(shape)], "wall_s": {"samples": 1.0}}

        monkeypatch.setattr(timing, "time_bucket", fake_bucket)
        return calls

    return install


def test_each_bucket_carries_its_host_speed_over_the_phases_reference(scripted, monkeypatch):
    """The ragged bucket (timed fourth, in its own sub-table) has the least probe: with fewer than 10 buckets the
    reference is the least, wherever it was timed; the report counts slow buckets of both tables."""
    monkeypatch.setattr(timing, "_free_bytes", lambda device: None)
    calls = scripted({(1, 256): 5.5, (4, 256): 7.0, (16, 256): 5.2, tuple(RAGGED): 5.0, (6, 256): 6.5})
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    assert calls == [shape for _, shape in GRID]  # each bucket timed once: a slow host is recorded, not re-timed
    host = {tuple(b["key"]): b["host"] for b in out["buckets"]}
    assert host == {(1, 256): pytest.approx(1.1), (4, 256): pytest.approx(1.4), (16, 256): pytest.approx(1.04),
                    bucket_grid.ragged_key(RAGGED): 1.0, (6, 256): pytest.approx(1.3)}
    table = build_table(out, ["flashinfer", "triton"])
    assert {b.label: b.host for b in table.buckets}["4x256"] == pytest.approx(1.4)
    assert [b.host for b in table.ragged.buckets] == [1.0]
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table

    def report(t) -> str:
        console = Console(width=200, record=True)
        console.print(dispatch_table(_selection({"decode": PhaseChoice("triton", "auto", [], t)}), "decode", 200))
        return " ".join(console.export_text().split())

    assert "2 bucket(s) timed while the host was slow (launches >= 1.2x the phase's lower decile)" in report(table)
    slow_ragged = dataclasses.replace(table, ragged=dataclasses.replace(
        table.ragged, buckets=tuple(dataclasses.replace(b, host=1.5) for b in table.ragged.buckets)))
    assert "3 bucket(s) timed while the host was slow" in report(slow_ragged)


def test_one_lucky_bucket_does_not_make_the_rest_slow(scripted):
    """An H100 run, 8/1 prefill: one bucket at 1.0 and 61 at 1.2-1.3 of it. The reference is the lower decile."""
    grid = [(0, (b, 256)) for b in range(1, 13)]
    hosts = {(1, 256): 4.0, **{(b, 256): 5.0 + 0.01 * b for b in range(2, 13)}}
    hosts[(12, 256)] = 7.0
    scripted(hosts)
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=grid)
    host = {tuple(b["key"]): b["host"] for b in out["buckets"]}
    reference = 5.02  # the second least of 12: index (12 - 1) // 10
    assert host[(2, 256)] == 1.0 and host[(1, 256)] == pytest.approx(4.0 / reference)
    assert [k for k, h in host.items() if h >= host_probe.HOST_SLOW] == [(12, 256)]
    assert host_probe.host_reference([]) is None and host_probe.host_reference([3.0, 2.0]) == 2.0
    assert host_probe.host_reference([float(x) for x in range(100, 0, -1)]) == 10.0


def test_no_probe_no_host_speed_and_no_report_line(scripted):
    """Graph replays and CPU timings carry no probe: no bucket gets a host factor, the report says nothing of it."""
    scripted({tuple(shape): None for _, shape in GRID})
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    assert all("host" not in b for b in out["buckets"])
    table = build_table(out, ["flashinfer", "triton"])
    assert all(b.host is None for b in table.buckets)
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("triton", "auto", [], table)}), "decode", 200))
    assert "host was slow" not in console.export_text()


def test_time_bucket_probes_the_host_before_each_repetition(monkeypatch):
    """A real (CPU) bucket: one probe per repetition in eager mode, host_us their median in microseconds (the
    probes' mean is 4, their least is not the first)."""
    probes = iter([1e-6, 4e-6, 2e-6, 9e-6])
    calls = []

    def probe(device):
        calls.append(device)
        return next(probes)

    out = timing.time_bucket({"torch": TORCH}, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=3)
    assert out["host_us"] is None and set(out["us"]) == {"torch"}  # CPU: the real probe gives None
    monkeypatch.setattr(timing, "host_probe", probe)
    out = timing.time_bucket({"torch": TORCH}, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=4)
    assert len(calls) == 4 and out["host_us"] == pytest.approx(3.0)
    calls.clear()
    out = timing.time_bucket({}, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=3)
    assert calls == [] and out["host_us"] is None  # nothing to time: no probe


def test_graph_replays_are_not_probed(monkeypatch):
    """Under CUDA graphs a replay is one launch: no host probe (a prepared candidate stands in for a captured one)."""
    monkeypatch.setattr(timing, "host_probe", lambda device: pytest.fail("probed in graph mode"))
    monkeypatch.setattr(timing, "_prepare", lambda *args: timing._Timed(lambda cursor: None, 1, lambda: [], None))
    monkeypatch.setattr(timing, "_timed_output_reason", lambda *args: None)
    out = timing.time_bucket({"torch": TORCH}, SPEC, "decode", (2, 32), torch.device("cpu"), "graph", reps=3)
    assert set(out["us"]) == {"torch"} and out["host_us"] is None


def test_host_probe_is_cuda_only():
    assert host_probe.host_probe(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_probe_times_a_launch_on_the_gpu():
    seconds = host_probe.host_probe(torch.device("cuda"))
    assert 1e-7 < seconds < 1e-3


def test_bench_cells_carry_each_passs_host_probe(monkeypatch):
    monkeypatch.setattr(bench, "QUICK_PREFILL", [[8]])
    monkeypatch.setattr(bench, "QUICK_DECODE", [(1, 20)])
    monkeypatch.setattr(bench, "valid_backends", lambda spec, phase, names, device: {n: "" for n in names})
    hosts = iter([5.0, 6.0, 7.5, None])

    def fake_time_bucket(cands, spec, phase, shape, device, mode, reps):
        return {"us": {n: 10.0 for n in cands}, "spread": {n: 0.0 for n in cands}, "errors": {},
                "host_us": next(hosts)}

    monkeypatch.setattr(bench.timing, "time_bucket", fake_time_bucket)
    cells, _, _ = bench.run_grid(SPEC, ["torch"], ["eager"], True, torch.device("cpu"),
                                 {"copy_tbps": 1.0, "read_tbps": 1.0}, lambda m: None, repeats=2)
    by = {c.phase: c for c in cells}  # passes: prefill 5.0, decode 6.0, prefill 7.5, decode None
    assert by["prefill"].host_us == [5.0, 7.5] and by["decode"].host_us == [6.0, None]


def test_the_plan_allowance_is_capped_by_the_task_timeout_not_the_budget(monkeypatch):
    """On an H100, at 0.8 x a 22.5 s phase budget the allowance (18 s) let Triton's decode compiles (23-33 s)
    cost 31-36 of ~115 decode buckets. The cap is 0.8 x the most a phase's budget may be (half the task timeout)."""
    assert timing.plan_allowance(22.5) == pytest.approx(18.0)  # no cap given: the budget's
    assert timing.plan_allowance(22.5, 300.0) == timing.PLAN_ALLOWANCE_S == 30.0
    assert timing.plan_allowance(5.0, 10.0) == pytest.approx(8.0)  # a 20 s timeout: the phase ends by 18 s
    assert timing.plan_allowance(None, 300.0) == 0.0  # no budget: nothing to leave out of it
    # graph mode gets it too since grid version 8 (tests/test_timing.py::test_first_use_compiles_do_not_eat_...)
    from attnsel.validate import worker

    seen = {}

    def measure(spec, phase, names, device, mode, budget, max_budget_s=None):
        seen.update(budget=budget, max_budget_s=max_budget_s)
        return {"wall_s": 1.0, "counted_s": 1.0, "buckets": []}

    monkeypatch.setattr(worker.timing, "measure", measure)
    job = {"mode": "eager", "measure": {"decode": {"backends": ["torch"], "vouched": ["torch"], "budget_s": 22.5,
                                                   "max_budget_s": 300.0}}}
    worker.time_phase("decode", SPEC, torch.device("cpu"), job, {}, unspent_s=2.0)
    assert seen == {"budget": 24.5, "max_budget_s": 300.0}


def test_compiles_within_the_capped_allowance_do_not_cost_buckets(monkeypatch):
    """measure with max_budget_s: 25 s of first-use compiles (one bucket's plans) and a 10 s budget keep every
    bucket; with the allowance capped by the budget (0.8 x 10 s) the budget runs out after the compiles."""
    clock = [0.0]
    first = [True]

    def bucket(cands, spec, phase, shape, device, mode, reps):
        plans = 25.0 if first[0] else 0.1
        first[0] = False
        clock[0] += plans + 1.0
        return {"us": {n: 10.0 for n in cands}, "spread": {n: 0.0 for n in cands}, "errors": {},
                "wall_s": {"plans": plans, "samples": 1.0}}

    monkeypatch.setattr(timing, "time_bucket", bucket)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    grid = [(0, (b, 16)) for b in (1, 2, 3, 4, 6, 8)]
    out = timing.measure(SPEC, "decode", ["a"], torch.device("cpu"), "eager", budget_s=10.0, grid=grid,
                         max_budget_s=300.0)
    assert len(out["buckets"]) == 6 and out["skipped"] == []
    first[0], clock[0] = True, 0.0
    out = timing.measure(SPEC, "decode", ["a"], torch.device("cpu"), "eager", budget_s=10.0, grid=grid)
    assert len(out["buckets"]) == 1 and len(out["skipped"]) == 5


@pytest.mark.parametrize("field", [{"host": "fast"}, {"host_us": -1.0}, {"host": float("nan")}])
def test_a_cached_host_probe_that_is_not_a_number_is_refused(field):
    bucket = {"key": [1, 256], "label": "1x256", "us": {"a": 1.0}, "errors": {}, "spread": {}, "host": 1.0,
              "host_us": 5.0}
    measured = {"phase": "decode", "mode": "eager", "axes": ["batch", "context"], "grid_version": 7,
                "buckets": [bucket]}
    entry = {"kind": "dispatch", "status": "timed", "measured": measured}
    assert entry_problem(entry) is None
    bad = {**entry, "measured": {**measured, "buckets": [{**bucket, **field}]}}
    assert "host probe that is not a number" in entry_problem(bad)


def test_a_phase_timed_again_in_a_fresh_worker_gets_its_share_and_the_timeout_cap(monkeypatch):
    """The path that times a phase again (candidates validated by a worker that died before the timing job) sends
    the phase's share of the budget and max_budget_s (the whole selection budget and no cap would let a phase
    outlast the task timeout)."""
    from attnsel import select
    from attnsel.validate import runner

    calls = []

    def run_tasks(spec, tasks, *, device, timeout=None, measure=False, mode="eager"):
        calls.append((list(tasks), measure))
        out = {}
        for name, phase in tasks:
            if name == timing.TIMING_TASK:  # the first timing lacks triton: its worker "died" before timing it
                times = {"torch": 10.0} if len(calls) == 1 else {"torch": 10.0, "triton": 5.0}
                out[(name, phase)] = {"status": "timed", "reason": "", "time_s": 1.0, "measured": {
                    "phase": phase, "mode": "eager", "grid_version": timing.GRID_VERSION,
                    "axes": list(bucket_grid.PREFILL_AXES if phase == "prefill" else bucket_grid.DECODE_AXES),
                    "reps": 3,
                    "buckets": [{"key": [1, 16, 16] if phase == "prefill" else [1, 32], "label": "b", "us": times,
                                 "spread": {}, "errors": {}}], "skipped": [], "wall_s": 1.0}}
            else:
                out[(name, phase)] = {"status": "valid", "reason": "", "max_abs_err": 1e-3, "tolerance": 1e-2,
                                      "time_s": 0.1}
        return out, runner.RunStats(spawns=1, wall_s=1.0)

    monkeypatch.setattr(runner, "run_tasks", run_tasks)
    order = ["triton", "torch"]
    sel = select(SPEC, prefill_priority=order, decode_priority=order, extend="torch", timeout=60, budget_s=40.0,
                 use_cache=False)
    again = [measure for tasks, measure in calls[1:]]
    assert len(again) == 2 and all(len(m) == 1 for m in again)
    for m in again:
        (phase, job), = m.items()
        assert job["budget_s"] == 20.0 and job["max_budget_s"] == 30.0, job
    assert sel.dispatch["decode"].backend_for((1, 32)) == "triton"
