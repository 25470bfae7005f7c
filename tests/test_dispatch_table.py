"""The dispatch table as pure data (attnsel/dispatch.py): built from timings, looked up from host ints, printed, and
through JSON and back, in milliseconds: no worker, no device, no cache."""
import json
import time

import pytest

from attnsel.dispatch import TIE, Bucket, DispatchTable, build_table, pick

AXES = ["batch", "context"]


def measured(cells, mode="eager", ragged=None, skipped=()):
    """timing.measure's result form from {key: {name: us}} (ragged: more cells marked as ragged buckets)."""
    def bucket(key, times, is_ragged=False):
        label = (f"ragged {key[0]} (mean {key[1]})" if is_ragged else "x".join(map(str, key)))
        return {"key": list(key), "label": label, "us": dict(times), "spread": {n: 0.02 for n in times},
                "errors": {}, "ragged": is_ragged, "host": 1.0}
    buckets = [bucket(k, t) for k, t in cells.items()] + [bucket(k, t, True) for k, t in (ragged or {}).items()]
    return {"phase": "decode", "mode": mode, "grid_version": 9, "axes": AXES, "reps": 7, "buckets": buckets,
            "skipped": list(skipped), "wall_s": 2.5, "pruned": {"c": 1.7}}


CELLS = {(1, 256): {"a": 10.0, "b": 12.0, "c": 30.0}, (1, 4096): {"a": 40.0, "b": 30.0, "c": 90.0},
         (64, 256): {"a": 20.0, "b": 30.0, "c": 50.0}, (64, 4096): {"a": 400.0, "b": 300.0, "c": 900.0}}
RAGGED = {(32, 1024): {"a": 90.0, "b": 120.0}, (128, 1024): {"a": 300.0, "b": 450.0}}


def test_lookup_from_host_ints():
    table = build_table(measured(CELLS), ["a", "b", "c"])
    assert table.axes == ("batch", "context") and len(table.buckets) == 4
    assert table.backend_for((1, 256)) == "a" and table.backend_for((1, 4096)) == "b"  # on timed shapes
    assert table.backend_for((64, 256)) == "a" and table.backend_for((64, 4096)) == "b"
    assert table.backend_for((1, 10**6)) == "b" and table.backend_for((10**4, 1)) == "a"  # clamped beyond the ends
    assert table.backend_for((8, 1024)) in ("a", "b")  # between timed shapes: interpolated, one of the candidates
    assert table.bucket_for((2, 300)).key == (1, 256)  # nearest timed bucket in log space
    assert table.cell((0, 0)) == (0, 0) and table.cell((10**6, 10**6)) == (1, 1)
    with pytest.raises(ValueError, match=r"keyed by \(batch, context\), got \(4,\)"):
        table.backend_for((4,))


def test_the_ragged_sub_table_serves_skewed_batches_only():
    table = build_table(measured(CELLS, ragged=RAGGED), ["a", "b", "c"])
    assert table.ragged is not None and [b.key for b in table.ragged.buckets] == [(32, 1024), (128, 1024)]
    assert table.backend_for((64, 1024)) == table.backend_for((64, 1024), longest=1100)  # mild skew: uniform
    assert table.ragged.covers((64, 1024), 4000) and table.backend_for((64, 1024), longest=4000) == "a"
    assert not table.ragged.covers((1, 1024), 4000)  # one row is never ragged


def test_ties_go_by_priority_and_pick_is_pure():
    assert pick({"a": 10.05, "b": 10.0}, ["a", "b"]) == "a"  # within TIE of the fastest: the earlier wins
    assert pick({"a": 10.2, "b": 10.0}, ["a", "b"]) == "b"
    assert TIE == 0.01
    assert build_table(measured({(1, 256): {"a": 10.05, "b": 10.0}}), ["b", "a"]).buckets[0].backend == "b"


