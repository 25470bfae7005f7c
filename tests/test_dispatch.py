"""Dispatch tables from injected timings: bucket boundaries, ties, untimed shapes (nearest bucket, interpolated
slowdowns), graph-mode decode by batch size, the JSON round trip and the lookup's errors."""
import json
import math
import re

import pytest

from attnsel.selection import DispatchTable, PhaseChoice, build_table
from tests.fixtures.dispatch import DECODE, _selection, measured


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
    # prefill: a ragged batch that matches no representative goes to the nearest point (tokens / longest, longest)
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


def test_a_key_of_the_wrong_length_is_named():
    """A (4,) or (4, 512, 99) key on a (batch, context) table is refused (zip() would truncate it and answer anyway)."""
    table = build_table(measured("decode", "eager", DECODE), ["a", "b"])
    for key in ((4,), (4, 512, 99), ()):
        for lookup in (table.backend_for, table.bucket_for, table.cell):
            with pytest.raises(ValueError, match=r"^a decode dispatch table \(eager\) is keyed by \(batch, context\), "
                                                 rf"got {re.escape(repr(key))}$"):
                lookup(key)


def test_shapes_between_timed_ones_take_the_least_interpolated_slowdown():
    """Graph-mode decode, 32/8 heads on the H200 (geometric means over contexts): FA3 won batch 16 by 0.9% and lost
    batch 8 by 6.5%; Triton was within 1% at both. At batch 12 the bench then measured FA3 1.24-1.31x slower than
    Triton: the nearest bucket (16) was the wrong guide, the interpolated slowdown is not."""
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


def test_a_shape_past_the_grids_end_is_interpolated_along_its_edge():
    """Beyond the timed batches the shape is clamped onto the edge (batch 4), not handed to the nearest bucket."""
    cells = {(1, 256): {"a": 1.0, "b": 2.0}, (1, 1024): {"a": 2.0, "b": 1.0},
             (4, 256): {"a": 1.0, "b": 1.5}, (4, 1024): {"a": 10.0, "b": 1.0}}
    table = build_table(measured("decode", "eager", cells), ["a", "b"])
    assert table.bucket_for((16, 400)).key == (4, 256) and table.bucket_for((16, 400)).backend == "a"
    # on the edge 4 x 256..1024, weights 0.69 and 0.31: a 0.69 x 0 + 0.31 x 2.30, b 0.69 x 0.41 + 0.31 x 0: b
    assert table.backend_for((16, 400)) == "b"
    assert table.without("interpolation").backend_for((16, 400)) == "a"


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
    """Shapes near a nearest-bucket boundary get the same answers whichever came first (a memo must not hand the
    first one's answer to the second): the answer is a function of the shape (rounded to 1/16 octave per axis for the
    nearest bucket, 1/32 of a step for interpolation), not of the calls before. Both lookups: the nearest bucket
    (interpolation off) and the interpolated one."""
    cells = {(2, 2 * n, n): ({"a": 1.0, "b": 2.0} if n <= 576 else {"a": 2.0, "b": 1.0}) for n in (288, 576, 1152)}
    keys = [(2, 1520, 760), (2, 1620, 810), (2, 1640, 820), (2, 1760, 880)]  # around the midpoint of 576 and 1152
    for rules in ((), ("interpolation",)):
        def fresh():
            return build_table(measured("prefill", "eager", cells), ["a", "b"]).without(*rules)

        alone = {k: fresh().backend_for(k) for k in keys}  # each shape asked first, of its own table
        for order in (keys, keys[::-1], [keys[1], keys[3], keys[0], keys[2]]):
            table = fresh()
            assert {k: table.backend_for(k) for k in order} == alone
        assert alone[keys[0]] == "a" and alone[keys[-1]] == "b"  # well inside either side
        if rules:
            assert alone == {k: fresh().bucket_for(k).backend for k in keys}


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


def test_nearest_bucket_is_measured_from_the_shape_not_its_cell():
    """On an H200, 40 prompts x 100 tokens lies in the untimed cell (32, 4608, 102); from the cell's centre the
    FA3 bucket (32, 4608, 144) was as near as FlashInfer's (32, 3264, 102) and served it 1.31x slower; from the
    shape itself FlashInfer's bucket is the nearest."""
    pre = {(64, 4608, 72): {"fa3": 51.8, "flashinfer": 52.0}, (32, 2304, 72): {"fa3": 29.4, "flashinfer": 28.6},
           (32, 4608, 144): {"fa3": 51.9, "flashinfer": 65.3}, (32, 3264, 102): {"fa3": 39.8, "flashinfer": 29.7},
           (64, 6528, 102): {"fa3": 70.8, "flashinfer": 54.6}}
    table = build_table(measured("prefill", "graph", pre), ["fa3", "flashinfer"])
    assert table.bucket_for((40, 4000, 100)).key == (32, 3264, 102)
    assert table.backend_for((40, 4000, 100)) == "flashinfer"
    assert table.bucket_for((32, 4608, 144)).key == (32, 4608, 144)  # a timed shape is its own bucket


