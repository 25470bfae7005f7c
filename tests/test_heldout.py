"""`attnsel bench --heldout SEED`: the cell sampler (deterministic, in range, never on the timed grid), the
statistics (within 3%, geometric mean, worst, bootstrap intervals, the per-batch-size bound) on hand-made numbers,
the flags, and the held-out plumbing end to end on the CPU with recorded-style fake times (the timing needs CUDA)."""
import json
import math

import numpy as np
import pytest
import torch
from rich.console import Console

from attnsel import bench, bench_cells, bench_heldout, bench_stats
from attnsel.bench_cells import HeldoutCell, sample_cells
from attnsel.selection import PhaseChoice, Selection, build_table
from attnsel.spec import AttentionSpec
from attnsel.validate import grid
from tests.test_cli import run
from tests.fixtures.dispatch import fake_worker, measured

SPECS = [AttentionSpec(32, 8, 128), AttentionSpec(28, 4, 128), AttentionSpec(8, 1, 128)]
CUDA = torch.device("cuda")  # the GPU grids; no device is touched


# ---- the sampler ----

def test_cells_are_the_same_for_a_seed_and_differ_across_seeds():
    for phase in ("prefill", "decode"):
        for mode in ("eager", "graph"):
            one = sample_cells(SPECS[0], phase, mode, 1, 20, 132)
            assert one == sample_cells(SPECS[0], phase, mode, 1, 20, 132)
            assert len(one) == 20 and len(set(one)) == 20
            other = sample_cells(SPECS[0], phase, mode, 2, 20, 132)
            assert len(set(one) & set(other)) <= 1
    # the decode streams of the two modes are their own; prefill is drawn once for both modes
    assert sample_cells(SPECS[0], "decode", "eager", 1, 5, 132) != sample_cells(SPECS[0], "decode", "graph", 1, 5, 132)
    assert sample_cells(SPECS[0], "prefill", "eager", 1, 5, 132) == sample_cells(SPECS[0], "prefill", "graph", 1, 5,
                                                                                  132)


def test_prefill_cells_keep_to_their_ranges():
    cells = sample_cells(SPECS[0], "prefill", "eager", 3, 400, 132)
    for c in cells:
        assert 1 <= c.batch <= 64 and all(16 <= n <= 32768 for n in c.lens) and sum(c.lens) <= 65536
        assert c.ragged == (len(set(c.lens)) > 1) and c.key == (c.batch, sum(c.lens), max(c.lens))
        assert c.shape == list(c.lens)
    batches = [c.batch for c in cells]
    assert min(batches) == 1 and max(batches) >= 48
    lens = [n for c in cells for n in c.lens]
    assert min(lens) < 24 and max(lens) > 16384  # both ends of the log-uniform range are reached
    assert 0.3 < np.mean([c.ragged for c in cells if c.batch > 1]) < 0.7