def test_json_round_trip_keeps_everything_the_lookup_reads():
    table = build_table(measured(CELLS, ragged=RAGGED, skipped=["64x16384"]), ["a", "b", "c"])
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table and again.to_json() == table.to_json()
    assert again.ragged == table.ragged and again.skipped == ("64x16384",) and again.pruned == (("c", 1.7),)
    shapes = [(b, c) for b in (1, 3, 17, 64, 500) for c in (16, 300, 2000, 9000)]
    assert [again.backend_for(s, longest=4 * s[1]) for s in shapes] == [table.backend_for(s, longest=4 * s[1])
                                                                       for s in shapes]
    bucket = table.buckets[0]
    assert Bucket.from_json(json.loads(json.dumps(bucket.to_json()))) == bucket


def test_graph_mode_tables_are_keyed_by_batch_alone():
    table = build_table(measured(CELLS, mode="graph"), ["a", "b", "c"])
    assert table.axes == ("batch",) and [b.key for b in table.buckets] == [(1,), (64,)]
    assert DispatchTable.from_json(table.to_json()).backend_for((10,)) == table.backend_for((10,))


def test_printing_names_every_bucket_and_its_choice():
    table = build_table(measured(CELLS, ragged=RAGGED, skipped=["64x16384"]), ["a", "b", "c"])
    text = str(table)
    lines = text.splitlines()
    assert lines[0] == ("decode dispatch (eager) over batch x context: 4 buckets, default a; wins: a 2, b 2; "
                        "skipped: 64x16384; pruned: c (1.70x)")
    assert "  1x256: a 10.0 us (runner-up b 1.20x)" in lines
    assert "  64x4096: b 300.0 us (runner-up a 1.33x)" in lines
    assert lines[-3] == "ragged decode dispatch (eager) over batch x context: 2 buckets, default a; wins: a 2"
    assert lines[-1] == "  ragged 128 (mean 1024): a 300.0 us (runner-up b 1.50x)"
    one = build_table(measured({(1, 256): {"a": 10.0}}), ["a"])
    assert str(one).splitlines()[1] == "  1x256: a 10.0 us"


def test_each_lookup_rule_can_be_switched_off_for_replays():
    """DispatchTable.without: the lookup with one rule beyond the nearest timed bucket off, as
    scripts/replay_dispatch.py replays recorded benches to measure what each rule earns."""
    # batch 12 between timed batches 8 and 16: a wins 16 by 0.9% and loses 8 by 6.5%, b within 1% at both
    graph = build_table(measured({(8, 256): {"a": 32.8, "b": 30.8}, (16, 256): {"a": 48.6, "b": 49.04}},
                                 mode="graph"), ["a", "b"])
    assert graph.bucket_for((12,)).backend == "a" and graph.backend_for((12,)) == "b"  # interpolated
    assert graph.without("interpolation").backend_for((12,)) == "a"  # the nearest bucket serves
    assert graph.without("interpolation").backend_for((8,)) == "b"
    table = build_table(measured(CELLS, ragged=RAGGED), ["a", "b", "c"])
    assert table.backend_for((64, 2048), longest=8000) == "a"  # the ragged sub-table
    off = table.without("ragged")
    assert off.ragged is None and off.backend_for((64, 2048), longest=8000) == table.backend_for((64, 2048)) == "b"
    # the sub-table follows its table; no rule named: the same table; the options are not stored
    assert not table.without("interpolation").ragged.interpolate and table.without() == table
    assert table.without("interpolation").to_json() == table.to_json()
    with pytest.raises(ValueError, match=r"unknown lookup rule\(s\) 'tie'; the rules that can be switched off: "
                                         r"interpolation, ragged, skew"):
        table.without("ragged", "tie")  # a rule that did not earn its place (bench/results/README.md)


def test_a_near_tie_between_timed_shapes_goes_to_the_least_interpolated_slowdown():
    """At batch 5 a's interpolated slowdown is least; b's is within 1% of it and b is never more than 0.5% behind,
    while a is 3% behind at batch 64. The least wins: a rule giving such near-ties to the candidate whose worst
    corner is least did not win more bench cells than the bench's passes disagree on (bench/results/README.md)."""
    ties = build_table(measured({(4, 256): {"a": 100.0, "b": 100.5}, (64, 256): {"a": 103.0, "b": 100.0}},
                                mode="graph"), ["a", "b"])
    assert ties.backend_for((4,)) == "a" and ties.backend_for((5,)) == "a" and ties.backend_for((64,)) == "b"
    assert ties.backend_for((12,)) == "b"  # b's interpolated slowdown is least there


