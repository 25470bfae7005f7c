"""Triton decode launched longest row first (kernels.paged_kernel's ORDERED, plan_decode's ORDER_ROWS), interpreted on
the CPU: numbers against a float32 reference gathered through the page table here, row by row, and bit for bit
against the unordered launch (the order changes which program runs when, not what any program computes)."""

import pytest
import torch

import attnsel.backends.triton as tb
from attnsel.backends import get
from attnsel.spec import AttentionSpec
from tests.fixtures.feature_cases import decode_case, reference

CPU = torch.device("cpu")
RAGGED = [3, 0, 600, 1, 45, 130, 17, 2, 300]  # a zero-length row, rows of 1 to 38 pages, one long row mid-batch
FEATURES = {"plain": dict(), "window-sinks-softcap": dict(sliding_window=40, sinks=True, softcap=5.0)}


def _reference(spec, case, lens, q=None):
    """float32 decode of every row at ``lens``, its keys read through the case's page table (shuffled pages)."""
    q = case.inputs[0] if q is None else q
    k_cache, v_cache = case.inputs[1:3]
    table = case.plan_args[0]
    sinks = case.kwargs.get("sinks")
    out = torch.empty(q.shape)
    for b, n in enumerate(lens):
        t = torch.arange(n)
        pages = table[b, t // spec.page_size].long()
        k, v = k_cache[pages, t % spec.page_size], v_cache[pages, t % spec.page_size]
        out[b] = reference(q[b:b + 1], k, v, spec.scale, causal=False, window=spec.sliding_window,
                           softcap=spec.softcap, sinks=sinks)[0]
    return out


def _check_rows(spec, case, out, ref):
    tol = case.tolerance(spec)
    assert torch.isfinite(out.float()).all()
    for b in range(out.shape[0]):
        err = (out[b].float() - ref[b]).abs().max().item()
        assert err <= tol, (b, err, tol)


def _plan(spec, table, lens, ordered):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tb, "ORDER_ROWS", ordered)
        run = get("triton").plan_decode(spec, table, lens)
    assert run.ordered is ordered
    return run


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("splits,merge", [(1, False), (4, True), (4, False)],
                         ids=["single", "split-merge", "split-reduce"])
def test_ordered_decode_matches_reference_and_unordered(features, splits, merge, monkeypatch):
    """Splits per row from the lengths (4 at most: the long rows take 4, the short ones fewer, row 0 none)."""
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16, **FEATURES[features])
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", merge)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 16))
    case = decode_case(spec, CPU, RAGGED)
    ordered = _plan(spec, *case.plan_args, True)
    assert ordered.splits == splits
    out = ordered(*case.inputs, **case.kwargs)
    _check_rows(spec, case, out, _reference(spec, case, RAGGED))
    assert out[1].abs().max().item() == 0  # the zero-length row
    unordered = _plan(spec, *case.plan_args, False)(*case.inputs, **case.kwargs)
    assert torch.equal(out, unordered)
    assert torch.equal(ordered(*case.inputs, **case.kwargs), out)  # the merge's counts are whole again


@pytest.mark.parametrize("name", ["fp16-g4-p16-single", "fp16-g4-p16-split-merge-w40-sinks",
                                  "bf16-g2-p4-split-reduce-softcap", "bf16-g1-p1-fp8-single"])
def test_ordered_decode_gives_the_stored_decode_bits(name, monkeypatch):
    """tests/fixtures/decode_outputs.pt (what the unordered kernel gives, test_triton_extend) from the ordered one."""
    from tests.test_triton_extend import DECODE_CASES, DECODE_LENS, FIXTURES

    spec, splits, merge = DECODE_CASES[name]
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", merge)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 1))
    case = decode_case(spec, CPU, DECODE_LENS, sentinel=-1)
    out = _plan(spec, *case.plan_args, True)(*case.inputs, **case.kwargs)
    assert torch.equal(out, torch.load(FIXTURES / "decode_outputs.pt")[name])


def _longest_first(lens):
    return sorted(range(len(lens)), key=lambda b: -lens[b])  # stable: ties in row order


@pytest.mark.parametrize("how", ["eager-int32", "captured-int64-copy"])
def test_order_follows_the_lengths_written_in_place(how, monkeypatch):
    """One plan, run on two sets of lengths written into the planned tensor in place (the CUDA-graph contract): each
    run sorts the lengths it reads (captured: the plan's int32 copy of int64 lengths, refreshed by the run), and
    each run's rows match their own reference. The longest row moves from row 2 to row 7."""
    from tests.fixtures.host_reads import planning_in_capture

    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16, sinks=True)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (3, 2**30, 16))
    cache_lens = [40, 9, 600, 1, 45, 130, 17, 300, 64]  # the cache holds every row's longest context
    second = [33, 0, 20, 1, 45, 2, 17, 290, 64]
    case = decode_case(spec, CPU, cache_lens)
    table, lens = case.plan_args
    if how == "captured-int64-copy":
        lens = torch.full(lens.shape, 16, dtype=torch.int64)  # a graph's dummy lengths, int64: the plan copies
        with planning_in_capture(monkeypatch):
            run = _plan(spec, table, lens, True)
    else:
        run = _plan(spec, table, lens, True)
    for step in (cache_lens, second):
        lens.copy_(torch.tensor(step))
        q = torch.randn(case.inputs[0].shape, generator=torch.Generator().manual_seed(len(step))).half()
        out = run(q, *case.inputs[1:], **case.kwargs)
        assert run.order.tolist() == _longest_first(step)
        _check_rows(spec, case, out, _reference(spec, case, step, q))


