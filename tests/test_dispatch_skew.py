"""The skewed eager decode lookup (DispatchTable.skewed / _skewed): a decode batch the ragged sub-table does not
serve, with its longest row at least grid.DECODE_SKEW times its mean, is estimated as its time at the mean plus one
row of its longest context; extend's skewed batches share its memo. Pure data: tables made by hand, no worker, no
device."""
import json

import pytest
import torch

from attnsel.dispatch import DispatchTable, build_table
from attnsel.selection import PhaseChoice
from attnsel.validate.grid import DECODE_SKEW
from tests.fixtures.dispatch import Recorder, _selection
from tests.test_dispatch_table import measured


def proportional(batches, contexts):
    """Cells where "whole" and "split" both take 10 us per 2 x 1056 tokens: they tie everywhere."""
    return {(b, c): {"whole": 10.0 * b * c / 1056, "split": 10.0 * b * c / 1056} for b in batches for c in contexts}


# 2 rows: "whole" is faster at 1056, "split" at 2080; one row is a tie at every context, so that the estimate of a
# skewed batch (its mean's time plus one row of its longest) goes by the time at its mean
AT_TWO = {**proportional((1, 2, 4), (1056, 2080, 4128)),
          (2, 1056): {"whole": 10.0, "split": 12.0}, (2, 2080): {"whole": 20.0, "split": 15.0}}


def test_a_skewed_decode_lookup_without_interpolation_does_not_depend_on_the_lookups_before_it():
    """without("interpolation") (scripts/replay_dispatch.py --rules): the nearest bucket gives the time at the mean.
    Means 1475 and 1490 lie on either side of the midpoint of 1056 and 2080 (1482), so their nearest buckets
    differ, but they round to one interpolation position: the estimate memoised for 1475 must not answer 1490."""
    fresh = build_table(measured(AT_TWO), ["whole", "split"]).without("interpolation")
    assert fresh.bucket_for((2, 1475)).key == (2, 1056) and fresh.bucket_for((2, 1490)).key == (2, 2080)
    assert fresh.backend_for((2, 1490), 3000) == "split"
    table = build_table(measured(AT_TWO), ["whole", "split"]).without("interpolation")
    assert table.backend_for((2, 1475), 3000) == "whole"
    assert table.backend_for((2, 1490), 3000) == "split"


def test_a_skewed_decode_lookup_next_to_a_hole_does_not_depend_on_the_lookups_before_it():
    """A corner of the box around the mean untimed (a bucket skipped for the time budget or the memory cap): the
    nearest bucket gives the time at the mean, as in the plain lookup, whose fallback is looked up from the exact
    key. 3 rows of means 1475 and 1490: nearest (4, 1056) and (4, 2080)."""
    cells = {**AT_TWO, (4, 1056): {"whole": 40.0, "split": 48.0}, (4, 2080): {"whole": 80.0, "split": 60.0}}
    del cells[(2, 1056)]
    fresh = build_table(measured(cells), ["whole", "split"])
    assert fresh.bucket_for((3, 1475)).key == (4, 1056) and fresh.bucket_for((3, 1490)).key == (4, 2080)
    assert fresh.backend_for((3, 1490), 3000) == "split"
    table = build_table(measured(cells), ["whole", "split"])
    assert table.backend_for((3, 1475), 3000) == "whole"
    assert table.backend_for((3, 1490), 3000) == "split"


def test_a_skewed_extend_lookup_without_interpolation_does_not_depend_on_the_lookups_before_it():
    """The same memo serves extend's skewed batches: 4 requests of 2 queries, mean contexts 1475 and 1490."""
    from tests.test_dispatch_table import extend_table
    cells = {(r, 2, c): {"whole": 10.0 * r * c / 1056, "split": 10.0 * r * c / 1056}
             for r in (1, 4, 16) for c in (1056, 2080, 4128)}
    cells[(4, 2, 1056)] = {"whole": 10.0, "split": 12.0}
    cells[(4, 2, 2080)] = {"whole": 20.0, "split": 15.0}
    fresh = extend_table(cells, ("whole", "split")).without("interpolation")
    assert fresh.backend_for((4, 2, 1490), 4000) == "split"
    table = extend_table(cells, ("whole", "split")).without("interpolation")
    assert table.backend_for((4, 2, 1475), 4000) == "whole"
    assert table.backend_for((4, 2, 1490), 4000) == "split"


