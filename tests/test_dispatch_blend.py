"""The eager decode lookup's blend (DispatchTable._blended): a decode batch the ragged buckets serve takes each
candidate's slowdown interpolated between the uniform and ragged tables by log(skew) / log(timed skew). Pure Python
on hand-made tables (as tests/test_dispatch_table.py)."""
import json
import math

import pytest

from attnsel.dispatch import DispatchTable, build_table
from attnsel.validate.grid import ragged_decode_lens
from tests.test_dispatch_table import BLEND_RAGGED, BLEND_UNIFORM, measured


def timed_skew(batch: int, sizes=(128, 512), mean=512) -> float:
    """The log of the timed ragged skew at ``batch`` rows, computed apart from dispatch.py: the timing batches' longest
    row over their mean at each timed size, linear in log batch between them, clamped at the ends."""
    logs = {n: math.log(max(ragged_decode_lens(n, mean)) / mean) for n in sizes}
    lo, hi = min(sizes), max(sizes)
    if batch <= lo or batch >= hi:
        return logs[lo if batch <= lo else hi]
    a, b = max(n for n in sizes if n <= batch), min(n for n in sizes if n >= batch)
    if a == b:
        return logs[a]
    f = (math.log(batch) - math.log(a)) / (math.log(b) - math.log(a))
    return logs[a] + f * (logs[b] - logs[a])


@pytest.mark.parametrize("flip", [0.5, 0.75, 0.9])
def test_the_blend_weight_matches_an_independent_computation(flip):
    """Uniform: "fi" leads by a slowdown of a; ragged: "fa3" leads by b. The blend picks "fi" iff w b < (1 - w) a,
    i.e. w < a / (a + b) = ``flip``, w = log(longest / mean) / the timed skew at the batch size (interpolated in log
    batch, clamped). Checked over batches inside and beyond 128-512 rows, away from the flip by more than 1/32."""
    a = math.log(1.2)
    b = a * (1 - flip) / flip
    uniform = {(n, 512): {"fi": 100.0, "fa3": 100.0 * math.exp(a)} for n in (64, 128, 512, 1024)}
    ragged = {(n, 512): {"fi": 100.0 * math.exp(b), "fa3": 100.0} for n in (128, 512)}
    table = build_table(measured(uniform, ragged=ragged), ["fa3", "fi"])
    checked = 0
    for batch in (64, 100, 128, 129, 200, 256, 300, 400, 511, 512, 700, 1024):
        for skew in (2.5, 3, 3.5, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 20):
            mean, longest = 512, int(skew * 512)
            if not table.ragged.covers((batch, mean), longest):
                continue
            w = min(1.0, math.log(longest / mean) / timed_skew(batch))
            if abs(w - flip) < 1 / 32:
                continue
            checked += 1
            assert table.backend_for((batch, mean), longest=longest) == ("fi" if w < flip else "fa3"), (batch, skew, w)
    assert checked > 60


def pruned_tables():
    """"p" was pruned after the coarse uniform grid (1.5x behind everywhere there): the finer uniform buckets never
    timed it (timing.measure), the ragged ones did, and there it is 3x ahead."""
    coarse = {(64, 256): {"p": 150.0, "fi": 100.0, "fa3": 105.0}, (64, 4096): {"p": 600.0, "fi": 400.0, "fa3": 390.0},
              (1024, 256): {"p": 900.0, "fi": 600.0, "fa3": 610.0},
              (1024, 4096): {"p": 9000.0, "fi": 6000.0, "fa3": 5900.0}}
    finer = {(n, c): {"fi": 100.0 * n / 64, "fa3": 104.0 * n / 64} for n in (128, 256, 512) for c in (256, 1024, 4096)}
    ragged = {(n, m): {"p": 100.0 * n / 64, "fi": 300.0 * n / 64, "fa3": 310.0 * n / 64}
              for n in (128, 512) for m in (512, 1024)}
    data = measured({**coarse, **finer}, ragged=ragged)
    data["pruned"] = {"p": 1.5}
    return build_table(data, ["fi", "fa3", "p"])


def test_at_or_past_the_timed_skew_the_ragged_buckets_decide_as_before():
    """A batch at least as skewed as the ragged buckets were timed (w = 1) is served as the ragged sub-table alone
    served it: on a timed ragged bucket within the tie band (TIE) its priority decides, as the bucket records; a
    candidate the finer uniform grid never timed (pruned) that wins the ragged buckets serves."""
    uniform = {(128, 512): {"fi": 100.0, "fa3": 112.0}, (512, 512): {"fi": 400.0, "fa3": 450.0}}
    ragged = {(128, 512): {"fi": 100.0, "fa3": 99.6}, (512, 512): {"fi": 400.0, "fa3": 398.5}}
    table = build_table(measured(uniform, ragged=ragged), ["fi", "fa3"])
    assert [b.backend for b in table.ragged.buckets] == ["fi", "fi"]  # within 1%: priority
    for key in ((128, 512), (512, 512)):
        assert table.without("blend").backend_for(key, longest=20 * 512) == "fi"
        assert table.backend_for(key, longest=20 * 512) == "fi"
    table = pruned_tables()
    assert table.without("blend").backend_for((300, 700), longest=20 * 700) == "p"
    assert table.backend_for((300, 700), longest=20 * 700) == "p"


def test_a_candidate_pruned_from_the_finer_uniform_grid_counts_there_at_its_coarse_ratio():
    """Below the timed skew "p" counts on the uniform side at its least ratio on the coarse grid (1.5x, as
    timing.prune recorded it) instead of dropping out of the blend: 3x ahead on the ragged side, it still wins at
    about half the timed skew, as the ragged sub-table alone chose."""
    table = pruned_tables()
    assert table.pruned == (("p", 1.5),)
    assert table.without("blend").backend_for((300, 700), longest=4 * 700) == "p"
    assert table.backend_for((300, 700), longest=4 * 700) == "p"
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.backend_for((300, 700), longest=4 * 700) == "p"


def test_ragged_buckets_of_zero_rows_or_mean_load_and_huge_rows_look_up():
    """Hand-made or loaded tables: a ragged bucket keyed 0 (rows or mean) raised ZeroDivisionError building the
    table, a longest row past a float's range OverflowError in the lookup (before the blend both worked)."""
    for key in ((0, 512), (512, 0)):
        table = build_table(measured(BLEND_UNIFORM, ragged={**BLEND_RAGGED, key: {"fi": 1.0, "fa3": 2.0}}),
                            ["fa3", "fi"])
        assert table.backend_for((512, 550), longest=2000) == "fi"
    table = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"])
    assert table.backend_for((512, 550), longest=10 ** 400) == "fa3"


def test_the_blend_is_a_lookup_option_only():
    """blend is not stored: a table without it compares unequal, prints and serialises the same, and round-trips
    to a table with it on (as interpolate and skew)."""
    table = build_table(measured(BLEND_UNIFORM, ragged=BLEND_RAGGED), ["fa3", "fi"])
    off = table.without("blend")
    assert off != table and off.to_json() == table.to_json() and str(off) == str(table)
    assert DispatchTable.from_json(off.to_json()) == table and off.ragged == table.ragged.without("blend")
    assert table.without("blend", "ragged").ragged is None
    assert table.without("interpolation").backend_for((512, 550), longest=2000) == "fi"