def test_decode_cells_keep_to_their_ranges_and_graph_batches_are_capture_sizes():
    for mode in ("eager", "graph"):
        cells = sample_cells(SPECS[0], "decode", mode, 3, 400, 132)
        for c in cells:
            assert 1 <= c.batch <= 512 and all(16 <= n <= 32768 for n in c.lens) and sum(c.lens) <= 1 << 20
            assert c.ragged == (len(set(c.lens)) > 1)
            if c.ragged:
                assert c.shape == list(c.lens) and c.key == (c.batch, -(-sum(c.lens) // c.batch), max(c.lens))
            else:
                assert c.shape == (c.batch, c.lens[0]) == c.key
        batches = {c.batch for c in cells}
        assert 1 in batches and max(batches) > 256
        assert 0.3 < np.mean([c.ragged for c in cells if c.batch > 1]) < 0.7
        if mode == "graph":
            assert batches <= {1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)}
        else:
            assert len(batches) > 100  # any batch size, not only captured ones
    contexts = [c.lens[0] for c in sample_cells(SPECS[0], "decode", "eager", 4, 400, 132) if not c.ragged]
    assert np.median(contexts) == pytest.approx(1024, rel=0.35)  # median 1024, heavy on both sides
    assert min(contexts) < 128 and max(contexts) > 8192


@pytest.mark.parametrize("spec", SPECS + [AttentionSpec(40, 8, 128), AttentionSpec(16, 8, 256)])
def test_no_cell_is_a_timed_bucket(spec):
    """Checked against the grids as the selection builds them (grid.prefill_grid, decode_grid with the wave
    batches of 132 SMs, ragged_decode_grid), not against the sampler's own list."""
    timed_pre = {grid.prefill_key(lens) for _, lens in grid.prefill_grid(spec, CUDA)}
    for mode in ("eager", "graph"):
        timed_dec = {(b, c) for _, b, c in grid.decode_grid(spec, CUDA, mode=mode, sms=132)}
        timed_rag = {grid.ragged_key(lens) for _, lens in grid.ragged_decode_grid(spec, CUDA, mode=mode)}
        for c in sample_cells(spec, "prefill", mode, 5, 300, 132):
            assert c.key not in timed_pre
        for c in sample_cells(spec, "decode", mode, 5, 300, 132):
            assert c.key[:2] not in timed_dec | timed_rag


def test_a_draw_on_the_grid_or_seen_before_is_drawn_again(monkeypatch):
    on_grid = HeldoutCell("prefill", (1152,) * 4, False)  # 4 prompts of 1152: a timed prefill bucket
    assert on_grid.key in {grid.prefill_key(lens) for _, lens in grid.prefill_grid(SPECS[0], CUDA)}
    fresh, other = HeldoutCell("prefill", (1000,) * 4, False), HeldoutCell("prefill", (999, 17), True)
    draws = iter([on_grid, fresh, fresh, on_grid, other])
    monkeypatch.setattr(bench_cells, "draw_prefill", lambda rng: next(draws))
    assert sample_cells(SPECS[0], "prefill", "eager", 1, 2, 132) == [fresh, other]
    on_graph = HeldoutCell("decode", (1024,) * 6, False)  # batch 6 at a graph context; eager contexts are 2^k + 32
    monkeypatch.setattr(bench_cells, "draw_decode", lambda rng, mode, cap: on_graph)
    assert sample_cells(SPECS[0], "decode", "eager", 1, 1, 132) == [on_graph]
    with pytest.raises(RuntimeError, match="no decode cell off the timed grid in 1000 draws"):
        sample_cells(SPECS[0], "decode", "graph", 1, 1, 132)


def test_wave_batches_of_the_device_are_avoided():
    """28/4 heads on 132 SMs time batch 34 (a wave edge): a uniform 34 x 1024 graph cell is on the grid there, not
    on a GPU whose edges lie elsewhere."""
    cell = HeldoutCell("decode", (1024,) * 34, False)
    assert cell.point() in bench_cells.timed_points(SPECS[1], "decode", "graph", 132)
    assert cell.point() not in bench_cells.timed_points(SPECS[1], "decode", "graph", 108)
    assert 34 in bench_cells.timed_batches(SPECS[1], "graph", 132)


def test_bad_seed_and_phase_are_refused():
    with pytest.raises(ValueError, match="non-negative integer, got -1"):
        sample_cells(SPECS[0], "decode", "eager", -1, 1, 132)
    with pytest.raises(ValueError, match="phase must be prefill, decode or extend"):
        sample_cells(SPECS[0], "verify", "eager", 1, 1, 132)


# ---- the statistics ----

def test_point_statistics_on_hand_made_ratios():
    got = bench_stats.point_stats([1.0, 1.02, 1.10, None, 1.03])
    assert got["within"] == 3 / 5  # the cell without a time is a miss; 1.03 is within
    assert got["geomean"] == pytest.approx((1.0 * 1.02 * 1.10 * 1.03) ** 0.25)
    assert got["worst"] == 1.10
    assert bench_stats.point_stats([None]) == {"within": 0.0, "geomean": None, "worst": None}
    with pytest.raises(ValueError, match="no cells"):
        bench_stats.point_stats([])
    with pytest.raises(ValueError, match=r"\(>= 1, finite\)"):
        bench_stats.point_stats([0.9, 1.0])


def test_bootstrap_matches_a_plain_loop_and_is_seeded():
    values = [1.0, 1.0, 1.01, 1.05, 1.2, None, 1.0, 1.5, 1.02, 1.0]
    got = bench_stats.bootstrap(values, seed=7, resamples=500)
    assert got == bench_stats.bootstrap(values, seed=7, resamples=500)
    assert got != bench_stats.bootstrap(values, seed=8, resamples=500)
    # the same resamples, one at a time, through point_stats
    idx = np.random.default_rng(7).integers(0, len(values), size=(500, len(values)))
    per = [bench_stats.point_stats([values[i] for i in row]) for row in idx]
    for key in ("within", "geomean", "worst"):
        xs = [p[key] for p in per if p[key] is not None]
        assert got[f"{key}_ci"] == pytest.approx(list(np.percentile(xs, [2.5, 97.5])))
    point = bench_stats.point_stats(values)
    for key in ("within", "geomean", "worst"):
        lo, hi = got[f"{key}_ci"]
        assert lo <= point[key] <= hi and lo < hi
    assert got["worst_ci"][1] == 1.5  # a resample cannot be worse than the worst cell
    same = bench_stats.bootstrap([1.1] * 6, seed=1)
    assert same == {"within_ci": [0.0, 0.0], "geomean_ci": [pytest.approx(1.1)] * 2, "worst_ci": [1.1, 1.1]}


def test_interval_narrows_with_more_cells():
    rng = np.random.default_rng(0)
    many = list(1 + rng.exponential(0.03, 400))
    wide = bench_stats.bootstrap(many[:20], seed=1)["within_ci"]
    narrow = bench_stats.bootstrap(many, seed=1)["within_ci"]
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 2


def _row(spec, phase, mode, batch, ratios, **extra):
    fastest = min(ratios, key=lambda n: ratios[n] if ratios[n] else math.inf)
    return {"spec": spec, "phase": phase, "mode": mode, "batch": batch, "ratios": ratios, "fastest": fastest,
            **extra}


def test_batch_bound_picks_one_backend_per_batch_size_afterwards():
    rows = [_row("32/8", "decode", "graph", 8, {"a": 1.0, "b": 1.02}),
            _row("32/8", "decode", "graph", 8, {"a": 1.05, "b": 1.0}),
            _row("32/8", "decode", "graph", 8, {"a": 1.0, "b": 1.2}),
            # batch 16: b is within 3% twice, a once (and a lacks a time in one cell)
            _row("32/8", "decode", "graph", 16, {"a": 1.0, "b": 1.01}),
            _row("32/8", "decode", "graph", 16, {"b": 1.0}),
            _row("32/8", "decode", "graph", 16, {"a": 1.0, "b": 1.1}),
            _row("28/4", "decode", "graph", 8, {"a": 1.3, "b": 1.0}),  # another spec: its own choice
            _row("32/8", "decode", "eager", 8, {"a": 1.3, "b": 1.0}),  # eager: no bound
            _row("32/8", "prefill", "graph", 8, {"a": 1.3, "b": 1.0})]
    bench_stats.batch_bound(rows)
    # batch 8: a and b both within 3% in 2 of 3 cells; a's geometric mean (1.05^(1/3)) beats b's ((1.02 x 1.2)^(1/3))
    assert [r["batch_bound"] for r in rows[:3]] == ["a"] * 3 and [r["batch_bound_ratio"] for r in rows[:3]] == [
        1.0, 1.05, 1.0]
    assert [r["batch_bound"] for r in rows[3:6]] == ["b"] * 3
    assert rows[6]["batch_bound"] == "b"
    assert not any("batch_bound" in r for r in rows[7:])
    # a pick without a time in a cell is a miss there, as for any strategy
    rows = [_row("x", "decode", "graph", 4, {"a": 1.0}), _row("x", "decode", "graph", 4, {"b": 1.0}),
            _row("x", "decode", "graph", 4, {"a": 1.0, "b": 1.5})]
    bench_stats.batch_bound(rows)
    assert [r["batch_bound_ratio"] for r in rows] == [1.0, None, 1.0]


def test_summary_groups_specs_all_and_untimed_graph_batches():
    rows = []
    for spec, sel in (("32/8", [1.0, 1.04, 1.0, 1.2]), ("40/8", [1.0, 1.0, 1.01, 1.1])):
        for i, ratio in enumerate(sel):
            rows.append(_row(spec, "decode", "graph", 8 if i < 2 else 24, {"a": 1.0}, selected="a",
                             selected_ratio=ratio, static="b", static_ratio=None, timed_batch=i < 2))
        rows.append(_row(spec, "prefill", "eager", 1, {"a": 1.0}, selected="a", selected_ratio=1.0))
    summary = bench_stats.summarise(rows, seed=1)
    by = {(s["spec"], s["phase"], s["mode"], s["strategy"]): s for s in summary}
    assert by["all", "decode", "graph", "selected"]["timed"] == 8
    assert by["all", "decode", "graph", "selected"]["within"] == 5 / 8
    assert by["all", "decode", "graph", "selected"]["worst"] == 1.2
    assert by["32/8", "decode", "graph", "selected"]["geomean"] == pytest.approx((1.04 * 1.2) ** 0.25)
    untimed = by["all", "decode, untimed batch", "graph", "selected"]
    assert untimed["timed"] == 4 and untimed["within"] == 2 / 4 and untimed["worst"] == 1.2
    assert by["40/8", "decode", "graph", "static"]["no_time"] == 4 and by["40/8", "decode", "graph", "static"][
        "within"] == 0.0
    assert by["all", "prefill", "eager", "selected"]["within_ci"] == [1.0, 1.0]
    assert [s["spec"] for s in summary][0] == "all"  # pooled rows first
    assert not any(s["spec"] == "all" for s in bench_stats.summarise(rows[:5], seed=1))  # one spec: no pooled rows


# ---- the flags ----

@pytest.mark.parametrize("argv, message", [
    (["--heldout", "x"], "--heldout takes the seed of the draw, a non-negative integer (e.g. --heldout 1); got 'x'"),
    (["--heldout", "-3"], "--heldout takes the seed of the draw, a non-negative integer (e.g. --heldout 1); got '-3'"),
    (["--heldout", "1", "--cells", "0"], "--cells takes N or PREFILL,DECODE, whole numbers of cells from 1 to 1000 "
                                         "(e.g. --cells 8 or --cells 8,16); got '0'"),
    (["--heldout", "1", "--cells", "4,8,2,1"], "got '4,8,2,1'"),
    (["--heldout", "1", "--phases", "prefill,verify"], "--phases takes phases from prefill, decode, extend"),
    (["--phases", "extend"], "--phases sets the held-out phases: give --heldout SEED too"),
    (["--cells", "4"], "--cells sets the held-out cells per phase: give --heldout SEED too"),
    (["--heldout", "1", "--quick"], "--quick picks the fixed grid's smaller set; with --heldout set the cells with "
                                    "--cells"),
    (["--specs", "32/x"], "--specs item '32/x': expected Q/KV heads first; each item is "
                          "Q/KV[/HEAD_DIM][/DTYPE][/pPAGE], e.g. 32/8, 32/8/64/fp16 or 32/8/p1"),
    (["--specs", "32/8/int4"], "--specs item '32/8/int4': 'int4' is neither a head_dim, a dtype (bf16, fp16, "
                               "fp32) nor a page size (p1, p16, ...)"),
    (["--specs", "32/8/p0"], "--specs item '32/8/p0': page_size must be a positive integer, got 0"),
    (["--specs", "32/8/p1/p16"], "--specs item '32/8/p1/p16': page_size given twice"),
    (["--specs", "32/8/64/bf16/p1/p2"], "--specs item '32/8/64/bf16/p1/p2': 6 fields, at most 5"),
    (["--specs", "32/5"], "--specs item '32/5': num_q_heads (32) must be a multiple of num_kv_heads (5)"),
    (["--specs", "32/8", "--num-heads", "4"], "--specs gives each spec's heads, head_dim and dtype; it does not go "
                                              "with --num-heads (use one or the other)"),
])
def test_bad_heldout_flags_exit_2_with_the_reason(capsys, argv, message):
    code, out, err = run(capsys, "bench", *argv)
    assert code == 2 and message in err and err.startswith("attnsel: error: ")


def test_a_specs_item_may_carry_its_page_size():
    from attnsel.bench_args import parse_specs
    one, wide, default, flag = parse_specs("32/8/p1, 32/8/64/fp16/p64, 8/1, 28/4/p16", 32)
    assert (one.page_size, one.head_dim, one.dtype) == (1, 128, "bf16")
    assert (wide.page_size, wide.head_dim, wide.dtype) == (64, 64, "fp16")
    assert default.page_size == 32 and flag.page_size == 16  # --page-size unless the item names one
    assert parse_specs("32/8", None)[0].page_size == 16
    assert bench.spec_label(one) == "32/8 page 1" and bench.spec_label(default) == "8/1 page 32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_heldout_without_cuda_exits_3(capsys):
    code, _, err = run(capsys, "bench", "--heldout", "1", "--cells", "1")
    assert code == 3 and "attnsel bench times kernels on a CUDA device; none was found" in err


def test_heldout_flags_reach_run_heldout(capsys, monkeypatch):
    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_heldout, "run_heldout", lambda specs, names, mode, out, seed, counts, console, repeats,
                        command, phases, priority: got.update(specs=specs, names=names, mode=mode, seed=seed,
                                                              counts=counts, repeats=repeats, command=command,
                                                              phases=phases, priority=priority) or 0)
    code, _, _ = run(capsys, "bench", "--heldout", "7", "--specs", "40/8,32/8/64/fp16, 8/1/float16", "--page-size",
                     "32", "--cells", "3,5", "--mode", "graph", "--repeats", "2")
    assert code == 0 and got["seed"] == 7 and got["counts"] == {"prefill": 3, "decode": 5, "extend": 16}
    assert got["phases"] == ("prefill", "decode")
    assert got["specs"] == [AttentionSpec(40, 8, 128, "bf16", 32), AttentionSpec(32, 8, 64, "fp16", 32),
                            AttentionSpec(8, 1, 128, "fp16", 32)]
    assert got["mode"] == "graph" and got["repeats"] == 2 and got["priority"] == {}
    assert got["command"] == ["bench", "--heldout", "7", "--specs", "40/8,32/8/64/fp16, 8/1/float16", "--page-size",
                              "32", "--cells", "3,5", "--mode", "graph", "--repeats", "2"]
    code, _, _ = run(capsys, "bench", "--heldout", "0")
    assert code == 0 and got["specs"] == bench_heldout.HELDOUT_SPECS and got["counts"] == {"prefill": 12, "decode": 24, "extend": 16}
    code, _, _ = run(capsys, "bench", "--heldout", "0", "--cells", "9", "--num-heads", "48", "--num-kv-heads", "8",
                     "--head-dim", "128")
    assert code == 0 and got["specs"] == [AttentionSpec(48, 8, 128)] and got["counts"] == {"prefill": 9, "decode": 9, "extend": 9}
    code, _, _ = run(capsys, "bench", "--heldout", "3", "--phases", "extend", "--cells", "1,1,6")
    assert code == 0 and got["phases"] == ("extend",) and got["counts"]["extend"] == 6
    held = bench_heldout.HELDOUT_SPECS
    assert {(s.num_q_heads, s.num_kv_heads) for s in held} >= {(32, 8), (28, 4), (8, 1), (40, 8), (48, 8)}
    assert {s.head_dim for s in held} == {64, 128, 256} and {s.dtype for s in held} == {"bf16", "fp16"}