# "whole" reads a row in one program per head: one long row alone costs it the most; "split" spreads a row over the
# GPU and is a little slower on 2 uniform rows
WAITS = {(1, 1056): {"whole": 10.0, "split": 8.0}, (1, 4128): {"whole": 40.0, "split": 16.0},
         (2, 1056): {"whole": 10.0, "split": 12.0}, (2, 4128): {"whole": 40.0, "split": 38.0}}


def test_the_skew_threshold_and_the_shapes_that_never_skew():
    """At least 2 rows and the longest at least DECODE_SKEW x the mean; batch 1, a longest below the mean or 0, and a
    mean of 0 with a longest of 0 or 1 are not skewed; the lookup answers for each (no crash, never None)."""
    table = build_table(measured(AT_TWO), ["whole", "split"])
    assert DECODE_SKEW == 1.5 and table.skewed((2, 2000), 3000) and not table.skewed((2, 2000), 2999)
    assert not table.skewed((1, 2000), 10**6) and not table.skewed((2, 2000), 100)
    assert not table.skewed((2, 2000), 0) and not table.skewed((2, 0), 1) and table.skewed((2, 0), 2)
    for key, longest in (((1, 2000), 10**6), ((2, 2000), 100), ((2, 2000), 0), ((2, 0), 0), ((2, 0), 5),
                         ((10**6, 10**6), 10**7), ((2, 1), 10**7)):
        assert table.backend_for(key, longest) in ("whole", "split")


def test_graph_decode_and_prefill_tables_never_take_the_skewed_estimate():
    """Graph decode (keyed by batch size) and prefill answer the same with and without a longest row."""
    graph = build_table(measured(AT_TWO, mode="graph"), ["whole", "split"])
    assert graph.axes == ("batch",) and not graph.skewed((2,), 10**6)
    assert all(graph.backend_for((b,), 10**6) == graph.backend_for((b,)) for b in (1, 2, 3, 4, 8))
    prefill = DispatchTable.from_json({**build_table(measured(AT_TWO), ["whole", "split"]).to_json(),
                                       "phase": "prefill", "axes": ["num_seqs", "total_tokens", "longest"],
                                       "buckets": [{"key": [1, 1024, 1024], "label": "1x1024", "backend": "whole",
                                                    "us": 1.0, "times_us": {"whole": 1.0, "split": 2.0}}]})
    assert not prefill.skewed((4, 4096, 4000), 10**6)


def test_a_skewed_decode_lookup_without_common_candidates_falls_back_to_the_mean():
    """The time at the mean and the row alone share no candidate ("whole" timed only on 2 rows, "split" only on one):
    the estimate has nothing to compare and the plain lookup serves, as for a batch that is not skewed."""
    cells = {(1, 1056): {"split": 10.0}, (1, 4128): {"split": 30.0},
             (2, 1056): {"whole": 10.0}, (2, 4128): {"whole": 30.0}}
    table = build_table(measured(cells), ["whole", "split"])
    assert table.backend_for((2, 1500), 4000) == table.backend_for((2, 1500)) == "whole"


