"""Eager local pruning (timing.measure, "pruned_near") on the real GPU grids, with fake timings: what it may skip,
and what the dispatch table built from the result then serves."""
import pytest
import torch

import attnsel.backends as backends_mod
from attnsel import AttentionSpec
from attnsel.selection import build_table
from attnsel.validate import extend_grid as ext_grid
from attnsel.validate import timing

CUDA = torch.device("cuda")  # only its type is read by the grids: nothing is allocated
SPEC = AttentionSpec(32, 8, 128, "bf16", 16)


def _measure(monkeypatch, grid, phase, speed, names=("fa3", "mtd")):
    """measure() over ``grid`` with time_bucket replaced by ``speed(name, key) -> us``; also (key, names timed)."""
    seen = []

    def fake_bucket(cands, spec, phase_, shape, device, mode, reps):
        key = tuple(shape)
        seen.append((key, sorted(cands)))
        us = {n: speed(n, key) for n in cands}
        return {"us": us, "spread": {n: 0.0 for n in us}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    out = timing.measure(SPEC, phase, list(names), torch.device("cpu"), "eager", reps=1, grid=grid)
    return out, dict(seen)


def test_extend_keeps_a_winner_that_turns_between_coarse_query_lengths(monkeypatch):
    """Extend's coarse grid steps 16-32x per axis (queries 2, 64, 1024), so most finer buckets have a nearby coarse
    bucket on one side of an axis only: 16 queries sees 64 within 4x, not 2. A multi-token-decode kernel ("mtd")
    fastest up to 16 queries and 1.4x behind from 64 on must still be timed at 16 queries (where it wins), and the
    table must serve it there and between 4 and 16 queries: pruning extrapolated from one side is no evidence."""
    ratio = {2: 0.7, 4: 0.8, 16: 0.9, 64: 1.4, 256: 2.0, 1024: 2.5}  # mtd's time over fa3's, by queries per request

    def speed(name, key):
        base = key[0] * key[1] * key[2] / 1e4 + 10.0
        return base * (ratio[key[1]] if name == "mtd" else 1.0)

    grid = ext_grid.extend_grid(SPEC, CUDA, None, "eager")
    out, seen = _measure(monkeypatch, grid, "extend", speed)
    wins = [k for k in seen if ratio[k[1]] < 1]
    assert [k for k in wins if "mtd" not in seen[k]] == []  # the winner is timed wherever it wins
    table = build_table(out, ["fa3", "mtd"])
    assert [k for k in wins if table.backend_for(k) != "mtd"] == []
    assert table.backend_for((1, 10, 1024)) == "mtd" and table.backend_for((16, 10, 16384)) == "mtd"
    assert table.backend_for((16, 128, 16384)) == "fa3"


def test_the_headline_backend_is_not_lost_to_local_pruning(monkeypatch):
    """The table's default is the best single backend over the buckets (least geometric mean). A backend pruned near
    a few finer buckets ("fi": 1.4x behind at 1-4 rows, fastest from 8 rows on, 1.5x ahead of FA3) is still the best
    single one: it must not lose the headline to one timed everywhere ("tri", 1.25x behind the fastest everywhere)
    merely because the finer buckets of 2 and 3 rows skipped it."""
    from attnsel.validate import grid as bucket_grid

    def speed(name, key):
        base = key[0] * key[1] / 100 + 10.0
        small = key[0] <= 4
        return base * {"fi": 1.4 if small else 1.0, "fa3": 1.0 if small else 1.5, "tri": 1.25}[name]

    grid = [(lvl, (b, c)) for lvl, b, c in bucket_grid.decode_grid(SPEC, CUDA, None, "eager")]
    out, seen = _measure(monkeypatch, grid, "decode", speed, ("fa3", "fi", "tri"))
    assert out["pruned_near"].get("fi") and not out["pruned_near"].get("tri")  # the premise
    table = build_table(out, ["fa3", "fi", "tri"])
    assert table.default == "fi", table.default


def test_a_cached_bucket_whose_pruned_near_is_not_a_list_of_names_is_refused(monkeypatch):
    """build_table reads a bucket's "pruned_near" as names: a hand-edited string would match by substring."""
    from attnsel.cache import entry_problem

    grid = [(0, (1, 1056)), (0, (4, 1056)), (0, (16, 1056)), (0, (64, 1056)), (2, (23, 1056))]
    out, _ = _measure(monkeypatch, grid, "decode", lambda n, k: 10.0 if n == "fa3" or k[0] == 1 else 20.0)
    assert out["buckets"][-1]["pruned_near"] == ["mtd"]
    entry = {"kind": "dispatch", "status": "timed", "budget_s": 45.0, "measured": out}
    assert entry_problem(entry) is None
    out["buckets"][-1]["pruned_near"] = "mtd"
    assert "pruned_near candidates that are not a list of names" in entry_problem(entry)


def test_a_candidate_pruned_near_finer_buckets_says_why_it_has_no_time_there(monkeypatch):
    """A valid candidate without a time in some bucket says why (as a failed or a pruned one does): its score is a
    geometric mean over the buckets it was timed in, which leave out those where it was slow."""
    from attnsel.selector import Candidate, _annotate
    from attnsel.store import bucket_errors

    grid = [(0, (1, 1056)), (0, (4, 1056)), (0, (16, 1056)), (0, (64, 1056)), (2, (23, 1056)), (2, (45, 1056))]
    out, _ = _measure(monkeypatch, grid, "decode", lambda n, k: 10.0 if n == "fa3" or k[0] == 1 else 20.0)
    assert out["pruned_near"] == {"mtd": 2}
    found = {(n, "decode"): Candidate(n, "valid") for n in ("fa3", "mtd")}
    table = build_table(out, ["fa3", "mtd"])
    _annotate(found, "decode", ["fa3", "mtd"], table, bucket_errors(out), out["pruned_near"])
    assert found[("fa3", "decode")].reason == ""
    assert found[("mtd", "decode")].reason == ("not timed in 2 finer bucket(s): at least 1.30x the fastest in every "
                                               "coarse bucket near them (its score covers the buckets it was timed in)")
    assert found[("mtd", "decode")].timings_us == {"1x1056": 10.0, "4x1056": 20.0, "16x1056": 20.0, "64x1056": 20.0}


def test_interpolation_counts_a_candidate_pruned_at_a_corner_as_prune_times_its_fastest():
    """A candidate left out of a finer bucket (pruned near it) is, for the lookup, PRUNE times that bucket's fastest
    there, the least it was at the coarse buckets around: between that bucket and one where it is 2x ahead it must
    still win, not drop out of the interpolation because one corner lacks its time. The estimate survives the
    table's JSON round trip (the result cache)."""
    import json

    from attnsel.dispatch import DispatchTable

    measured = {"phase": "decode", "mode": "eager", "axes": ["batch", "context"], "grid_version": 1,
                "buckets": [{"key": [4, 1024], "label": "4x1024", "us": {"x": 10.0, "y": 20.0}},
                            {"key": [8, 1024], "label": "8x1024", "us": {"y": 10.0}, "pruned_near": ["x"]}]}
    table = build_table(measured, ["y", "x"])
    assert table.buckets[1].pruned_near == ("x",) and table.buckets[1].backend == "y"
    assert table.backend_for((5, 1024)) == "x"  # x: 0.32 log 1.3 = 0.08, y: 0.68 log 2 = 0.47
    assert table.backend_for((8, 1024)) == "y"
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table and again.backend_for((5, 1024)) == "x"


def test_a_cached_entry_whose_pruned_near_counts_are_not_counts_is_refused(monkeypatch):
    """selector._annotate reads the measured result's "pruned_near" as {name: finer buckets skipped}: a stored entry
    with a list there (a hand edit, another program's file) passed the cache's check and then crashed every
    selection that read it (AttributeError: 'list' object has no attribute 'get'); a count that is text or a bool
    went into the reason as it was. The cache names it, so that the phase is timed again instead."""
    from attnsel.cache import entry_problem
    from attnsel.selector import Candidate, _annotate
    from attnsel.store import bucket_errors

    grid = [(0, (1, 1056)), (0, (4, 1056)), (0, (16, 1056)), (0, (64, 1056)), (2, (23, 1056))]
    out, _ = _measure(monkeypatch, grid, "decode", lambda n, k: 10.0 if n == "fa3" or k[0] == 1 else 20.0)
    entry = {"kind": "dispatch", "status": "timed", "budget_s": 45.0, "measured": out}
    assert out["pruned_near"] == {"mtd": 1} and entry_problem(entry) is None  # the premise
    found = {(n, "decode"): Candidate(n, "valid") for n in ("fa3", "mtd")}
    with pytest.raises(AttributeError):  # what the selector does with a list there (selector.table's call)
        _annotate(found, "decode", ["fa3", "mtd"], build_table(out, ["fa3", "mtd"]), bucket_errors(out), ["mtd"])
    for bad in (["mtd"], "mtd", {"mtd": "1"}, {"mtd": True}, {"mtd": -1}, {"mtd": 1.5}, {3: 1}):
        entry["measured"]["pruned_near"] = bad
        assert "pruned_near" in (entry_problem(entry) or ""), bad


def test_a_bucket_reads_its_pruned_near_as_names_only():
    """A dispatch table's JSON (a report that scripts/replay_dispatch.py reads) with "pruned_near" as text was read
    letter by letter ("xy" -> ('x', 'y')): candidates that were never pruned took part in lookups. A bucket takes a
    list or tuple of names, kept as a tuple (equal tables compare equal), and names anything else."""
    from attnsel.dispatch import Bucket

    data = {"key": [8, 1024], "label": "8x1024", "backend": "y", "us": 10.0, "times_us": {"y": 10.0}}
    assert Bucket.from_json({**data, "pruned_near": ["x"]}).pruned_near == ("x",)
    assert Bucket.from_json(data) == Bucket.from_json({**data, "pruned_near": []})
    for bad in ("xy", [1], ["x", None], {"x": 1}):
        with pytest.raises(ValueError, match="pruned_near"):
            Bucket.from_json({**data, "pruned_near": bad})


def test_a_hand_made_table_with_a_candidate_only_pruned_near_its_buckets_serves():
    """A candidate in a bucket's pruned_near that has no time in any bucket (a hand-made table) took part in the
    interpolation but not in the table's tie-break order: the lookup raised ValueError ('x' is not in list)."""
    from attnsel.dispatch import Bucket, DispatchTable

    buckets = (Bucket((4, 1024), "4x1024", "y", 10.0, None, None, {"y": 10.0}, {}, pruned_near=("x",)),
               Bucket((8, 1024), "8x1024", "y", 20.0, None, None, {"y": 20.0}, {}, pruned_near=("x",)))
    table = DispatchTable("decode", "eager", ("batch", "context"), buckets, "y", 1)
    assert table.backend_for((5, 1024)) == "y"


def test_pruned_near_stays_off_ragged_and_graph_tables_and_off_timed_names():
    """Local pruning is eager and uniform-only (ragged buckets are timed with every candidate): a stored entry with a
    ragged bucket's or a graph bucket's "pruned_near" (a hand edit) put a PRUNE estimate into the ragged sub-table's
    lookups, and a name both timed and listed was kept in the bucket's pruned_near (the report listed it as not
    timed where it has a time). build_table keeps pruned_near on eager uniform buckets, for names without a time."""
    measured = {"phase": "decode", "mode": "eager", "axes": ["batch", "context"], "grid_version": 1,
                "buckets": [{"key": [4, 1024], "label": "4x1024", "us": {"x": 10.0, "y": 20.0}},
                            {"key": [8, 1024], "label": "8x1024", "us": {"y": 10.0, "z": 12.0},
                             "pruned_near": ["x", "z"]},
                            {"key": [8, 1024], "label": "ragged 8 (mean 1024, max 4000)", "ragged": True,
                             "us": {"y": 10.0}, "pruned_near": ["x"]}]}
    table = build_table(measured, ["y", "x", "z"])
    assert table.buckets[1].pruned_near == ("x",)
    assert table.ragged is not None and table.ragged.buckets[0].pruned_near == ()
    graph = build_table({**measured, "mode": "graph", "axes": ["batch", "context"]}, ["y", "x", "z"])
    assert all(b.pruned_near == () for b in graph.buckets)
