"""Eager buckets timed while the host was slow are timed again (timing.HOST_SLOW, timing.host_probe).

On the H200 (2026-12-06, rounds 17 and 18) whole rows of eager decode buckets ran 1.5-2x slower for every host-bound
candidate; a row of them picked FlashInfer (GPU-bound) where Triton (host-bound) was 1.18x faster on a normal host.
These tests script the host probe and the bucket timings to check the rule: which buckets are timed again, which
timing is kept, the budget, the table, the report, the cache and the JSON.
"""
from __future__ import annotations

import json
import types

import pytest
import torch
from rich.console import Console

import attnsel.backends as backends_mod
from attnsel.cache import entry_problem
from attnsel.cli import dispatch_table
from attnsel.selection import DispatchTable, PhaseChoice, build_table
from attnsel.validate import timing
from tests.test_dispatch import SPEC, TORCH, _selection

GRID = [(0, (1, 256)), (0, (4, 256)), (0, (16, 256)), (2, (6, 256))]
NORMAL = {"triton": 40.0, "flashinfer": 45.0}  # host-bound Triton leads on a normal host
SLOW = {"triton": 60.0, "flashinfer": 45.0}  # a slow host inflates the host-bound one: FlashInfer "wins"


def scripted(plan: dict, log: list):
    """A time_bucket that returns, per shape, the next (host_us, times) of ``plan[shape]``."""

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        host, times = plan[shape].pop(0)
        log.append((shape, sorted(cands)))
        return {"us": {n: times[n] for n in cands}, "spread": {n: 0.01 for n in cands}, "errors": {},
                "host_us": host, "wall_s": {"samples": 1.0}}

    return fake_bucket


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    log: list = []

    def install(plan: dict):
        monkeypatch.setattr(timing, "time_bucket", scripted(plan, log))
        return log

    return install


def test_a_bucket_timed_on_a_slow_host_is_timed_again_and_keeps_the_faster_hosts_timing(fake):
    log = fake({(1, 256): [(5.0, NORMAL)], (4, 256): [(10.0, SLOW), (5.5, NORMAL)], (16, 256): [(5.9, NORMAL)],
                (6, 256): [(6.1, NORMAL), (6.3, SLOW)]})  # 6.1 / 5.0 = 1.22 >= HOST_SLOW: timed again, no faster
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    assert out["retimed"] == ["6x256", "4x256"]  # closest call first (1.125x, then 1.33x)
    assert [s for s, _ in log[4:]] == [(6, 256), (4, 256)] and log[4][1] == ["flashinfer", "triton"]
    b = {tuple(x["key"]): x for x in out["buckets"]}
    assert b[(4, 256)]["us"] == NORMAL and b[(4, 256)]["host_us"] == 5.5 and b[(4, 256)]["host_other_us"] == 10.0
    assert b[(4, 256)]["host"] == pytest.approx(1.1) and b[(1, 256)]["host"] == 1.0
    assert "host_other_us" not in b[(1, 256)] and b[(6, 256)]["us"] == NORMAL and b[(6, 256)]["host_other_us"] == 6.3
    table = build_table(out, ["flashinfer", "triton"])
    assert table.retimed == ("6x256", "4x256")
    assert {x.label: x.backend for x in table.buckets}["4x256"] == "triton"  # was flashinfer on the slow host
    assert {x.label: x.host for x in table.buckets}["4x256"] == pytest.approx(1.1)


def test_the_first_timing_stays_when_the_second_host_is_no_faster(fake):
    fake({(1, 256): [(5.0, NORMAL)], (4, 256): [(10.0, SLOW), (12.0, NORMAL)], (16, 256): [(5.0, NORMAL)],
          (6, 256): [(5.0, NORMAL)]})
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    b = {tuple(x["key"]): x for x in out["buckets"]}
    assert out["retimed"] == ["4x256"] and b[(4, 256)]["us"] == SLOW and b[(4, 256)]["host_other_us"] == 12.0
    assert b[(4, 256)]["host"] == 2.0


def test_a_clear_winner_on_a_slow_host_is_not_timed_again(fake):
    """Only close calls (runner-up within RETIME_CLOSE) are worth a second timing: a slow host moves host-bound
    candidates against the rest by up to ~1.7x, not a 3x lead."""
    clear = {"triton": 150.0, "flashinfer": 45.0}
    log = fake({(1, 256): [(5.0, NORMAL)], (4, 256): [(10.0, clear)], (16, 256): [(5.0, NORMAL)],
                (6, 256): [(9.0, {"triton": 40.0, "flashinfer": 60.1})]})
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    assert len(log) == 4 and out["retimed"] == []
    assert {tuple(b["key"]): b["host"] for b in out["buckets"]}[(4, 256)] == 2.0  # still reported as slow


def test_retiming_spends_at_most_its_share_of_the_budget(fake, monkeypatch):
    clock = [0.0]
    grid = [(0, (b, 256)) for b in (1, 2, 3, 4, 6, 8, 11, 16)]
    plan = {shape: [(5.0, NORMAL)] if shape[0] == 1 else [(9.0, SLOW), (5.0, NORMAL)] for _, shape in grid}
    inner = scripted(plan, [])

    def bucket(*args):
        clock[0] += 1.0
        return inner(*args)

    monkeypatch.setattr(timing, "time_bucket", bucket)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    # 8 buckets take 8 s of a 20 s budget; re-timing may spend RETIME_SHARE x 20 = 4 s: starts at 8, 9, 10, 11, 12
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", budget_s=20.0,
                         grid=grid)
    assert len(out["retimed"]) == 5 and out["wall_s"] == 13.0