def test_a_wave_step_between_timed_batches_is_served_by_the_faster_kernel():
    """28/4 decode at 100 x 9000 on an H100: 'w' (FA3, one block per row and KV head) led 'f' (FlashInfer) by 2.5% at 91
    rows (3 rounds of 132 SMs) and trailed by 0.5% at 128 (4 rounds); at 100 rows it has 4 rounds and was 1.11x slower.
    Interpolating between 91 and 128 alone serves 'w' there; with the wave batches 99 and 100 timed, 100 rows go to 'f'
    and 99 to 'w'."""
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



def test_prefill_interpolates_between_timed_uniform_batches():
    """Prefill looks up (total / longest, longest): the timed n x L batches form a full grid there, so a shape
    between them interpolates each candidate's slowdown from the four corners (in (seqs, tokens, longest) their
    corners are never all timed and the nearest bucket served). 2 x 190 is nearer to L 100, where a wins by 5%,
    than to L 400, where b wins by 2x: interpolated, b."""
    cells = {(n, n * length, length): ({"a": 1.0, "b": 1.05} if length == 100 else {"a": 2.0, "b": 1.0})
             for n in (1, 4) for length in (100, 400)}
    table = build_table(measured("prefill", "eager", cells), ["a", "b"])
    assert table.bucket_for((2, 380, 190)).key[2] == 100
    assert table.backend_for((2, 380, 190)) == "b"
    assert table.without("interpolation").backend_for((2, 380, 190)) == "a"
    assert table.backend_for((4, 400, 100)) == "a" and table.backend_for((1, 400, 400)) == "b"  # timed: their own


def test_a_ragged_prefill_batch_counts_as_the_longest_prompts_it_is_worth():
    """One 2500-token prompt among twenty 50-token ones (3500 tokens: 1.4 times its longest) is served like one
    long prompt, not like 21 sequences of a short-prompt bucket."""
    cells = {(1, 2048, 2048): {"a": 300.0, "b": 400.0}, (1, 4096, 4096): {"a": 900.0, "b": 1200.0},
             (16, 1024, 64): {"a": 50.0, "b": 20.0}, (16, 4096, 256): {"a": 80.0, "b": 40.0}}
    table = build_table(measured("prefill", "eager", cells), ["a", "b"])
    assert table.point((21, 3500, 2500)) == (3500 / 2500, 2500)
    assert table.backend_for((21, 3500, 2500)) == "a"
    assert table.backend_for((16, 16 * 100, 100)) == "b"


def test_a_prefill_key_past_what_a_batch_can_hold_is_looked_up_at_its_real_shape():
    """max_seqlen_q may be an upper bound (flash_attn_varlen_func) and total_q may count padding rows: a prefill
    batch's longest prompt is at most its tokens, and it is worth at most its number of sequences of its longest
    prompt. One 300-token prompt planned with max_seqlen_q 6400 is served as 1 x 300 (not as one 6400-token prompt),
    one 100-token prompt in 400 rows as 1 x 100 (not as 4 x 100)."""
    cells = {(n, n * length, length): ({"a": 1.0, "b": 2.0} if length <= 400 and n == 1 else {"a": 2.0, "b": 1.0})
             for n in (1, 4) for length in (100, 400, 1600, 6400)}
    table = build_table(measured("prefill", "eager", cells), ["a", "b"])
    assert table.point((1, 300, 6400)) == (1.0, 300)
    assert table.point((1, 400, 100)) == (1.0, 100)
    assert table.point((0, 0, 0)) == (1.0, 1)  # nothing: the smallest shape, no division by zero
    for key, real in (((1, 300, 6400), (1, 300, 300)), ((1, 400, 100), (1, 100, 100))):
        assert table.backend_for(key) == table.backend_for(real) == "a", key
        assert table.bucket_for(key) == table.bucket_for(real), key


def test_prefill_buckets_on_one_point_serve_as_the_first_of_them():
    """Two buckets of a hand-made prefill table on one lookup point (2 and 4 sequences of 200 tokens, longest 100):
    the lookup cannot tell them apart, so every lookup serves the first (as the nearest bucket's ties), never the
    interpolation one and the nearest bucket the other."""
    cells = {(2, 200, 100): {"a": 1.0, "b": 2.0}, (4, 200, 100): {"a": 2.0, "b": 1.0},
             (1, 800, 800): {"a": 1.0, "b": 3.0}}
    table = build_table(measured("prefill", "eager", cells), ["a", "b"])
    assert table.bucket_for((2, 200, 100)).key == (2, 200, 100)
    assert table.backend_for((2, 200, 100)) == table.bucket_for((2, 200, 100)).backend == "a"