def test_a_loaded_decode_table_with_unusable_times_at_the_lone_row():
    """A loaded table whose one-row buckets hold 0 or None for a candidate: that candidate takes no part in the
    estimate there (no log(0), no None + float); a one-row bucket with no usable time leaves the plain lookup."""
    data = build_table(measured(AT_TWO), ["whole", "split"]).to_json()
    for b in data["buckets"]:
        if b["key"][0] == 1:
            b["times_us"]["split"] = 0.0 if b["key"][1] == 4128 else None
    loaded = DispatchTable.from_json(json.loads(json.dumps(data)))
    assert loaded.backend_for((2, 2080), 4000) == "whole"  # "split" has no time for one row of 4128
    for b in data["buckets"]:
        if b["key"][0] == 1:
            b["times_us"] = {"whole": None, "split": 0}
    empty = DispatchTable.from_json(json.loads(json.dumps(data)))
    assert empty.backend_for((2, 2080), 4000) == empty.backend_for((2, 2080)) == "split"


def test_a_skewed_lookup_and_the_plain_one_share_the_memo_without_colliding():
    """The plain lookup's answer at a key is the same before and after a skewed lookup of that key (both memoised
    in one dict)."""
    table = build_table(measured(WAITS), ["whole", "split"])
    plain = build_table(measured(WAITS), ["whole", "split"]).backend_for((2, 1100))
    assert table.backend_for((2, 1100), 4128) == "split" and plain == "whole"
    assert table.backend_for((2, 1100)) == plain and table.backend_for((2, 1100), 4128) == "split"


def test_plan_decode_routes_a_mildly_skewed_batch_by_its_longest_row(monkeypatch):
    """plan_decode with context_tokens and longest reaches the estimate (2 rows, mean 1100, longest 2000 of 2200
    tokens: 1.8x the mean); the canary is not involved; graph mode ignores longest."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    cells = {k: {"rec_a": t["whole"], "rec_b": t["split"]} for k, t in WAITS.items()}
    sel = _selection({"decode": PhaseChoice("rec_a", "auto", [], build_table(measured(cells), ["rec_a", "rec_b"]))})
    meta = dict(device="meta", dtype=torch.int32)
    pt, lens = torch.empty(2, 200, **meta), torch.empty(2, **meta)
    Recorder.planned.clear()
    sel.plan_decode(pt, lens, max_seq_len=3200, context_tokens=2200)
    sel.plan_decode(pt, lens, max_seq_len=3200, context_tokens=2200, longest=2000)
    sel.plan_decode(pt, lens, max_seq_len=3200, context_tokens=2200, longest=1200)  # 1.09x: by the mean
    assert Recorder.planned == ["rec_a", "rec_b", "rec_a"]
    graph = build_table(measured(cells, mode="graph"), ["rec_a", "rec_b"])
    gsel = _selection({"decode": PhaseChoice("rec_a", "auto", [], graph)})
    assert gsel.decode_backend_for(2, 1100, 2000) == gsel.decode_backend_for(2, 1100)


@pytest.mark.parametrize("longest, message", [
    (3300, r"longest=3300 is more than max_seq_len=3200, which bounds every row's context"),
    (1000, r"longest=1000 is less than the mean context 1100 \(context_tokens=2200 over 2 rows\)"),
])
def test_plan_decode_refuses_a_longest_that_contradicts_its_other_host_ints(monkeypatch, longest, message):
    """A longest above max_seq_len, or below the mean context, contradicts the other host ints (one of them is
    wrong), and from 1.5x the mean it changes the pick: refused as plan_extend refuses it, not served silently."""
    from attnsel.errors import InvalidArgument
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    cells = {k: {"rec_a": t["whole"], "rec_b": t["split"]} for k, t in AT_TWO.items()}
    sel = _selection({"decode": PhaseChoice("rec_a", "auto", [], build_table(measured(cells), ["rec_a", "rec_b"]))})
    meta = dict(device="meta", dtype=torch.int32)
    pt, lens = torch.empty(2, 200, **meta), torch.empty(2, **meta)
    with pytest.raises(InvalidArgument, match=message):
        sel.plan_decode(pt, lens, max_seq_len=3200, context_tokens=2200, longest=longest)
