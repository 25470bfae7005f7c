"""Ragged decode buckets: an eager decode table keeps a sub-table timed on batches of one long row among short ones, and
a batch whose longest row is at least bucket_grid.RAGGED_SKEW times its mean context is served from it. The grid, the
routing from host sizes, the cache and JSON round trips, the report. No GPU: timings are made by hand."""
import dataclasses
import json

import pytest
import torch

import attnsel.backends as backends_mod
from attnsel import select
from attnsel.cache import entry_problem
from attnsel.store import bucket_errors
from attnsel.selection import DispatchTable, PhaseChoice, build_table
from attnsel.spec import AttentionSpec
from attnsel.validate import grid as bucket_grid
from attnsel.validate import timing
from tests.fixtures.dispatch import PRE, SPEC, Recorder, _selection, fake_worker, measured

UNIFORM = {(1, 256): {"a": 10.0, "b": 20.0}, (1, 4096): {"a": 10.0, "b": 20.0},
           (32, 256): {"a": 10.0, "b": 20.0}, (32, 4096): {"a": 10.0, "b": 20.0}}
RAGGED = {(4, 1024): {"a": 30.0, "b": 20.0}, (4, 4096): {"a": 30.0, "b": 20.0},
          (16, 1024): {"a": 30.0, "b": 20.0}, (16, 4096): {"a": 30.0, "b": 20.0}}


def with_ragged(mode="eager", uniform=UNIFORM, ragged=RAGGED):
    """timing.measure's result with ragged buckets after the uniform ones (as the eager decode grid times them)."""
    out = measured("decode", mode, uniform)
    extra = measured("decode", mode, ragged)["buckets"]
    for b in extra:
        b["ragged"] = True
        b["label"] = f"ragged {b['key'][0]} (mean {b['key'][1]})"
    out["buckets"] += extra
    return out


@pytest.mark.parametrize("batch", [8, 9, 32, 128, 512])
@pytest.mark.parametrize("mean", [256, 1024, 4096])
def test_ragged_timing_batches_have_their_mean_and_one_long_row(batch, mean):
    lens = bucket_grid.ragged_decode_lens(batch, mean)
    assert len(lens) == batch and all(n >= 1 for n in lens)
    assert bucket_grid.ragged_key(lens) == (batch, mean) and sum(lens) == batch * mean
    assert max(lens) >= bucket_grid.RAGGED_SKEW * sum(lens) / batch  # the lookup takes it for a ragged batch
    assert min(lens) <= mean / 6  # short rows too, not two halves
    # a serving batch's tail: the longest row grows with the batch (log-normal rows), 3x the mean at 8 rows
    assert max(lens) / mean >= {8: 3, 9: 3, 32: 5, 128: 8, 512: 12}[batch]
    assert batch < 3 or lens != sorted(lens)  # rows in a fixed shuffled order
    assert lens == bucket_grid.ragged_decode_lens(batch, mean)