def test_specs_without_heldout_go_to_the_fixed_bench(capsys, monkeypatch):
    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_bench", lambda base, names, mode, out, quick, console, repeats, priority:
                        got.update(base=base, priority=priority) or 0)
    code, _, _ = run(capsys, "bench", "--specs", "40/8,48/8")
    assert code == 0 and got["base"] == [AttentionSpec(40, 8, 128), AttentionSpec(48, 8, 128)]
    assert bench.grid_specs(False, got["base"]) == got["base"]


# ---- the held-out plumbing on the CPU (fake times: the timing needs CUDA) ----

def _fake_us(shape) -> dict:
    """"a" wins below 9000 tokens, "b" above; "b" fails on the 3rd-smallest token count's cells (no time)."""
    tokens = sum(shape) if isinstance(shape, list) else shape[0] * shape[1]
    return {"a": 5 + tokens / 1000, "b": 8 + tokens / 1500}


def test_heldout_plumbing_end_to_end_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "valid_backends", lambda spec, phase, names, device: {n: "" for n in names})
    calls = []

    def fake_time_bucket(cands, spec, phase, shape, device, mode, reps):
        calls.append((spec, phase, mode))
        us = _fake_us(shape)
        errors = {"triton": "wrong output"} if len(calls) == 3 else {}
        us = {"torch": us["a"], "triton": us["b"]}
        return {"us": {n: t for n, t in us.items() if n not in errors}, "spread": {n: 0.01 for n in us},
                "errors": errors}

    def table(phase, mode):
        keys = ([(1, 1000, 1000), (1, 20000, 20000), (8, 8000, 1000), (8, 64000, 8000)] if phase == "prefill"
                else [(1, 256), (1, 16384), (64, 256), (64, 16384)])
        cells = {k: {"torch": _fake_us([k[1]] if phase == "prefill" else k)["a"],
                     "triton": _fake_us([k[1]] if phase == "prefill" else k)["b"]} for k in keys}
        return build_table(measured(phase, mode, cells), ["triton", "torch"])

    def fake_select_modes(spec, modes, device, records, phases, priority):
        assert phases == ("prefill", "decode")
        records += [{"spec": spec.to_dict(), "mode": m} for m in modes]
        return {m: Selection(spec, {p: PhaseChoice("torch", "auto", [], table(p, m)) for p in ("prefill", "decode")},
                             "measure", m, "off", {}, {}) for m in modes}

    monkeypatch.setattr(bench.timing, "time_bucket", fake_time_bucket)
    monkeypatch.setattr(bench, "select_modes", fake_select_modes)
    counts = {"prefill": 3, "decode": 6}
    rows, selections = [], []
    probe = {"copy_tbps": 1.0, "read_tbps": 1.0}
    specs = [AttentionSpec(32, 8, 128), AttentionSpec(40, 8, 64, "fp16")]
    for spec in specs:
        cells, checks, spec_rows = bench_heldout.evaluate_spec(spec, ["torch", "triton"], ["eager", "graph"], 5, counts,
                                                               torch.device("cpu"), probe, 132, 1, selections)
        rows += spec_rows
        assert checks == {p: {"torch": "", "triton": ""} for p in ("prefill", "decode")}
    assert len(calls) == len(rows) == 2 * 2 * (3 + 6) and len(selections) == 4
    assert {r["spec"] for r in rows} == {"32/8", "40/8 d64 fp16"}
    drawn = sample_cells(specs[0], "decode", "graph", 5, 6, 132)
    graph = [r for r in rows if r["spec"] == "32/8" and r["phase"] == "decode" and r["mode"] == "graph"]
    assert [tuple(r["lens"]) for r in graph] == [c.lens for c in drawn]
    assert [r["timed_batch"] for r in graph] == [c.batch in bench_cells.timed_batches(specs[0], "graph", 132)
                                                 for c in drawn]
    for r in rows:
        assert r["static"] == "triton" and r["one_backend"] == "torch" and r["batch"] == len(r["lens"])
        fast = min(r["ratios"], key=r["ratios"].get)
        assert r["fastest"] == {"torch": "torch", "triton": "triton"}[fast] and r["ratios"][fast] == 1.0
        assert r["selected"] in ("torch", "triton")
    assert rows[2]["ratios"].keys() == {"torch"} and rows[2]["static_ratio"] is None  # triton failed in that cell
    bench_stats.batch_bound(rows)
    assert all("batch_bound" in r for r in graph) and not any("batch_bound" in r for r in rows if r["mode"] == "eager")
    summary = bench_stats.summarise(rows, seed=5)
    strategies = {(s["spec"], s["phase"], s["mode"], s["strategy"]) for s in summary}
    assert ("all", "decode", "graph", "batch_bound") in strategies
    assert ("40/8 d64 fp16", "prefill", "eager", "selected") in strategies
    json.dumps({"comparison": rows, "summary": summary})  # the JSON output takes them as they are
    text = bench_heldout.markdown(summary, "# header")
    assert "| all | decode | graph | batch bound | 12 |" in text
    console = Console(record=True, width=200)
    console.print(bench_heldout.summary_table(summary, "title"))
    shown = console.export_text()
    assert "within 3% [95% CI]" in shown and "batch bound" in shown and "40/8 d64 fp16" in shown