def test_kernel_takes_each_row_from_the_order(monkeypatch):
    """The programs read their rows from the order: an order that lists row 3 twice and row 5 never computes row 3
    and leaves row 5 as the output's allocation left it; the other rows are right."""
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (1, 2**30, 16))
    case = decode_case(spec, CPU, RAGGED)
    run = _plan(spec, *case.plan_args, True)
    rows = [2, 8, 5, 4, 6, 0, 3, 7, 1]
    rows[2] = 3  # row 5 never, row 3 twice

    def fake_sort(lens, *, descending, stable, out):
        out[1].copy_(torch.tensor(rows))
        return out

    monkeypatch.setattr(torch, "sort", fake_sort)
    monkeypatch.setattr(torch, "empty_like", lambda t: torch.full_like(t, 7.0))
    out = run(*case.inputs, **case.kwargs)
    assert torch.equal(out[5], torch.full_like(out[5], 7.0))
    ref = _reference(spec, case, RAGGED)
    _check_rows(spec, case, torch.cat([out[:5], out[6:]]), torch.cat([ref[:5], ref[6:]]))


def test_which_plans_are_ordered(monkeypatch):
    """Off by default (not yet timed on a GPU); the rule (ORDER_ROWS None): 2 rows or more with at least
    ORDER_MIN_PROGRAMS_PER_SM (row, KV head) pairs per SM, never under the interpreter; ORDER_ROWS forces it either
    way (one row: never); the unordered plan keeps its 3-D grid."""
    sms = 132
    need = tb.ORDER_MIN_PROGRAMS_PER_SM * sms
    assert tb.ORDER_ROWS is False and not tb.decode_ordered(4096, 8, sms)
    monkeypatch.setattr(tb, "ORDER_ROWS", None)
    assert tb.decode_ordered(need // 8, 8, sms) and not tb.decode_ordered(need // 8 - 1, 8, sms)
    assert not tb.decode_ordered(need, 1, None) and not tb.decode_ordered(1, 1024, sms)
    monkeypatch.setattr(tb, "ORDER_ROWS", True)
    assert tb.decode_ordered(2, 1, None) and not tb.decode_ordered(1, 8, None)
    monkeypatch.setattr(tb, "ORDER_ROWS", False)
    assert not tb.decode_ordered(4096, 8, sms)
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16)
    case = decode_case(spec, CPU, RAGGED)
    monkeypatch.setattr(tb, "ORDER_ROWS", None)
    run = get("triton").plan_decode(spec, *case.plan_args)
    assert not run.ordered and run.order is None


@pytest.mark.parametrize("room", [False, True], ids=["ragged-plan", "uniform-plan"])
def test_order_room_splits(room, monkeypatch):
    """ORDER_ROOM_SPLITS raises an ordered plan's splits only where the plan keeps room for a ragged replay (made on
    rows of one length); the replay's rows match their reference."""
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16)
    monkeypatch.setattr(tb, "ORDER_ROOM_SPLITS", 3)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", False)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (1, 2**30, 16))
    case = decode_case(spec, CPU, RAGGED)
    table, lens = case.plan_args
    planned = lens.clone() if not room else torch.full_like(lens, 16)
    run = _plan(spec, table, planned, True)
    assert run.splits == (3 if room else 1)
    planned.copy_(lens)
    _check_rows(spec, case, run(*case.inputs, **case.kwargs), _reference(spec, case, RAGGED))


def test_bench_script_builds_its_shapes():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "triton_order_bench.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 9 and lines[0].startswith("graph ragged 128 x 2048") and "rows 87" in lines[6]


def test_bench_script_reports_the_rules_choice_not_the_default():
    """The bench's "auto" column is what decode_ordered's rule (ORDER_ROWS None) would choose on the GPU, not the
    module's default, which is False until timed: with the default every shape would read "auto off". The dry run
    shows the rule's choice at an H100's 132 SMs (2 x 132 (row, KV head) pairs: every shape here, 87 x 8 the
    fewest)."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = root / "scripts" / "triton_order_bench.py"
    module_spec = importlib.util.spec_from_file_location("triton_order_bench", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    assert tb.ORDER_ROWS is False
    assert bench.rule_ordered(512, 8, 132) and not bench.rule_ordered(16, 8, 132)
    assert tb.ORDER_ROWS is False  # restored
    proc = subprocess.run([sys.executable, str(path), "--dry-run"], capture_output=True, text=True, timeout=120,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(line.endswith("auto on at 132 SMs") for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_split_plan_sums_every_row_of_a_batch_past_one_lens_block(ordered, monkeypatch):
    """The split plan sums the batch's lengths LENS_BLOCK rows at a time; over three blocks it gives the splits (and
    so the bits) of one block holding the whole batch, and the float32 reference's numbers row by row. The chunk is
    set so that the total decides the splits: a sum of the first block alone would split the long rows more."""
    spec = AttentionSpec(4, 2, 64, dtype="fp16", page_size=16)
    lens = [(37 * b) % 190 + 1 for b in range(40)]
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", True)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (4, 64, 16))
    case = decode_case(spec, CPU, lens)
    monkeypatch.setattr(tb, "LENS_BLOCK", 16)
    out = _plan(spec, *case.plan_args, ordered)(*case.inputs, **case.kwargs)
    _check_rows(spec, case, out, _reference(spec, case, lens))
    monkeypatch.setattr(tb, "LENS_BLOCK", 64)
    assert torch.equal(_plan(spec, *case.plan_args, ordered)(*case.inputs, **case.kwargs), out)
