"""The timing rules: HBM rotation, interleaved candidates, the bucket grids (levels, caps, wave batches), pruning,
calibration, the budget and its allowance, what a timed plan computed."""
import json
import logging
import math
import re
import types

import pytest
import torch

import attnsel.backends as backends_mod
from attnsel import AttentionSpec
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.selection import DispatchTable, PhaseChoice, build_table
from attnsel.validate import grid as bucket_grid
from attnsel.validate import runner, timing
from tests.fixtures.dispatch import SPEC, _selection


@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (28, 4)])
def test_every_timed_bucket_rotates_more_than_twice_the_l2(monkeypatch, heads):
    """Rotation covers the H200's 50 MB L2 twice over for every bucket of the real (GPU) grids."""
    monkeypatch.setattr(bucket_grid, "l2_bytes", lambda device: 50 << 20)
    spec = AttentionSpec(*heads, 128, "bf16", 16)
    cuda = torch.device("cuda")  # only its type is read: nothing is allocated
    item = 2
    for _, b, c in bucket_grid.decode_grid(spec, cuda, sms=132):
        kv_set = 2 * b * math.ceil(c / 16) * 16 * spec.num_kv_heads * 128 * item + b * spec.num_q_heads * 128 * item
        assert bucket_grid.num_sets(kv_set, cuda) * kv_set >= 2 * (50 << 20), (b, c)
    for _, lens in bucket_grid.prefill_grid(spec, cuda):
        t = sum(lens)
        qkv = t * (spec.num_q_heads + 2 * spec.num_kv_heads) * 128 * item
        assert bucket_grid.num_sets(qkv, cuda) * qkv >= 2 * (50 << 20), lens


def test_grids_are_coarse_first_and_within_the_caps():
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")
    dec = bucket_grid.decode_grid(spec, cuda)
    levels = [lvl for lvl, _, _ in dec]
    assert levels == sorted(levels) and levels[0] == 0
    coarse = {(b, c) for lvl, b, c in dec if lvl == 0}
    first, last = bucket_grid.DECODE_CTX[0], bucket_grid.DECODE_CTX[-1]
    assert (1, first) in coarse and (256, first) in coarse and (1, last) in coarse  # both ends of every axis
    assert bucket_grid.DECODE_CTX == (288, 544, 1056, 2080, 4128, 8224, 16416)  # half a 64-token tile past a power of 2
    assert {c for lvl, _, c in dec if lvl == 0} == {288, 1056, 4128, 16416}  # every other one and both ends
    base = dict(zip(bucket_grid.DECODE_CTX, bucket_grid.DECODE_CTX_POW2))  # the cap goes by the power of two below
    assert all(bucket_grid.decode_bytes(spec, b, base.get(c, c)) <= bucket_grid.MAX_DECODE_KV_BYTES for _, b, c in dec)
    # every bucket the power-of-two grid had under the cap is there, 32 tokens on (the half tile must not push
    # 64 x 16384, 128 x 8192 or 256 x 4096 over the 4 GiB cap)
    pow2 = {(b, p) for b in bucket_grid.DECODE_BATCHES for p in bucket_grid.DECODE_CTX_POW2
            if bucket_grid.decode_bytes(spec, b, p) <= bucket_grid.MAX_DECODE_KV_BYTES}
    short = bucket_grid.DECODE_SHORT_CTX
    assert {(b, c - bucket_grid.DECODE_TILE_TAIL) for _, b, c in dec if c != short} == pow2
    # and one short context for every batch size, at the finest level (a budget cuts it first); graphs have none
    assert {(lvl, b) for lvl, b, c in dec if c == short} == {(2, b) for b in bucket_grid.DECODE_BATCHES}
    assert short < first and all(c != short for _, _, c in bucket_grid.decode_grid(spec, cuda, mode="graph"))
    assert {(64, 16416), (128, 8224), (256, 4128)} <= {(b, c) for _, b, c in dec}
    assert all(sum(lens) <= bucket_grid.MAX_PREFILL_TOKENS for _, lens in bucket_grid.prefill_grid(spec, cuda))