def test_ragged_buckets_are_timed_on_a_gpu_only():
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")  # the grids read no device (no GPU needed)
    grid = bucket_grid.ragged_decode_grid(spec, cuda)
    assert all(lvl == 0 for lvl, _ in grid)
    # every (batch, mean) whose KV fits the uniform grid's cap (4 GiB): 512 rows x 4096 (8 GiB) does not
    assert {bucket_grid.ragged_key(lens) for _, lens in grid} == {
        (b, m) for b in bucket_grid.RAGGED_DECODE_BATCHES for m in bucket_grid.RAGGED_DECODE_MEANS} - {(512, 4096)}
    assert len(grid) == len(bucket_grid.RAGGED_DECODE_BATCHES) * len(bucket_grid.RAGGED_DECODE_MEANS) - 1
    # graph mode: one ragged batch per captured batch size (but 1) at its batch size's level
    graph = bucket_grid.ragged_decode_grid(spec, cuda, mode="graph", sms=132)
    levels = {b: lvl for lvl, b, _ in bucket_grid.decode_grid(spec, cuda, mode="graph", sms=132)}
    assert sorted(len(lens) for _, lens in graph) == sorted(b for b in levels if b > 1
                                                            for _ in bucket_grid.GRAPH_RAGGED_MEANS)
    assert all(lvl == levels[len(lens)] and bucket_grid.ragged_key(lens)[1] in bucket_grid.GRAPH_RAGGED_MEANS
               for lvl, lens in graph)
    assert bucket_grid.ragged_decode_grid(spec, torch.device("cpu")) == []
    # the caps of the uniform grid: 128 rows x 4096 on average is 2 GiB of KV here; a sixth of 3 GiB free leaves it out
    small = bucket_grid.ragged_decode_grid(spec, cuda, free_bytes=3 << 30)
    assert all(bucket_grid.decode_bytes(spec, 1, sum(lens)) <= (3 << 30) // 6 for _, lens in small)
    assert len(small) < len(grid)


def test_ragged_buckets_leave_room_for_the_torch_backends_copy():
    """torch's decode gathers every row to the longest row's width (batch x longest), 3-13x a ragged bucket's KV:
    28/4 heads, 512 rows x 4096 on average, 24 GiB free, passes the uniform grid's rule (4 GiB of KV, a sixth of free)
    and torch would then hold 4 + 55 GiB. A ragged bucket's KV and that copy stay within half of free memory; on an
    idle H100 (78 GiB free) 8 KV heads of 128 keep every bucket but 512 rows x 4096 (over the KV cap)."""
    from attnsel.backends import torch_sdpa

    lens = bucket_grid.ragged_decode_lens(8, 64)  # the premise, on the real code: a [batch, longest] slot gather
    pages = [-(-n // 16) for n in lens]
    table = torch.zeros(8, max(pages), dtype=torch.int32)
    page, _, _, _ = torch_sdpa._slots(16, table, torch.tensor(lens, dtype=torch.int32), max(lens), None)
    assert tuple(page.shape) == (8, max(lens))
    cuda = torch.device("cuda")  # the grids read no device
    gib = 1 << 30
    for q, kv, d in ((32, 8, 128), (28, 4, 128), (8, 1, 128), (16, 8, 256)):
        spec = AttentionSpec(q, kv, d, "bf16", 16)
        per_token = 2 * kv * d * 2  # K and V, bf16
        for free in (6 * gib, 12 * gib, 24 * gib, 48 * gib, 78 * gib):
            for _, lens in bucket_grid.ragged_decode_grid(spec, cuda, free_bytes=free):
                held = sum(lens) * per_token + len(lens) * max(lens) * per_token
                assert held <= free / 2, (spec.describe(), free // gib, len(lens), sum(lens) // len(lens))
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    keys = {bucket_grid.ragged_key(lens) for _, lens in bucket_grid.ragged_decode_grid(spec, cuda, free_bytes=78 * gib)}
    assert keys == {(b, m) for b in bucket_grid.RAGGED_DECODE_BATCHES
                    for m in bucket_grid.RAGGED_DECODE_MEANS} - {(512, 4096)}
    spec = AttentionSpec(28, 4, 128, "bf16", 16)
    keys = {bucket_grid.ragged_key(lens) for _, lens in bucket_grid.ragged_decode_grid(spec, cuda, free_bytes=24 * gib)}
    assert (512, 1024) not in keys and (128, 4096) in keys


def test_measure_times_the_ragged_buckets_after_the_coarse_grid(monkeypatch):
    seen = []

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        seen.append(shape)
        return {"us": {n: 1.0 for n in cands}, "spread": {n: 0.0 for n in cands}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(timing, "_free_bytes", lambda device: None)
    monkeypatch.setattr(timing, "device_sms", lambda device: 132)  # measure adds the device's wave batches
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    waves = {17, 34, 49, 50}  # 32/8 on 132 SMs (tests/test_timing.py::test_wave_batches_bracket_...)
    out = timing.measure(spec, "decode", ["a", "b"], torch.device("cuda"), "eager")
    # a grid built without the SM count would drop them unnoticed
    assert {s[0] for s in seen if isinstance(s, tuple)} == set(bucket_grid.DECODE_BATCHES) | waves
    coarse = sum(1 for lvl, _, _ in bucket_grid.decode_grid(spec, torch.device("cuda")) if lvl == 0)
    ragged = [lens for _, lens in bucket_grid.ragged_decode_grid(spec, torch.device("cuda"))]
    assert seen[coarse:coarse + len(ragged)] == ragged
    assert all(isinstance(s, tuple) for s in seen[:coarse] + seen[coarse + len(ragged):])
    flagged = [b for b in out["buckets"] if b.get("ragged")]
    assert [b["key"] for b in flagged] == [list(bucket_grid.ragged_key(lens)) for lens in ragged]
    assert flagged[0]["label"] == f"ragged 8 (mean 256, max {max(ragged[0])})"
    table = build_table(out, ["a", "b"])
    assert table.ragged is not None and len(table.ragged.buckets) == len(ragged)
    assert not any(b.label.startswith("ragged") for b in table.buckets)
    seen.clear()  # graph mode: a ragged batch of each batch size (but 1), scored with its uniform contexts
    out = timing.measure(spec, "decode", ["a", "b"], torch.device("cuda"), "graph")
    assert {s[0] for s in seen if isinstance(s, tuple)} == set(bucket_grid.DECODE_BATCHES) | waves
    assert {len(s) for s in seen if isinstance(s, list)} == (set(bucket_grid.DECODE_BATCHES) | waves) - {1}
    table = build_table(out, ["a", "b"])
    assert table.ragged is None and "ragged mean 2048" in table.buckets[-1].label


def test_a_ragged_batch_is_served_by_the_ragged_buckets():
    table = build_table(with_ragged(), ["a", "b"])
    assert {b.backend for b in table.buckets} == {"a"} and {b.backend for b in table.ragged.buckets} == {"b"}
    assert table.backend_for((8, 2000)) == "a"  # no longest row given: the uniform buckets
    assert table.backend_for((8, 2000), longest=2000) == "a"  # uniform
    assert table.backend_for((8, 2000), longest=4999) == "a"  # below RAGGED_SKEW x the mean: not timed so mild
    assert table.backend_for((8, 2000), longest=5000) == "b"  # 2.5x the mean
    assert table.backend_for((8, 2000), longest=9000) == "b"
    assert table.backend_for((32, 8192), longest=30000) == "b"  # within 2x of the timed (16, 4096)
    # farther from every timed ragged bucket the uniform buckets decide: no extrapolation over measured uniform ones
    assert table.backend_for((33, 2000), longest=9000) == table.backend_for((8, 500), longest=9000) == "a"
    assert table.backend_for((500, 10**6), longest=10**7) == "a"
    assert table.backend_for((1, 2000), longest=9000) == "a"  # one row is never ragged
    # a hole in the ragged grid (a bucket the memory cap left out) is not bridged by the buckets around it
    holed = with_ragged(ragged={k: v for k, v in RAGGED.items() if k != (16, 4096)})
    assert build_table(holed, ["a", "b"]).backend_for((16, 8000), longest=30000) == "a"
    plain = build_table(measured("decode", "eager", UNIFORM), ["a", "b"])  # a table without ragged buckets
    assert plain.ragged is None and plain.backend_for((8, 2000), longest=9000) == "a"


def test_ragged_buckets_alone_make_no_table_and_belong_to_eager_decode_tables():
    only = with_ragged()
    only["buckets"] = [b for b in only["buckets"] if b.get("ragged")]
    assert build_table(only, ["a", "b"]) is None  # they do not serve uniform batches
    eager = build_table(with_ragged(), ["a", "b"])
    graph = build_table(with_ragged("graph"), ["a", "b"])
    with pytest.raises(ValueError, match="ragged buckets form one eager decode sub-table keyed by"):
        dataclasses.replace(graph, ragged=eager.ragged)
    data = graph.to_json()
    data["ragged"] = eager.ragged.to_json()  # a hand-edited cache entry
    with pytest.raises(ValueError, match=r"under a graph decode table keyed by \('batch',\)$"):
        DispatchTable.from_json(data)
    with pytest.raises(ValueError, match="got a eager decode sub-table keyed by .* with its own sub-table"):
        dataclasses.replace(eager, ragged=eager)  # nested
    with pytest.raises(ValueError, match="got a graph decode sub-table"):
        dataclasses.replace(eager, ragged=dataclasses.replace(eager.ragged, mode="graph"))


def test_graph_tables_score_ragged_buckets_with_their_batch_size():
    """No sub-table under graphs (a graph is keyed by its batch size alone): a ragged bucket counts in its batch
    size's geometric mean, with the uniform contexts."""
    table = build_table(with_ragged("graph"), ["a", "b"])
    assert table.axes == ("batch",) and table.ragged is None
    assert [b.key for b in table.buckets] == [(1,), (4,), (16,), (32,)]
    assert [b.backend for b in table.buckets] == ["a", "b", "b", "a"]
    assert table.buckets[1].label == "batch 4 (ragged mean 1024, 4096)"
    both = with_ragged("graph", ragged={(32, 2048): {"a": 90.0, "b": 20.0}})  # a: 10, 10 uniform; 90 ragged
    table = build_table(both, ["a", "b"])
    assert table.backend_for((32,)) == "b" and table.buckets[-1].label == "batch 32 (ctx 256-4096, ragged mean 2048)"


def test_ragged_table_json_and_cache_round_trip(monkeypatch):
    table = build_table(with_ragged(), ["a", "b"])
    data = json.loads(json.dumps(table.to_json()))
    assert data["ragged"]["axes"] == ["batch", "context"] and len(data["ragged"]["buckets"]) == 4
    again = DispatchTable.from_json(data)
    assert again == table and again.backend_for((8, 2000), 9000) == "b"
    calls = []
    fake_worker(monkeypatch, {"prefill": measured("prefill", "eager", PRE),
                              "decode": with_ragged(uniform={k: {"torch": v["a"], "triton": v["b"]}
                                                             for k, v in UNIFORM.items()},
                                                    ragged={k: {"torch": v["a"], "triton": v["b"]}
                                                            for k, v in RAGGED.items()})}, calls)
    order = ["triton", "torch"]
    cold = select(SPEC, prefill_priority=order, decode_priority=order)
    warm = select(SPEC, prefill_priority=order, decode_priority=order)
    assert cold.cache == "miss" and warm.cache == "hit" and len(calls) == 1
    assert warm.dispatch["decode"] == cold.dispatch["decode"] and warm.dispatch["decode"].ragged is not None
    assert warm.decode_backend_for(8, 2000) == "torch" and warm.decode_backend_for(8, 2000, 9000) == "triton"


def test_a_cached_ragged_flag_that_is_not_a_bool_is_refused():
    entry = {"kind": "dispatch", "status": "timed", "budget_s": 45.0, "measured": {**with_ragged(), "pruned": {}}}
    assert entry_problem(entry) is None
    entry["measured"]["buckets"][-1]["ragged"] = "yes"
    assert "ragged flag that is not true/false" in entry_problem(entry)


def test_plan_decode_routes_a_ragged_batch_from_host_sizes(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    data = with_ragged(uniform={k: {"rec_a": v["a"], "rec_b": v["b"]} for k, v in UNIFORM.items()},
                       ragged={k: {"rec_a": v["a"], "rec_b": v["b"]} for k, v in RAGGED.items()})
    sel = _selection({"decode": PhaseChoice("rec_a", "auto", [], build_table(data, ["rec_a", "rec_b"]))})
    Recorder.planned.clear()
    meta = dict(device="meta", dtype=torch.int32)
    pt, lens = torch.empty(8, 600, **meta), torch.empty(8, **meta)
    # 8 rows, 16000 context tokens (mean 2000): longest 9000 is ragged, 2100 is not
    sel.plan_decode(pt, lens, max_seq_len=9000, context_tokens=16000, longest=9000)
    sel.plan_decode(pt, lens, max_seq_len=9000, context_tokens=16000, longest=2100)
    # max_seq_len is a bound (an engine may pass its table's capacity): alone it says nothing about raggedness
    sel.plan_decode(pt, lens, max_seq_len=9000, context_tokens=16000)
    # without context_tokens the longest row is the context: nothing says the batch is ragged
    sel.plan_decode(pt, lens, max_seq_len=9000, longest=9000)
    assert Recorder.planned == ["rec_b", "rec_a", "rec_a", "rec_a"]
    for bad in (torch.tensor(9000), -1, 9000.0):
        with pytest.raises(ValueError, match="^longest: expected None or a non-negative Python int"):
            sel.plan_decode(pt, lens, context_tokens=16000, longest=bad)


@pytest.mark.parametrize("append", [False, True])
def test_the_flash_api_plans_with_the_exact_longest_row(monkeypatch, tmp_path, append):
    import attnsel
    from attnsel import flash_api
    from attnsel.selection import Selection

    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    flash_api.configure(policy="priority")
    seen = []
    original = Selection.plan_decode

    def recording(self, page_table, seq_lens, max_seq_len=None, context_tokens=None, **kw):
        seen.append((max_seq_len, context_tokens, kw.get("longest")))
        return original(self, page_table, seq_lens, max_seq_len, context_tokens, **kw)

    monkeypatch.setattr(Selection, "plan_decode", recording)
    try:
        lens, ps = [1, 5, 16, 21], 4
        kc, vc = torch.randn(32, ps, 2, 16), torch.randn(32, ps, 2, 16)
        table = torch.arange(32, dtype=torch.int32).view(4, 8)  # 32 tokens of room per row: a bound, not the max
        cached = torch.tensor(lens, dtype=torch.int32) - (1 if append else 0)
        new = (torch.randn(4, 1, 2, 16), torch.randn(4, 1, 2, 16)) if append else ()
        attnsel.flash_attn_with_kvcache(torch.randn(4, 1, 4, 16), kc, vc, *new, cache_seqlens=cached,
                                        page_table=table, causal=True)
    finally:
        flash_api.configure()
    assert seen == [(21, 43, 21)]  # the batch's longest row (appended token included) and its tokens, not the capacity


def test_report_lists_the_ragged_buckets(monkeypatch):
    from rich.console import Console

    from attnsel.render import dispatch_table

    table = build_table(with_ragged(), ["a", "b"])
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("a", "auto", [], table)}), "decode", 200))
    text = " ".join(console.export_text().split())
    assert "wins: a 4; ragged batches (longest row >= 2.5x the mean): 4 bucket(s), wins: b 4" in text
    cut = dataclasses.replace(table, ragged=dataclasses.replace(table.ragged, skipped=("ragged 64 (mean 1024)",)))
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("a", "auto", [], cut)}), "decode", 200))
    assert "4 bucket(s), 1 skipped for the time budget, wins: b 4" in " ".join(console.export_text().split())
    # every ragged bucket skipped for the budget: no sub-table, and the report says the uniform buckets serve
    cut = measured("decode", "eager", UNIFORM)
    cut["skipped"] = ["ragged 4 (mean 1024, max 3702)", "ragged 4 (mean 4096, max 14807)"]
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("a", "auto", [], build_table(cut, ["a", "b"]))}),
                                 "decode", 200))
    assert ("2 bucket(s) skipped for the time budget (2 of them ragged: no ragged table, ragged batches take the "
            "uniform buckets)") in " ".join(console.export_text().split())
    assert "│ ragged 16 (mean 4096) │ b │ 20.0 │ 1% │ 1.50x │ a │" in text