def test_the_plan_allowance_is_capped_by_the_task_timeout_not_the_budget(monkeypatch):
    """Round 19 (H100): at 0.8 x a 22.5 s phase budget the allowance (18 s) let Triton's decode compiles (23-33 s)
    cost a third of the decode buckets. The cap is 0.8 x the most a phase's budget may be (half the task timeout)."""
    assert timing.plan_allowance("eager", 22.5) == pytest.approx(18.0)  # no cap given: the budget's
    assert timing.plan_allowance("eager", 22.5, 300.0) == timing.PLAN_ALLOWANCE_S == 30.0
    assert timing.plan_allowance("eager", 5.0, 10.0) == pytest.approx(8.0)  # a 20 s timeout: the phase ends by 18 s
    assert timing.plan_allowance("graph", 22.5, 300.0) == 0.0 and timing.plan_allowance("eager", None, 300.0) == 0.0
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


def test_no_probe_no_retiming(fake):
    """Graph replays and CPU timings carry no host probe: nothing is timed again, no bucket gets a host factor."""
    log = fake({shape: [(None, SLOW)] for _, shape in GRID})
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    assert out["retimed"] == [] and len(log) == len(GRID) and all("host" not in b for b in out["buckets"])
    assert all(b.host is None for b in build_table(out, ["flashinfer", "triton"]).buckets)


def test_retiming_stops_when_the_budget_is_spent(fake, monkeypatch):
    clock = [0.0]
    plan = {(1, 256): [(5.0, NORMAL)], (4, 256): [(10.0, SLOW), (5.0, NORMAL)],
            (16, 256): [(9.0, SLOW), (5.0, NORMAL)], (6, 256): [(5.0, NORMAL)]}
    inner = scripted(plan, [])

    def bucket(*args):
        clock[0] += 1.0
        return inner(*args)

    monkeypatch.setattr(timing, "time_bucket", bucket)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    # 4 buckets take 4 s; a budget of 4.5 s leaves room to start one more: the slowest host's bucket
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", budget_s=4.5,
                         grid=GRID)
    assert out["retimed"] == ["4x256"] and out["skipped"] == []
    b = {tuple(x["key"]): x for x in out["buckets"]}
    assert b[(4, 256)]["us"] == NORMAL and b[(16, 256)]["us"] == SLOW and b[(16, 256)]["host"] == 1.8
    assert out["wall_s"] == 5.0 and out["counted_s"] == 5.0


def test_time_bucket_probes_the_host_before_each_repetition(monkeypatch):
    """A real (CPU) bucket: one probe per repetition in eager mode, host_us their median in microseconds."""
    probes = iter([3e-6, 1e-6, 2e-6])
    calls = []

    def probe(device):
        calls.append(device)
        return next(probes)

    out = timing.time_bucket({"torch": TORCH}, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=3)
    assert out["host_us"] is None and set(out["us"]) == {"torch"}  # CPU: the real probe gives None
    monkeypatch.setattr(timing, "host_probe", probe)
    out = timing.time_bucket({"torch": TORCH}, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=3)
    assert len(calls) == 3 and out["host_us"] == pytest.approx(2.0)
    calls.clear()
    out = timing.time_bucket({}, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=3)
    assert calls == [] and out["host_us"] is None  # nothing to time: no probe


def test_host_probe_is_cuda_only():
    assert timing.host_probe(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_probe_times_a_launch_on_the_gpu():
    seconds = timing.host_probe(torch.device("cuda"))
    assert 1e-7 < seconds < 1e-3


def test_the_report_and_json_say_which_buckets_were_timed_again(fake):
    fake({(1, 256): [(5.0, NORMAL)], (4, 256): [(10.0, SLOW), (5.5, NORMAL)], (16, 256): [(5.0, NORMAL)],
          (6, 256): [(5.0, NORMAL)]})
    out = timing.measure(SPEC, "decode", ["triton", "flashinfer"], torch.device("cpu"), "eager", grid=GRID)
    table = build_table(out, ["flashinfer", "triton"])
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("triton", "auto", [], table)}), "decode", 200))
    assert ("1 bucket(s) timed again: the host was slow the first time (probe >= 1.2x the phase's fastest)"
            in " ".join(console.export_text().split()))
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table and again.retimed == ("4x256",)


@pytest.mark.parametrize("edit, field", [({"retimed": "4x256"}, None), ({"retimed": [3]}, None),
                                         (None, {"host": "fast"}), (None, {"host_us": -1.0})])
def test_a_cached_host_probe_or_retimed_list_that_is_malformed_is_refused(edit, field):
    bucket = {"key": [1, 256], "label": "1x256", "us": {"a": 1.0}, "errors": {}, "spread": {}, "host": 1.0,
              "host_us": 5.0}
    measured = {"phase": "decode", "mode": "eager", "axes": ["batch", "context"], "grid_version": 6,
                "buckets": [{**bucket, **(field or {})}], "retimed": [], **(edit or {})}
    entry = {"kind": "dispatch", "status": "timed", "measured": measured}
    assert entry_problem({**entry, "measured": {**measured, **{"retimed": ["1x256"]}, "buckets": [bucket]}}) is None
    assert entry_problem(entry) is not None