def test_a_run_cut_during_a_selection_keeps_that_specs_timed_cells(monkeypatch, tmp_path):
    """The device's time limit can end a run while a spec's selection (minutes) runs: heldout.json then holds the
    finished specs' rows and that spec's timed cells (no rows: nothing to judge them by), as rewritten after its
    cells were timed."""

    class Cut(BaseException):  # the kill at the limit: nothing after it runs
        pass

    specs = [AttentionSpec(32, 8, 128), AttentionSpec(8, 1, 128)]
    monkeypatch.setattr(bench, "setup", lambda names, mode, out: (torch.device("cpu"), names, ["eager"], tmp_path,
                                                                   {"copy_tbps": 1.0, "read_tbps": 1.0}))
    monkeypatch.setattr(bench_heldout, "fingerprint", lambda device: {"gpu": "fake"})
    monkeypatch.setattr(bench, "valid_backends", lambda spec, phase, names, device: {n: "" for n in names})
    monkeypatch.setattr(bench.timing, "time_bucket", lambda cands, spec, phase, shape, device, mode, reps: {
        "us": {"torch": _fake_us(shape)["a"], "triton": _fake_us(shape)["b"]}, "spread": {}, "errors": {}})

    def table(phase):
        keys = [(1, 1000, 1000), (8, 64000, 8000)] if phase == "prefill" else [(1, 256), (64, 16384)]
        cells = {k: {"torch": _fake_us([k[1]] if phase == "prefill" else k)["a"],
                     "triton": _fake_us([k[1]] if phase == "prefill" else k)["b"]} for k in keys}
        return build_table(measured(phase, "eager", cells), ["triton", "torch"])

    def select_modes(spec, modes, device, records, phases, priority):
        if spec.num_kv_heads == 1:
            raise Cut()
        records.append({"spec": spec.to_dict(), "mode": "eager"})
        return {"eager": Selection(spec, {p: PhaseChoice("torch", "auto", [], table(p)) for p in phases},
                                   "measure", "eager", "off", {}, {})}

    monkeypatch.setattr(bench, "select_modes", select_modes)
    with pytest.raises(Cut):
        bench_heldout.run_heldout(specs, ["torch", "triton"], "eager", str(tmp_path), 5,
                                  {"prefill": 2, "decode": 3}, Console(record=True))
    data = json.loads((tmp_path / "heldout.json").read_text())
    kv_heads = [c["spec"]["num_kv_heads"] for c in data["cells"]]
    assert kv_heads.count(8) == kv_heads.count(1) == 2 * (2 + 3)  # both specs' cells, each backend's time
    assert {r["spec"] for r in data["comparison"]} == {"32/8"} and len(data["comparison"]) == 2 + 3
    assert len(data["checks"]) == 2 and len(data["selections"]) == 1
    assert "8/1" in (tmp_path / "heldout.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_heldout_run_on_the_gpu(capsys, monkeypatch, tmp_path):
    """The whole held-out run on a GPU, small: 40/8 heads, torch and Triton, 2 prefill and 3 decode cells per mode,
    an 8 s timing budget (a check of the plumbing on real kernels, not a measurement)."""
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNSEL_TIMING_BUDGET_S", "8")
    argv = ["bench", "--heldout", "3", "--specs", "40/8", "--backends", "torch,triton", "--cells", "2,3", "--out",
            str(tmp_path / "out")]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    data = json.loads((tmp_path / "out" / "heldout.json").read_text())
    meta = data["heldout"]
    assert meta["seed"] == 3 and meta["command"] == "attnsel " + " ".join(argv) and meta["device"]["gpu"]
    assert meta["date"] and meta["cells_per_phase"] == {"prefill": 2, "decode": 3} and meta["modes"] == ["eager",
                                                                                                           "graph"]
    rows = data["comparison"]
    assert len(rows) == 2 * (2 + 3) and {r["spec"] for r in rows} == {"40/8"}
    spec = AttentionSpec(40, 8, 128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mode in ("eager", "graph"):
        for phase in ("prefill", "decode"):
            drawn = sample_cells(spec, phase, mode, 3, 2 if phase == "prefill" else 3, sms)
            assert [tuple(r["lens"]) for r in rows if (r["phase"], r["mode"]) == (phase, mode)] == [c.lens
                                                                                                    for c in drawn]
    for r in rows:
        assert r["selected"] in ("torch", "triton") and r["static"] == "triton" and r["selected_ratio"] >= 1.0
    strategies = {(s["phase"], s["mode"], s["strategy"]) for s in data["summary"]}
    assert ("decode", "graph", "batch_bound") in strategies and ("prefill", "eager", "selected") in strategies
    assert "within 3% [95% CI]" in out and (tmp_path / "out" / "heldout.md").exists()


def test_a_selection_for_prefill_and_decode_cells_does_not_time_extend(monkeypatch):
    """The held-out bench of prefill and decode selects with extend served by torch (validated, not timed): the
    other phases' tables do not depend on it and the selection takes half the time. With extend cells it is
    automatic like the others."""
    asked = []

    def fake_select(spec, **kwargs):
        assert kwargs.get("extend", "auto") == "auto"  # never named: a failed validation would fail the selection
        asked.append((kwargs.get("extend_priority") or ["auto"])[0])
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(bench, "select", fake_select)
    spec = AttentionSpec(32, 8, 128)
    assert bench.select_modes(spec, ["eager"], "cpu", [], ("prefill", "decode")) == {}
    assert bench.select_modes(spec, ["eager"], "cpu", [], ("prefill", "decode", "extend")) == {}
    assert bench.select_modes(spec, ["eager"], "cpu", []) == {}
    assert asked == ["torch", "auto", "auto"]


def test_a_spec_torch_cannot_extend_still_selects_for_prefill_and_decode(monkeypatch, caplog):
    """A non-causal spec has no extend phase (no backend serves it, torch included): the held-out bench of prefill
    and decode selects it as an automatic selection would (extend left out), not by naming torch for extend, which
    fails the whole selection and leaves the spec without its selected rows."""
    fake_worker(monkeypatch, {}, [])
    spec = AttentionSpec(4, 2, 64, "fp16", causal=False)
    got = bench.select_modes(spec, ["eager"], "cpu", [], ("prefill", "decode"))
    assert "failed" not in caplog.text
    assert list(got) == ["eager"] and got["eager"].prefill_backend_for(2, 128, 64) in ("torch", "triton")


def test_a_graph_mode_selection_for_prefill_and_decode_names_a_graph_safe_extend_backend(monkeypatch):
    """Under CUDA graphs torch cannot serve extend (its plan gathers rows on the host: stale on replay), so naming
    it failed every graph-mode selection of the held-out bench. There the untimed extend backend is the first one in
    extend's default order that can serve the spec and is not stale on replay; the eager one stays torch."""
    asked = []

    def fake_select(spec, **kwargs):
        assert kwargs.get("extend", "auto") == "auto"
        asked.append((kwargs["mode"], (kwargs.get("extend_priority") or ["auto"])[0]))
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(bench, "select", fake_select)
    monkeypatch.setattr(bench.backends, "availability", lambda b, spec, phase, device=None: (None, {}))
    spec = AttentionSpec(32, 8, 128)
    assert bench.select_modes(spec, ["eager", "graph"], "cpu", [], ("prefill", "decode")) == {}
    graph_pick = asked[1][1]
    assert asked[0] == ("eager", "torch") and asked[1][0] == "graph"
    assert graph_pick != "torch" and bench.backends.graph_stale_reason(bench.backends.get(graph_pick), "extend") is None
    assert graph_pick == next(n for n in bench.DEFAULT_PRIORITY["extend"]
                              if bench.backends.graph_stale_reason(bench.backends.get(n), "extend") is None)


def test_an_untimed_extend_backend_that_fails_validation_leaves_extend_unserved_not_the_selection(
        monkeypatch, caplog, tmp_path):
    """The held-out bench's one extend candidate is a priority list of one, not an explicit name: when it fails
    validation (a graph-mode capture check, a kernel library broken for the spec) prefill's and decode's selection
    must still come back for their cells; named, the whole selection failed and the spec had no selected rows."""
    from attnsel.validate import runner, timing

    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    fake_worker(monkeypatch, {}, [])
    real = runner.run_tasks

    def broken_extend(spec, tasks, **kwargs):
        out, stats = real(spec, tasks, **kwargs)
        for key in out:
            if key[1] == "extend" and key[0] != timing.TIMING_TASK:
                out[key] = {"status": "rejected", "reason": "wrong output (injected)", "time_s": 0.1}
        return out, stats

    monkeypatch.setattr(runner, "run_tasks", broken_extend)
    spec = AttentionSpec(4, 2, 64, "fp16")
    got = bench.select_modes(spec, ["eager"], "cpu", [], ("prefill", "decode"))
    assert "failed" not in caplog.text
    assert list(got) == ["eager"] and not got["eager"].extend
    assert got["eager"].prefill_backend_for(2, 128, 64) in ("torch", "triton")


def test_the_benchs_priority_flags_reach_the_selection(capsys, monkeypatch):
    """--decode-priority (and prefill's, extend's) set the selections' auto candidates, e.g. to judge an opt-in
    backend on held-out cells: checked by name, passed to select(); extend's only where extend is timed."""
    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_heldout, "run_heldout", lambda *a: got.update(priority=a[-1]) or 0)
    monkeypatch.setattr(bench, "run_bench", lambda *a: got.update(fixed=a[-1]) or 0)
    code, _, _ = run(capsys, "bench", "--heldout", "5", "--decode-priority", "flashinfer,flashinfer_xqa,triton")
    assert code == 0 and got["priority"] == {"decode_priority": ["flashinfer", "flashinfer_xqa", "triton"]}
    code, _, _ = run(capsys, "bench", "--extend-priority", "triton,fa3", "--prefill-priority", "fa3")
    assert code == 0 and got["fixed"] == {"extend_priority": ["triton", "fa3"], "prefill_priority": ["fa3"]}
    code, _, _ = run(capsys, "bench", "--heldout", "5", "--phases", "extend", "--extend-priority", "triton")
    assert code == 0 and got["priority"] == {"extend_priority": ["triton"]}
    code, _, err = run(capsys, "bench", "--heldout", "5", "--decode-priority", "flashinfer,nosuch")
    assert code == 2 and "--decode-priority: unknown backend 'nosuch'" in err
    code, _, err = run(capsys, "bench", "--heldout", "5", "--extend-priority", "triton")
    assert code == 2 and "with extend in --phases (e.g. --phases prefill,decode,extend)" in err
    asked = []

    def fake_select(spec, **kwargs):
        asked.append(kwargs)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(bench, "select", fake_select)
    bench.select_modes(AttentionSpec(32, 8, 128), ["eager"], "cpu", [], ("prefill", "decode"),
                       {"decode_priority": ["flashinfer_xqa", "triton"]})
    assert asked[0]["decode_priority"] == ["flashinfer_xqa", "triton"] and asked[0]["extend_priority"] == ["torch"]