def test_the_pure_functions_take_milliseconds():
    start = time.perf_counter()
    for _ in range(20):
        table = build_table(measured(CELLS, ragged=RAGGED), ["a", "b", "c"])
        DispatchTable.from_json(json.loads(json.dumps(table.to_json()))).backend_for((7, 700), longest=3000)
        str(table)
    assert (time.perf_counter() - start) / 20 < 0.05  # per build + round trip + lookup + print


def test_replay_of_a_heldout_run_dispatches_extend_cells_by_their_longest_row():
    """scripts/replay_dispatch.py --heldout on a recorded held-out run (H100, seed 23): each extend cell dispatched
    from its means and its longest context as plan_extend does; 8/1's ragged multi-token decode cell moves from FA3
    (2.62x behind) to fa3_split (the fastest)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "scripts/replay_dispatch.py", "--heldout",
                          "bench/results/2026-12-06-extend-h100/heldout.json"], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    assert "8/1 #3 mtp 27x3 over 2076 (ragged): fa3 2.62x -> fa3_split 1.00x" in out
    assert "extend 8/1\n  recorded: 8/10 within 3%, geomean 1.109x, worst 2.62x\n  now:      9/10 within 3%" in out


def extend_table(cells, order=("a", "b")):
    """An eager extend table from {(requests, q_len, context): {name: us}}."""
    buckets = [{"key": list(k), "label": f"{k[0]}x{k[1]} over {k[2]}", "us": dict(t), "spread": {}, "errors": {}}
               for k, t in cells.items()]
    return build_table({"phase": "extend", "mode": "eager", "grid_version": 9, "axes": ["requests", "q_len", "context"],
                        "buckets": buckets, "skipped": [], "wall_s": None, "pruned": {}}, list(order))


# b's time falls with the context where a's does not: between the contexts b's interpolated time is well below the
# shorter context's (the nearest bucket), where a is faster
SKEW_CELLS = {(1, 2, 1024): {"a": 10.0, "b": 10.0}, (1, 2, 16384): {"a": 50.0, "b": 51.0},
              (16, 2, 1024): {"a": 100.0, "b": 110.0}, (16, 2, 16384): {"a": 100.0, "b": 10.0}}


def test_a_skewed_extend_lookup_leaves_out_times_the_table_cannot_use():
    """A loaded (or hand-made) extend table whose buckets hold a time of 0 or None for a candidate: the
    interpolation leaves such a time out (the bucket takes no part for it), and so does the skewed-extend estimate
    (its time at the means plus one row of the longest context), rather than raising on log(0) or None."""
    table = extend_table(SKEW_CELLS)
    data = table.to_json()
    for b in data["buckets"]:
        b["times_us"].update(c=0.0, d=None)
    loaded = DispatchTable.from_json(json.loads(json.dumps(data)))
    for key, longest in (((16, 2, 1500), 16384), ((8, 2, 3000), 12000), ((16, 2, 1024), 16384)):
        assert loaded.backend_for(key, longest) == table.backend_for(key, longest)


def test_a_skewed_extend_lookup_without_interpolation_reads_the_nearest_buckets():
    """without("interpolation"): the nearest timed bucket serves every shape, the skewed-extend estimate included
    (its time at the means from the nearest bucket), so that a replay measures what interpolation earns. 16 rows,
    mean context 1500, one of 16384: interpolated between the contexts b is faster (its 81 us at the means + 51 us
    alone against a's 100 + 50); the nearest bucket (16 x 2 over 1024) has a faster (100 + 50 against 110 + 51)."""
    table = extend_table(SKEW_CELLS)
    assert table.backend_for((16, 2, 1500), 16384) == "b"
    assert table.without("interpolation").backend_for((16, 2, 1500), 16384) == "a"
    assert table.without("interpolation", "ragged").backend_for((16, 2, 1500), 16384) == "a"


def _heldout_row(spec, shape, batch, q_lens, lens, selected, ratios):
    return {"spec": spec, "phase": "extend", "mode": "eager", "shape": shape, "batch": batch, "q_lens": q_lens,
            "lens": lens, "selected": selected, "selected_ratio": ratios.get(selected), "ratios": ratios}


def test_replay_of_a_heldout_run_pairs_each_spec_with_its_own_selection(tmp_path):
    """scripts/replay_dispatch.py --heldout: a spec whose selection failed has no selection record (bench.select_modes
    leaves it out); the other specs' cells are still replayed on their own tables, not on a neighbour's, and a
    recorded choice without a time in its cell (it failed there) prints as such."""
    import subprocess
    import sys
    from pathlib import Path

    from attnsel.spec import AttentionSpec

    a_wins = extend_table({(r, 2, c): {"a": 1.0, "b": 2.0} for r in (1, 16) for c in (1024, 16384)})
    b_wins = extend_table({(r, 2, c): {"a": 2.0, "b": 1.0} for r in (1, 16) for c in (1024, 16384)})
    one, two = AttentionSpec(32, 8, 128, "bf16", 16), AttentionSpec(8, 1, 128, "bf16", 16)
    data = {"comparison": [_heldout_row("32/8", "#1 mtp 4x2 over 2000", 4, [2] * 4, [2000] * 4, "a", {"a": 1.0}),
                           _heldout_row("8/1", "#1 mtp 4x2 over 2000", 4, [2] * 4, [2000] * 4, "a", {"b": 1.0})],
            "selections": [{"spec": s.to_dict(), "mode": "eager", "dispatch": {"extend": t.to_json()}}
                           for s, t in ((one, a_wins), (two, b_wins))][1:]}  # 32/8's selection failed
    path = tmp_path / "heldout.json"
    path.write_text(json.dumps(data))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "scripts/replay_dispatch.py", "--heldout", str(path)], cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{path} extend 32/8: no eager selection recorded with an extend table" in proc.stdout
    assert "8/1 #1 mtp 4x2 over 2000: a no time -> b 1.00x" in proc.stdout
    assert f"{path} extend 8/1\n  recorded: 0/1 within 3%" in proc.stdout