class Logged:
    """A fake backend that logs (its name, the id of the q it ran on) for every run call."""

    calls: list = []

    def __init__(self, name):
        self.name = name

    def plan_decode(self, spec, page_table, seq_lens):
        run = TORCH.plan_decode(spec, page_table, seq_lens)
        return lambda q, k, v: (Logged.calls.append((self.name, id(q))), run(q, k, v))[1]


def test_candidates_are_interleaved_and_rotate_the_input_sets(monkeypatch):
    monkeypatch.setattr(bucket_grid, "num_sets", lambda nbytes, device: 3)
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

    import attnsel.backends.torch_sdpa as torch_sdpa

    capturing = [False]  # the captured calls run as captured ones: they read the metadata of each replay

    class ReplayLoop:  # what a CUDA graph does on replay: the captured calls write into the captured outputs
        def __init__(self, run, sets):
            self.run, self.sets = run, sets
            run(*sets[0])  # the warm-up outside capture
            capturing[0] = True
            self.outs = [run(*s) for s in sets]
            capturing[0] = False

        def replay(self):
            capturing[0] = True
            for out, s in zip(self.outs, self.sets):
                out.copy_(self.run(*s))
            capturing[0] = False

    if mode == "graph":
        monkeypatch.setattr(timing, "capture", lambda run, sets, device: (lambda g: (g, g.outs))(ReplayLoop(run, sets)))
        monkeypatch.setattr(torch_sdpa, "capturing", lambda t: capturing[0])
    monkeypatch.setattr(bucket_grid, "num_sets", lambda nbytes, device: 3)
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
    assert in torch's gather). Here the fake capture, like a real graph, keeps no reference to run."""
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

    plan_args, sets = bucket_grid.rotated_workloads(SPEC, "decode", (2, 32), torch.device("cpu"))
    item = timing._prepare(Tracked(), SPEC, "decode", plan_args, sets, "graph", torch.device("cpu"))
    gc.collect()
    assert refs[0]() is not None, "the plan died while its graph can still be replayed"
    item.unit(0)
    del item
    gc.collect()
    assert refs[0]() is None


