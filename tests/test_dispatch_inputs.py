"""Bad input to the dispatch lookup and to loaded tables (a hand-edited or corrupted cache file or bench record): a
clear ValueError naming what is wrong, or a time the lookup cannot use left out; never a pick from garbage, a
backend without a usable time, or an unclear error (math domain error, TypeError, a float NaN). Pure Python."""
import copy
import json
import math
import re

import numpy as np
import pytest

from attnsel.cache import entry_problem
from attnsel.dispatch import DispatchTable, build_table
from attnsel.errors import InvalidArgument
from tests.test_dispatch_blend import pruned_tables
from tests.test_dispatch_table import BLEND_RAGGED, BLEND_UNIFORM, measured

NOT_COUNTS = [math.nan, math.inf, -math.inf, None, "4", 2.5, -1, True, np.float64(4.0)]


@pytest.mark.parametrize("bad", NOT_COUNTS, ids=repr)
def test_a_key_entry_that_is_no_host_int_is_named(bad):
    """A NaN batch answered "fi" (max(nan, 1) is nan, and every comparison with it is false); None and text raised
    TypeError from a comparison deep in the lookup, a float with a huge longest OverflowError (a huge int is
    fine: clamped onto the grid's edge)."""
    table = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"])
    for key in ((bad, 550), (512, bad)):
        for lookup in (lambda k: table.backend_for(k, 2000), table.backend_for, table.bucket_for, table.cell):
            with pytest.raises(InvalidArgument, match=r"^a decode dispatch table \(eager\) is keyed by \(batch, "
                                                      r"context\), got .*: one host int >= 0 per axis"):
                lookup(key)
    assert table.backend_for((1 << 62, 1 << 62), 10 ** 400) in ("fa3", "fi")  # huge host ints: clamped


def test_numpy_ints_and_zeros_are_host_ints():
    table = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"])
    for key, longest in (((512, 550), 2000), ((300, 550), 1400), ((0, 0), None), ((300, 550), 0)):
        want = table.backend_for(key, longest)
        got = table.backend_for(tuple(np.int64(x) for x in key), None if longest is None else np.int64(longest))
        assert got == want


@pytest.mark.parametrize("ratio", [0, 0.0, 0.5])
def test_a_cached_pruned_ratio_below_one_is_malformed(ratio):
    """A pruned candidate's ratio is its least time over the fastest's (timing.prune): at least 1. The cache took 0,
    and the blend then raised "math domain error" on log(0) for a batch the ragged buckets serve."""
    table = pruned_tables()
    data = copy.deepcopy(measured({}, ragged={}))
    data["buckets"] = [{"key": list(b.key), "label": b.label, "us": b.times_us, "spread": {}, "ragged": r}
                       for t, r in ((table, False), (table.ragged, True)) for b in t.buckets]
    data["pruned"] = {"p": ratio}
    assert "pruned" in entry_problem({"kind": "dispatch", "status": "ok", "measured": data})
    data["pruned"] = {"p": 1.5}
    assert entry_problem({"kind": "dispatch", "status": "ok", "measured": data}) is None


@pytest.mark.parametrize("ratio", [0, -1.0, math.nan, math.inf, "1.5", None, True])
def test_a_loaded_pruned_ratio_that_is_no_ratio_is_named(ratio):
    data = pruned_tables().to_json()
    data["pruned"]["p"] = ratio
    with pytest.raises(ValueError, match=r"^pruned: candidate 'p' has ratio .*; expected a finite number >= 1"):
        DispatchTable.from_json(json.loads(json.dumps(data)))


@pytest.mark.parametrize("bad", [math.inf, True, -5.0, math.nan, "7", None])
def test_a_loaded_time_the_lookup_cannot_use_takes_no_part(bad):
    """An infinite time made every slowdown at its bucket inf (and with all of them inf, NaN); true counted as 1 us
    and won. Such a time takes no part, as 0 or None does."""
    table = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"])
    data = table.to_json()
    for b in data["buckets"] + data["ragged"]["buckets"]:
        b["times_us"]["c"] = bad
    loaded = DispatchTable.from_json(json.loads(json.dumps(data)))
    for key, longest in (((512, 550), 2000), ((300, 550), 1400), ((200, 512), 900), ((300, 600), None),
                         ((128, 512), None), ((512, 550), 12 * 550)):
        assert loaded.backend_for(key, longest) == table.backend_for(key, longest)


@pytest.mark.parametrize("bad", [math.nan, None, 0, -1.0, math.inf, "100", "gone", "null"])
def test_a_loaded_bucket_whose_backend_has_no_usable_time_is_named(bad):
    """A bucket's backend is the one it was timed fastest (or within the tie band) with: a loaded bucket whose backend
    has no usable time there served that backend on its own shape and as the nearest bucket; a null backend of a
    bucket without times was returned by backend_for. (A bucket with no usable time at all still loads, and serves
    its backend as the nearest bucket: tests/test_dispatch.py.)"""
    data = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"]).to_json()
    bucket = data["buckets"][0]
    if bad == "gone":
        bucket["backend"] = "ghost"
    elif bad == "null":
        bucket["backend"], bucket["times_us"] = None, {}
    else:
        bucket["times_us"][bucket["backend"]] = bad
    with pytest.raises(ValueError, match=rf"^bucket {bucket['label']}: its backend {bucket['backend']!r} is no "
                                         r"candidate with a usable time there \(times_us: .*\); a usable time is a "
                                         r"finite number > 0"):
        DispatchTable.from_json(json.loads(json.dumps(data)))


def test_buckets_keyed_zero_look_up_as_keyed_one():
    """Hand-made or loaded tables may key a bucket 0 (rows or context; tests/test_dispatch_blend.py): a shape between
    it and the next timed value raised "math domain error" on log(0). In the interpolation such a bucket sits at 1,
    where a lookup's own 0 is read (whether the ragged buckets cover a batch still reads their keys as they are)."""
    def table(zero):
        uniform = {**BLEND_UNIFORM, (zero, 512): {"fi": 90.0, "fa3": 80.0}, (128, zero): {"fi": 5.0, "fa3": 9.0}}
        ragged = {**BLEND_RAGGED, (zero, 512): {"fi": 1.0, "fa3": 2.0}}
        return build_table(measured(uniform, ragged=ragged), ["fa3", "fi"])

    zero, one = table(0), table(1)
    for key, longest in (((64, 512), None), ((64, 512), 2000), ((1, 1), None), ((0, 0), None), ((128, 30), None),
                         ((100, 300), 5000), ((2, 600), 2000), ((3, 512), 1000), ((2, 30), 100)):
        assert zero.backend_for(key, longest) in ("fa3", "fi")
        if longest is None or not one.ragged.covers(key, longest):
            assert zero.backend_for(key, longest) == one.backend_for(key, longest), (key, longest)


@pytest.mark.parametrize("bad", [math.nan, None, "128", -5, 2.5, math.inf, True])
def test_a_loaded_bucket_key_that_is_no_host_int_is_named(bad):
    """A bucket key of NaN was read (its bounds NaN: lookups from garbage), None or text raised TypeError, a negative
    entry "math domain error", a float in a ragged key TypeError building the table."""
    for where in ("buckets", "ragged"):
        data = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"]).to_json()
        bucket = (data if where == "buckets" else data["ragged"])["buckets"][0]
        bucket["key"][0] = bad
        with pytest.raises(ValueError, match=rf"^bucket {re.escape(bucket['label'])}: key .*: expected one host int "
                                             r">= 0 per axis"):
            DispatchTable.from_json(json.loads(json.dumps(data)))