# "whole" reads a row in one program per head (no split of its keys): two rows take as long as the longer one alone;
# "split" spreads a row over the GPU and is a little slower on uniform rows
WAIT_CELLS = {(1, 1024): {"whole": 10.0, "split": 8.0}, (1, 4096): {"whole": 33.0, "split": 16.0},
              (2, 1024): {"whole": 10.0, "split": 12.0}, (2, 4096): {"whole": 33.0, "split": 30.0}}


def test_a_skewed_decode_batch_outside_the_ragged_buckets_adds_its_longest_row_alone():
    """Two rows of 452 and 3432 tokens (mean 1942, longest 1.77x it): by its mean the uniform buckets favour
    "whole", but "whole" waits for the 3432-token row. Decode batches the ragged sub-table does not serve are
    estimated as extend's skewed batches are: the time at the mean plus one row of the longest context alone."""
    table = build_table(measured(WAIT_CELLS), ["whole", "split"])
    assert table.backend_for((2, 1942)) == "whole" == table.backend_for((2, 1942), longest=1942)
    assert table.backend_for((2, 1942), longest=3432) == "split"
    assert table.backend_for((2, 1942), longest=2800) == "whole"  # under SKEW (1.44x the mean): by the mean
    assert table.without("ragged").backend_for((2, 1942), longest=3432) == "whole"
    assert DispatchTable.from_json(json.loads(json.dumps(table.to_json()))).backend_for((2, 1942), 3432) == "split"


def test_the_ragged_sub_table_keeps_the_batches_it_covers():
    """A skewed batch near a timed ragged bucket goes by that sub-table, not by the longest-row estimate."""
    ragged = {(2, 2048): {"whole": 10.0, "split": 20.0}}
    table = build_table(measured(WAIT_CELLS, ragged=ragged), ["whole", "split"])
    assert table.ragged.covers((2, 1200), 3432) and table.backend_for((2, 1200), longest=3432) == "whole"
    assert not table.ragged.covers((2, 1942), 3432) and table.backend_for((2, 1942), longest=3432) == "split"