def test_decode_grid_shrinks_with_free_memory():
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")
    full = bucket_grid.decode_grid(spec, cuda)
    small = bucket_grid.decode_grid(spec, cuda, free_bytes=6 << 30)  # 6 GiB free: KV sets of at most 1 GiB
    assert len(small) < len(full)
    assert all(bucket_grid.decode_bytes(spec, b, c - bucket_grid.DECODE_TILE_TAIL) <= 1 << 30 for _, b, c in small)
    assert {(b, c) for _, b, c in small} <= {(b, c) for _, b, c in full}


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
    of the budget and the table lost 31 of 106 buckets. Under CUDA graphs too: counted in full, the step that holds
    the captures let a cold Triton cache cost an H100 35 of 68 graph decode buckets at 8/1 heads. A fake clock: each
    bucket spends 1 s in plans and 0.5 s in samples."""
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


def test_sqrt2_steps_are_the_finest_level():
    lens = bucket_grid.PREFILL_LENS
    assert bucket_grid._level(72, lens) == 0 and bucket_grid._level(18432, lens) == 0
    assert bucket_grid._level(144, bucket_grid.PREFILL_LENS) == 1
    assert all(bucket_grid._level(v, bucket_grid.PREFILL_LENS) == 2 for v in (102, 204, 13033))
    assert [bucket_grid._level(b, bucket_grid.DECODE_BATCHES) for b in (1, 2, 3, 4, 6, 256)] == [0, 1, 2, 0, 2, 0]
    cuda = torch.device("cuda")
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    graph = bucket_grid.decode_grid(spec, cuda, mode="graph")
    assert {c for _, _, c in graph} == set(bucket_grid.GRAPH_DECODE_CTX)
    assert {b for _, b, _ in graph} == set(bucket_grid.DECODE_BATCHES)
    # every value between powers of two lies within a factor 1.5 of its neighbours
    for values in (bucket_grid.PREFILL_LENS, bucket_grid.DECODE_BATCHES[1:]):
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
    from attnsel.render import dispatch_table
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


def test_a_budget_cut_leaves_gaps_spread_over_the_level():
    grid = [(2, b) for b in range(10)] + [(0, "a"), (1, "b")]
    ordered = bucket_grid._coarse_first(grid)
    assert [x for _, x in ordered[:2]] == ["a", "b"]
    finest = [x for _, x in ordered[2:]]
    assert sorted(finest) == list(range(10))
    assert finest[:4] == [0, 8, 4, 2]  # the first four of ten: spread over the range, not the smallest four


def test_a_graph_budget_cut_leaves_out_whole_batch_sizes():
    """Graph mode scores a batch size by its geometric mean over contexts; a budget cut must not leave some batch
    sizes timed at context 256 only (a flat bit-reversed order would do that)."""
    cuda = torch.device("cuda")
    grid = bucket_grid.decode_grid(AttentionSpec(32, 8, 128, "bf16", 16), cuda, mode="graph", sms=132)
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


def test_wave_batches_bracket_the_first_three_wave_edges():
    """132 SMs (H100, H200): one block per (row, KV head) fills k rounds up to k x 132 / kv_heads rows."""
    h = lambda q, kv: AttentionSpec(q, kv, 128, "bf16", 16)
    # 28/4: edges at 33, 66, 99 rows; 32 and 64 already have 1 and 2 rounds, 91 is more than 5% below 99
    assert bucket_grid.wave_batches(h(28, 4), 132) == [34, 67, 99, 100]
    assert bucket_grid.wave_batches(h(32, 8), 132) == [17, 34, 49, 50]  # edges 16.5, 33, 49.5
    # 8/1: edges at 132, 264, 396 rows; 132 and 256 (within 5% below 264) are grid values
    assert bucket_grid.wave_batches(h(8, 1), 132) == [133, 265, 396, 397]
    assert bucket_grid.wave_batches(h(32, 8), None) == [] and bucket_grid.wave_batches(h(32, 8), 0) == []
    for heads in ((32, 8), (28, 4), (8, 1), (32, 32), (16, 2), (64, 8)):
        for sms in (78, 108, 114, 132, 170):
            spec = h(*heads)
            waves = bucket_grid.wave_batches(spec, sms)
            assert not set(waves) & set(bucket_grid.DECODE_BATCHES) and waves == sorted(set(waves))
            assert all(1 <= b <= bucket_grid.DECODE_BATCHES[-1] for b in waves)
            for k in range(1, bucket_grid.WAVE_EDGES + 1):  # a timed value on each side of each edge
                edge = k * sms / spec.num_kv_heads
                if math.floor(edge) + 1 > bucket_grid.DECODE_BATCHES[-1]:
                    break
                rounds = lambda b: math.ceil(b * spec.num_kv_heads / sms)
                values = sorted(set(bucket_grid.DECODE_BATCHES) | set(waves))
                below = max(v for v in values if v <= edge)
                above = min(v for v in values if v > edge)
                assert rounds(below) == k and rounds(above) == k + 1, (heads, sms, k, below, above)
                assert below >= 0.95 * math.floor(edge) and above == math.floor(edge) + 1, (heads, sms, k)


def test_wave_batches_join_the_decode_grids_at_the_finest_level():
    cuda = torch.device("cuda")  # only its type is read
    spec = AttentionSpec(28, 4, 128, "bf16", 16)
    for mode, contexts, bases in (("eager", bucket_grid.DECODE_CTX, bucket_grid.DECODE_CTX_POW2),
                                  ("graph", bucket_grid.GRAPH_DECODE_CTX, bucket_grid.GRAPH_DECODE_CTX)):
        plain = bucket_grid.decode_grid(spec, cuda, mode=mode)
        grid = bucket_grid.decode_grid(spec, cuda, mode=mode, sms=132)
        added = [(lvl, b, c) for lvl, b, c in grid if b not in bucket_grid.DECODE_BATCHES]
        assert {b for _, b, _ in added} == {34, 67, 99, 100}
        assert all(lvl == 2 for lvl, _, _ in added)
        cap = bucket_grid.MAX_DECODE_KV_BYTES
        short = {(b, bucket_grid.DECODE_SHORT_CTX) for b in (34, 67, 99, 100)} if mode == "eager" else set()
        assert {(b, c) for _, b, c in added} == short | {(b, c) for b in (34, 67, 99, 100)
                                                         for c, p in zip(contexts, bases)
                                                         if bucket_grid.decode_bytes(spec, b, p) <= cap}
        assert sorted(x for x in grid if x[1] in bucket_grid.DECODE_BATCHES) == sorted(plain)  # the rest unchanged
        assert [x for x in grid if x[0] < 2] == [x for x in plain if x[0] < 2]  # coarser levels first, in order
        levels = [lvl for lvl, _, _ in grid]
        assert levels == sorted(levels)



def test_the_timed_grid_covers_what_a_server_sends():
    """Past the grid's ends a shape is served by its edge bucket, which is not the same kernel regime (held out on an
    H100: 40 prompts of 25 tokens 1.4-1.7x off the fastest from the 72-token edge; 300-500-row decode batches up to
    1.15x from the 256-row edge). The grid reaches the held-out sampler's ranges: prompts from 16 tokens (the first
    timed length at most 9/8 of it), decode batches to 512 rows (eager, graph capture sizes, and ragged batches
    within the sub-table's factor 2)."""
    from attnsel import bench_cells

    assert bucket_grid.PREFILL_LENS[0] <= 9 / 8 * bench_cells.PREFILL_LEN_MIN
    assert bucket_grid.DECODE_BATCHES[-1] >= bench_cells.DECODE_BATCH_MAX >= max(bench_cells.CAPTURE_SIZES)
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")  # the grids read no device
    for mode in ("eager", "graph"):
        assert max(b for _, b, _ in bucket_grid.decode_grid(spec, cuda, mode=mode)) >= bench_cells.DECODE_BATCH_MAX
    ragged = {len(lens) for _, lens in bucket_grid.ragged_decode_grid(spec, cuda)}
    assert any(b / 2 <= 400 <= 2 * b for b in ragged)


def test_eager_finer_buckets_skip_candidates_slow_at_every_nearby_coarse_bucket(monkeypatch):
    """A candidate that wins somewhere (so the global prune keeps it) but is at least PRUNE times slower at every
    coarse bucket within a coarse step (4x per axis) of a finer bucket is not timed there: FlashInfer's FA3 decode
    template wins batches of 1-6 rows and is 3-5x slower at hundreds, where each of its samples is the longest.
    Where no coarse bucket is near, or in graph mode (a batch size is scored over all its contexts), every kept
    candidate is timed."""
    seen = []
    speed = {"small": {"fast": 12.0, "small": 10.0}, "big": {"fast": 10.0, "small": 40.0}}

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        seen.append((shape, sorted(cands)))
        us = {n: speed["small" if shape[0] <= 8 else "big"][n] for n in cands}
        return {"us": us, "spread": {n: 0.0 for n in us}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    grid = [(0, (1, 1024)), (0, (4, 1024)), (0, (16, 1024)), (0, (64, 1024)), (0, (256, 1024)),
            (1, (2, 1024)), (2, (11, 1024)), (1, (32, 1024)), (2, (181, 1024)), (2, (2048, 1024))]
    out = timing.measure(SPEC, "decode", ["fast", "small"], torch.device("cpu"), "eager", reps=1, grid=grid)
    finer = dict(seen[5:])
    assert finer[(2, 1024)] == ["fast", "small"] and finer[(11, 1024)] == ["fast", "small"]  # 4 rows are near
    assert finer[(32, 1024)] == ["fast"] and finer[(181, 1024)] == ["fast"]  # 16, 64 / 64, 256: 4x slower at all
    assert finer[(2048, 1024)] == ["fast", "small"]  # no coarse bucket within 4x: every kept candidate
    assert out["pruned"] == {} and out["pruned_near"] == {"small": 2}
    seen.clear()
    timing.measure(SPEC, "decode", ["fast", "small"], torch.device("cpu"), "graph", reps=1, grid=grid)
    assert all(names == ["fast", "small"] for _, names in seen)


class Slowed(Logged):
    """Logged, each run ``delay`` seconds slower (a candidate far behind the fastest); ``delay`` may be a function,
    called before each run for its seconds (a host whose speed changes)."""

    def __init__(self, name, delay):
        super().__init__(name)
        self.delay = delay

    def plan_decode(self, spec, page_table, seq_lens):
        import time
        run = super().plan_decode(spec, page_table, seq_lens)

        def slowed(q, k, v):
            time.sleep(self.delay() if callable(self.delay) else self.delay)
            return run(q, k, v)

        return slowed


def test_eager_timing_stops_sampling_a_candidate_far_behind(monkeypatch):
    """Eager buckets take REPS_EAGER samples; a candidate whose every one of its first RACE_AFTER samples is at least
    RACE_OUT x the leader's median is not sampled further (its time: from those), listed in "raced".
    Candidates within that factor take every sample; its output is still checked."""
    monkeypatch.setattr(bucket_grid, "num_sets", lambda nbytes, device: 2)
    Logged.calls.clear()
    cands = {"fast": Logged("fast"), "close": Logged("close"), "far": Slowed("far", 0.02)}
    out = timing.time_bucket(cands, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=21)
    assert out["raced"] == ["far"] and set(out["us"]) == {"fast", "close", "far"} and not out["errors"]
    runs = {n: sum(1 for c, _ in Logged.calls if c == n) for n in cands}
    # one first run, one calibration sample, the samples, two checked runs (two more for the leader, checked at the
    # race: whichever of fast and close was ahead then)
    assert runs["far"] == 1 + 1 + timing.RACE_AFTER + 2
    assert sorted((runs["fast"], runs["close"])) == [1 + 1 + 21 + 2, 1 + 1 + 21 + 2 + 2]
    assert out["us"]["far"] >= timing.RACE_OUT * out["us"]["fast"]
    assert timing.RACE_AFTER == 7 and timing.RACE_OUT == timing.PRUNE
    Logged.calls.clear()  # as many samples as RACE_AFTER or fewer (CUDA graphs: REPS): nothing is raced
    out = timing.time_bucket(cands, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=timing.RACE_AFTER)
    assert "raced" not in out and sum(1 for c, _ in Logged.calls if c == "far") == 1 + 1 + timing.RACE_AFTER + 2


class Memo:
    """A fast right plan: each input set's output computed once by torch, then handed back as a fresh copy; its run
    raises from its ``fail_at``-th call on (a device error after some fine samples)."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def plan_decode(self, spec, page_table, seq_lens):
        run, memo, calls = TORCH.plan_decode(spec, page_table, seq_lens), {}, [0]

        def run_memo(q, k, v):
            calls[0] += 1
            if self.fail_at is not None and calls[0] >= self.fail_at:
                raise RuntimeError("device lost")
            if id(q) not in memo:
                memo[id(q)] = run(q, k, v)
            return memo[id(q)].clone()

        return run_memo


@pytest.mark.parametrize("leader,reason", [
    ("skip_work", "wrong output after the timed eager runs: "),  # fast, its stale output checked
    ("raises before the race", "raised RuntimeError: device lost"),  # its 5th sample raises
    ("raises after the race", "raised RuntimeError: device lost")])  # a sample after RACE_AFTER raises
def test_a_candidate_without_a_time_races_no_one_out(monkeypatch, leader, reason):
    """Only a candidate that keeps its time (its output checked, no error) races others out: one far ahead that turns
    out wrong or raises must not leave the bucket's winner with RACE_AFTER samples, listed as raced."""
    from tests.fixtures import fault_numerics as faults

    monkeypatch.setattr(bucket_grid, "num_sets", lambda nbytes, device: 2)
    bad = {"skip_work": faults.SKIP_WORK, "raises before the race": Memo(fail_at=7),
           "raises after the race": Memo(fail_at=14)}[leader]
    Logged.calls.clear()
    cands = {"bad": bad, "torch": Logged("torch"), "far": Slowed("far", 0.02)}
    out = timing.time_bucket(cands, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=21)
    assert set(out["us"]) == {"torch", "far"} and out["errors"]["bad"].startswith(reason), out
    assert out.get("raced") == ["far"], out
    runs = {n: sum(1 for c, _ in Logged.calls if c == n) for n in ("torch", "far")}
    # first run, calibration, samples, checked runs (the leader's also when it races others out)
    assert runs == {"torch": 1 + 1 + 21 + 2 + 2, "far": 1 + 1 + timing.RACE_AFTER + 2}


def test_a_raced_candidate_stays_behind_when_the_host_slows_after_the_race(monkeypatch):
    """A raced candidate's samples come from the first RACE_AFTER repetitions only. The host slowing 6x after them
    (every candidate alike) must not make a candidate 1.5x behind look faster than the leader, whose later samples
    took the slowdown: its time follows the leader's median over the same repetitions."""
    monkeypatch.setattr(bucket_grid, "num_sets", lambda nbytes, device: 2)
    host = {"calls": 0}
    before_race = 2 * (1 + 1 + timing.RACE_AFTER)  # two candidates' first runs, calibration and first samples

    def host_bound(seconds):
        def delay():
            host["calls"] += 1
            return seconds * (6 if host["calls"] > before_race else 1)

        return delay

    # far 4x behind (far past RACE_OUT, whatever the loaded host adds to a call), then the host 6x slower: by its
    # own samples far would look faster than fast
    cands = {"fast": Slowed("fast", host_bound(0.005)), "far": Slowed("far", host_bound(0.02))}
    out = timing.time_bucket(cands, SPEC, "decode", (2, 32), torch.device("cpu"), "eager", reps=21)
    assert out["raced"] == ["far"] and not out["errors"]
    assert out["us"]["far"] > 1.2 * out["us"]["fast"], out["us"]


def test_graph_timing_plans_on_the_lengths_engines_capture_with(monkeypatch):
    """Engines plan a graph's batch on dummy lengths (decode: 1 token per sequence), capture, then write each step's
    lengths into the planned tensor before replay. The timing does the same, so that a plan-time choice made from
    the lengths (Triton's split count) is the one an engine replays, not one made for the bucket's own lengths."""
    from attnsel.validate.engine_capture import capture_args

    seen = {}

    class Recording:
        name = "recording"

        def plan_decode(self, spec, page_table, seq_lens):
            seen["planned"] = seq_lens.tolist()

            def run(q, k, v):
                seen.setdefault("runs", []).append(seq_lens.tolist())  # what a replay reads
                return torch.zeros_like(q)

            return run

    monkeypatch.setattr(timing, "capture", lambda run, sets, device: (
        types.SimpleNamespace(replay=lambda: run(*sets[0])), [run(*s) for s in sets]))
    plan_args, sets = bucket_grid.rotated_workloads(SPEC, "decode", (2, 32), torch.device("cpu"))
    item = timing._prepare(Recording(), SPEC, "decode", plan_args, sets, "graph", torch.device("cpu"))
    item.unit(0)
    assert seen["planned"] == [1, 1] and seen["runs"][0] == [1, 1], seen  # planned and captured as engines do
    assert seen["runs"][-1] == plan_args[1].tolist() == [32, 32], seen  # replayed on the bucket's lengths
    eager = timing._prepare(Recording(), SPEC, "decode", plan_args, sets, "eager", torch.device("cpu"))
    eager.unit(0)
    assert seen["planned"] == [32, 32]  # eager plans on the batch's own lengths

    # extend: each row's queries (at least 1 where it has keys); rows of 0 tokens stay 0 (CUDA-graph padding)
    cu_q = torch.tensor([0, 2, 2, 5, 5], dtype=torch.int32)
    lens = torch.tensor([40, 7, 3, 0], dtype=torch.int32)
    args, fill = capture_args("extend", (cu_q, "table", lens, 3, 40))
    assert args[2].tolist() == [2, 1, 3, 0] and args[2] is not lens and args[:2] == (cu_q, "table")
    fill()
    assert args[2].tolist() == [40, 7, 3, 0]
    args, fill = capture_args("prefill", (cu_q, cu_q, 3, 3))
    assert args == (cu_q, cu_q, 3, 3)