def test_the_bench_judges_its_ragged_cell_as_an_engine_plans_it():
    from attnsel import bench

    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cells = [s for s in bench.shapes(spec, "decode", quick=False) if s[0].startswith("ragged")]
    assert [len(shape) for _, _, shape, _ in cells] == [8, 48, 100]
    timed = {bucket_grid.ragged_key(lens) for _, lens in bucket_grid.ragged_decode_grid(spec, torch.device("cuda"))}
    for label, key, shape, _ in cells:
        assert key == (len(shape), -(-sum(shape) // len(shape)), max(shape))  # batch, mean context, longest row
        assert key[:2] not in timed  # judged on ragged batches the selection did not time
        assert max(shape) >= bucket_grid.RAGGED_SKEW * key[1]
    label, key, shape, _ = cells[0]
    sel = _selection({"decode": PhaseChoice("a", "auto", [], build_table(with_ragged(), ["a", "b"]))})
    row = [bench.Cell({}, "decode", label, "eager", n, us, 1.0, vs_best=us / 20.0) for n, us in (("a", 30.0),
                                                                                                 ("b", 20.0))]
    got = bench.compare(spec, "decode", "eager", label, key, row, ["a", "b"], sel)
    assert got["selected"] == "b" and got["selected_ratio"] == 1.0 and got["one_backend"] == "a"


def test_pruning_reads_the_uniform_coarse_grid_only(monkeypatch):
    """A candidate 2.5x behind on every uniform coarse bucket but close on a ragged one is pruned from the finer
    uniform buckets: pruning reads the uniform level-0 buckets only (the ragged buckets are level 0 too)."""
    seen = []

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        seen.append((shape, sorted(cands)))
        slow = 11.0 if isinstance(shape, list) else 25.0
        return {"us": {n: {"fast": 10.0, "slow": slow}[n] for n in cands}, "spread": {n: 0.0 for n in cands},
                "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    grid = [(0, (1, 16)), (0, (4, 16)), (0, [2, 30]), (1, (2, 16))]
    out = timing.measure(SPEC, "decode", ["fast", "slow"], torch.device("cpu"), "eager", reps=1, grid=grid)
    assert out["pruned"] == {"slow": 2.5} and seen[-1] == ((2, 16), ["fast"])
    assert [b.get("ragged", False) for b in out["buckets"]] == [False, False, True, False]


def test_a_wrong_longest_is_named_when_metadata_is_checked(monkeypatch):
    """With ATTNSEL_CHECK_METADATA=1, `longest` is held against seq_lens: a value below the real longest row (or
    above it) is refused, not used to pick a table silently."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:RECORDERS")
    monkeypatch.setenv("ATTNSEL_CHECK_METADATA", "1")
    data = with_ragged(uniform={k: {"rec_a": v["a"], "rec_b": v["b"]} for k, v in UNIFORM.items()},
                       ragged={k: {"rec_a": v["a"], "rec_b": v["b"]} for k, v in RAGGED.items()})
    sel = _selection({"decode": PhaseChoice("rec_a", "auto", [], build_table(data, ["rec_a", "rec_b"]))})
    page_table = torch.arange(512, dtype=torch.int32).view(4, 128)  # 4 rows x 128 pages of 16 tokens
    seq_lens = torch.tensor([2000, 100, 100, 100], dtype=torch.int32)
    Recorder.planned.clear()
    sel.plan_decode(page_table, seq_lens, max_seq_len=2048, context_tokens=2300, longest=2000)
    assert Recorder.planned == ["rec_b"]  # 2000 >= 2.5 x the mean of 575: ragged
    for wrong in (600, 1999, 2001):  # within max_seq_len and at least the mean (below it: refused from host ints)
        with pytest.raises(ValueError, match=rf"^longest={wrong} but the longest of seq_lens is 2000 \(row 0\); "
                                             r"allowed: longest = max\(seq_lens\)"):
            sel.plan_decode(page_table, seq_lens, max_seq_len=2048, context_tokens=2300, longest=wrong)


@pytest.mark.parametrize("features", [{}, {"softcap": 30.0}, {"sinks": True}, {"kv_dtype": "fp8_e4m3"}],
                         ids=["plain", "softcap", "sinks", "fp8"])
def test_ragged_buckets_leave_room_for_the_torch_copy_of_every_spec(features):
    """With softcap or sinks torch's decode gathers K and V in float32 (twice the query dtype's bytes), and an fp8
    cache is cast as it is gathered: what the real gather holds at its peak (K's result, then V's gathered rows and
    its result; measured on a small batch, per slot) together with the bucket's KV stays within half of free memory,
    as ragged_decode_grid promises."""
    from attnsel.backends import torch_sdpa

    cpu, cuda, gib = torch.device("cpu"), torch.device("cuda"), 1 << 30
    for q, kv, d in ((32, 8, 128), (16, 8, 256), (8, 1, 128)):
        spec = AttentionSpec(q, kv, d, "bf16", 16, **features)
        small = bucket_grid.ragged_decode_lens(8, 64)
        work = bucket_grid.make_ragged_decode_workload(spec, cpu, "", small)
        run = torch_sdpa.BACKEND.plan_decode(spec, *work.plan_args)
        calls, real = [], torch_sdpa.dequantised

        def recorded(rows, scale, dtype):
            out = real(rows, scale, dtype)
            calls.append((rows.nbytes if out.data_ptr() != rows.data_ptr() else 0, out.nbytes))
            return out

        torch_sdpa.dequantised = recorded
        try:
            run(*work.inputs, **bucket_grid.feature_inputs(spec, "decode", cpu))
        finally:
            torch_sdpa.dequantised = real
        (_, k_out), (v_rows, v_out) = calls
        per_slot = (k_out + v_rows + v_out) / (len(small) * max(small))
        assert per_slot <= bucket_grid.torch_decode_copy_bytes(spec, 1, 1)  # the grid's estimate covers it
        for free in (6 * gib, 12 * gib, 24 * gib, 48 * gib, 78 * gib):
            for _, lens in bucket_grid.ragged_decode_grid(spec, cuda, free_bytes=free):
                cache = bucket_grid.decode_bytes(spec, 1, sum(lens))
                assert cache + len(lens) * max(lens) * per_slot <= free / 2, (spec.describe(), free // gib,
                                                                              len(lens), sum(lens) // len(lens))


def test_graph_decode_times_each_batch_size_on_a_ragged_batch_too():
    """An engine replays a batch size's graph on every batch padded to it, ragged ones above all, and a plan made
    at capture cannot give a ragged batch's long rows the splits an eager plan would (engine_capture). So graph mode
    times each batch size on a ragged batch too, right after its uniform contexts (a budget that stops part-way
    leaves whole batch sizes out), and scores the batch size over both: a backend that wins the uniform contexts by
    a little and loses the ragged batch by much does not serve that batch size."""
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")  # the grids read no device
    order = bucket_grid.decode_timing_grid(spec, cuda, mode="graph", sms=132)
    for i, (_, shape) in enumerate(order):
        if isinstance(shape, list):  # a ragged batch: after every uniform bucket of its size, before the next size
            batch = len(shape)
            before = [s for _, s in order[:i] if isinstance(s, tuple) and s[0] == batch]
            after = [s for _, s in order[i + 1:] if isinstance(s, tuple) and s[0] == batch]
            assert before and not after, (batch, i)  # (the largest batches leave out contexts over the KV cap)
    eager = bucket_grid.decode_timing_grid(spec, cuda, mode="eager", sms=132)
    coarse_end = sum(1 for lvl, s in eager if lvl == 0 and isinstance(s, tuple))
    assert all(isinstance(s, list) for _, s in eager[coarse_end:coarse_end + 15])  # eager: after the coarse grid

    def bucket(key, us, ragged=False):
        return {"key": list(key), "label": str(key), "us": us, "spread": {}, **({"ragged": True} if ragged else {})}

    uniform = [bucket((32, c), {"triton": 90.0, "fa3": 100.0}) for c in bucket_grid.GRAPH_DECODE_CTX]
    measured = {"phase": "decode", "mode": "graph", "axes": ["batch", "context"], "grid_version": 0,
                "buckets": uniform + [bucket((32, 2048), {"triton": 200.0, "fa3": 100.0}, ragged=True)]}
    table = build_table(measured, ["triton", "fa3"])
    assert table.backend_for((32,)) == "fa3" and table.buckets[0].label == "batch 32 (ctx 256-16384, ragged mean 2048)"
    measured["buckets"] = uniform  # the uniform contexts alone pick triton
    assert build_table(measured, ["triton", "fa3"]).backend_for((32,)) == "triton"


def test_graph_ragged_batches_stay_where_only_torchs_copy_does_not_fit(monkeypatch):
    """torch's decode gathers every row to the longest (batch x longest, 3-13x a ragged batch's KV). Under CUDA
    graphs a ragged batch is part of its batch size's score, so where only that copy does not fit it is timed
    without torch, with the reason, rather than left out (which scored the batch size on uniform contexts alone:
    with 20 GiB free, 32/8 heads lost it from 181 rows up)."""
    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    cuda = torch.device("cuda")  # the grids read no device
    free = 20 << 30
    graph = {len(lens) for _, lens in bucket_grid.ragged_decode_grid(spec, cuda, free, "graph", sms=132)}
    assert {181, 256, 362} <= graph
    seen = {}

    def fake_bucket(cands, spec, phase, shape, device, mode, reps):
        seen[len(shape) if isinstance(shape, list) else tuple(shape)] = set(cands)
        return {"us": {n: 1.0 for n in cands}, "spread": {n: 0.0 for n in cands}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(timing, "_free_bytes", lambda device: free)
    monkeypatch.setattr(timing, "device_sms", lambda device: 132)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    out = timing.measure(spec, "decode", ["torch", "triton"], cuda, "graph")
    big = next(b for b in out["buckets"] if b.get("ragged") and b["key"][0] == 362)
    why = big["left_out"]["torch"]
    assert "half the free memory" in why and "GiB" in why and not big["errors"]  # not a failure: no worker fault
    assert seen[362] == {"triton"} and seen[(362, 256)] == {"torch", "triton"}
    assert seen[8] == {"torch", "triton"}  # a small ragged batch: torch's copy fits
    table = build_table(out, ["torch", "triton"])
    row = next(b for b in table.buckets if b.key == (362,))
    assert set(row.times_us) == {"triton"} and "ragged mean 2048" in row.label
    assert set(next(b for b in table.buckets if b.key == (8,)).times_us) == {"torch", "triton"}
    count, first = bucket_errors(out)["torch"]  # the report's reason for torch's missing times
    assert count == sum(1 for b in out["buckets"] if "left_out" in b) >= 3 and "half the free memory" in first


def _graph_measured(ragged_us: dict, ragged_errors: dict) -> dict:
    uniform = [{"key": [362, c], "label": f"362x{c}", "us": {"torch": 50.0, "triton": 100.0}, "spread": {},
                "errors": {}} for c in bucket_grid.GRAPH_DECODE_CTX]
    ragged = {"key": [362, 2048], "label": "ragged 362 (mean 2048, max 30000)", "ragged": True, "us": ragged_us,
              "spread": {}, "errors": ragged_errors,
              "left_out": {"torch": "not timed on this ragged batch: its copy ... would pass half the free memory"}}
    return {"phase": "decode", "mode": "graph", "axes": ["batch", "context"], "grid_version": 0,
            "buckets": uniform + [ragged], "skipped": [], "pruned": {}}


@pytest.mark.parametrize("case", ["others failed there", "the one timed there is not usable"])
def test_a_candidate_left_out_of_a_graph_ragged_batch_never_wins_its_batch_size(case):
    """torch is left out of a graph ragged batch where its copy does not fit: the batch size must not go to it on
    its uniform contexts alone, also when no other candidate has a time on that ragged batch (they failed there, or
    the one that has is not usable): the row without times was dropped and torch scored over the rest."""
    if case == "others failed there":
        measured, order, usable = _graph_measured({}, {"triton": "raised OutOfMemoryError: CUDA out of memory"}), \
            ["torch", "triton"], None
    else:
        measured, order, usable = _graph_measured({"fa3": 80.0}, {"triton": "raised RuntimeError: x"}), \
            ["torch", "triton", "fa3"], {"torch", "triton"}
    table = build_table(measured, order, usable)
    served = {b.key: b.backend for b in table.buckets} if table is not None else {}
    assert served.get((362,)) != "torch", served  # torch would gather 362 rows to the longest: not timed, not chosen
    count, first = bucket_errors(measured)["torch"]
    assert count == 1 and "half the free memory" in first


@pytest.mark.parametrize("failed", ["ragged", "uniform"])
def test_a_graph_shape_every_candidate_failed_leaves_no_winner_for_its_batch_size(failed):
    """Under graphs a batch size is served by one backend at every length, so a candidate must have a time on each
    of its shapes. Where every candidate failed one shape (the ragged batch, or one uniform context), that shape's
    row was dropped and the batch size scored on the others: a backend that raised on it served the batch size."""
    measured = _graph_measured({"torch": 40.0, "triton": 90.0}, {})
    del measured["buckets"][-1]["left_out"]
    bad = measured["buckets"][-1] if failed == "ragged" else measured["buckets"][1]
    bad["us"], bad["errors"] = {}, {"torch": "raised RuntimeError: x", "triton": "wrong output after the timed "
                                                                                 "graph runs: row 3"}
    assert build_table(measured, ["torch", "triton"]) is None
    measured["buckets"].insert(0, {"key": [1, 512], "label": "1x512", "us": {"torch": 5.0, "triton": 4.0},
                                   "spread": {}, "errors": {}})
    table = build_table(measured, ["torch", "triton"])
    assert [(b.key, b.backend) for b in table.buckets] == [((1,), "triton")]