def test_replay_of_a_heldout_run_with_a_lookup_rule_off(tmp_path):
    """scripts/replay_dispatch.py --heldout --without RULE: the held-out cells replayed with that rule off (what it
    earns on cells no table was tuned on); an unknown rule is refused by name."""
    import subprocess
    import sys
    from pathlib import Path

    from attnsel.spec import AttentionSpec

    lens = [508] * 14 + [504, 16384]  # 16 requests of 2 queries, mean context 1500, one of 16384: skewed
    row = _heldout_row("32/8", "#1 chunk 16x2", 16, [2] * 16, lens, "b", {"a": 1.2, "b": 1.0})
    extend = extend_table(SKEW_CELLS).to_json()
    data = {"comparison": [row], "selections": [{"spec": AttentionSpec(32, 8, 128, "bf16", 16).to_dict(),
                                                 "mode": "eager", "dispatch": {"extend": extend}}]}
    path = tmp_path / "heldout.json"
    path.write_text(json.dumps(data))
    root = Path(__file__).resolve().parents[1]

    def replay(*args):
        return subprocess.run([sys.executable, "scripts/replay_dispatch.py", "--heldout", *args, str(path)], cwd=root,
                              capture_output=True, text=True)

    assert "now:      1/1 within 3%" in replay().stdout
    off = replay("--without", "interpolation")
    assert off.returncode == 0 and "#1 chunk 16x2: b 1.00x -> a 1.20x" in off.stdout, off.stdout + off.stderr
    bad = replay("--without", "nearest")
    assert bad.returncode != 0
    assert "--without nearest: not a lookup rule; the rules: interpolation, ragged, skew" in bad.stderr


def test_the_skew_estimate_can_be_switched_off_alone():
    """without("skew"): skewed batches go by their means while the ragged sub-table still serves the batches it
    covers (without("ragged") switches off both), so that a replay can show what the estimate alone earns."""
    ragged = {(2, 1024): {"whole": 10.0, "split": 20.0}}
    table = build_table(measured(WAIT_CELLS, ragged=ragged), ["whole", "split"])
    assert table.backend_for((2, 1942), longest=3432) == "split"  # skew estimate (no ragged bucket near)
    assert table.without("skew").backend_for((2, 1942), longest=3432) == "whole"  # by its mean
    assert table.without("skew").backend_for((2, 1200), longest=3432) == "whole"  # the sub-table still serves
    assert table.without("skew").ragged is not None
    assert table.without("ragged").ragged is None and not table.without("ragged").skew


# 512 rows: on uniform batches "fi" leads, on the timed ragged batch (longest row 13x the mean) "fa3" does
BLEND_UNIFORM = {(128, 512): {"fi": 100.0, "fa3": 112.0}, (512, 512): {"fi": 400.0, "fa3": 450.0}}
BLEND_RAGGED = {(128, 512): {"fi": 130.0, "fa3": 122.0}, (512, 512): {"fi": 520.0, "fa3": 490.0}}


def test_a_ragged_batch_between_the_timed_skews_blends_both_tables():
    """A batch of 512 rows, mean 550, longest 2000 (3.6x the mean, as served batches clipped by their KV pool): the
    ragged buckets serve it (longest >= RAGGED_SKEW x the mean), but they were timed at 13x. Its cost is the
    slowdowns interpolated in log skew (about half each table's), which "fi" wins; at 12x the ragged one decides."""
    from attnsel.validate.grid import ragged_decode_lens

    table = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"])
    lens = ragged_decode_lens(512, 550)
    assert 12 < max(lens) / 550 < 14  # the timed skew at 512 rows
    assert table.ragged.covers((512, 550), 2000)
    assert table.backend_for((512, 550), longest=2000) == "fi"
    assert table.backend_for((512, 550), longest=12 * 550) == "fa3"
    assert table.backend_for((300, 550), longest=1400) == "fi"  # between the timed batch sizes
    assert table.without("blend").backend_for((512, 550), longest=2000) == "fa3"  # the ragged buckets alone
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.backend_for((512, 550), longest=2000) == "fi"
