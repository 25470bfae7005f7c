"""The longest-first decode launch (ORDER_ROWS forced True) on faults: a NaN in one live row's keys stays in that row
(the reordering hands no row another's programs or partials), and rows whose length drops to 0 between runs of one
plan give 0 while the others stay right, merged in the kernel or by the reduce."""
import pytest
import torch

import attnsel.backends.triton as tb
from attnsel.spec import AttentionSpec
from tests.fixtures.feature_cases import decode_case
from tests.test_triton_decode_order import CPU, _check_rows, _plan, _reference

LENS = [3, 70, 600, 1, 45, 130, 17, 2, 300]


@pytest.mark.parametrize("splits,merge", [(1, False), (4, True), (4, False)],
                         ids=["single", "split-merge", "split-reduce"])
@pytest.mark.parametrize("bad_row", [2, 4])  # the longest row (first in the order) and a middle one
def test_nan_key_of_one_row_stays_in_it(splits, merge, bad_row, monkeypatch):
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", merge)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 16))
    case = decode_case(spec, CPU, LENS)
    table, lens = case.plan_args
    k_cache = case.inputs[1].clone()
    tok = LENS[bad_row] - 1  # a live token of the row, KV head 1 only
    k_cache[table[bad_row, tok // spec.page_size], tok % spec.page_size, 1, 5] = float("nan")
    out = _plan(spec, table, lens, True)(case.inputs[0], k_cache, case.inputs[2], **case.kwargs)
    group = spec.num_q_heads // spec.num_kv_heads
    assert torch.isnan(out[bad_row, group:2 * group]).all()  # KV head 1's query heads
    assert torch.isfinite(out[bad_row, :group]).all()  # KV head 0 does not see it
    ref = _reference(spec, case, LENS)
    rest = [b for b in range(len(LENS)) if b != bad_row]
    _check_rows(spec, case, out[rest], ref[rest])
    unordered = _plan(spec, table, lens, False)(case.inputs[0], k_cache, case.inputs[2], **case.kwargs)
    assert torch.equal(out.nan_to_num(7.0), unordered.nan_to_num(7.0))


@pytest.mark.parametrize("splits,merge", [(1, False), (4, True), (4, False)],
                         ids=["single", "split-merge", "split-reduce"])
def test_rows_dropping_to_zero_between_runs(splits, merge, monkeypatch):
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", merge)
    monkeypatch.setattr(tb, "decode_splits", lambda *a, **k: (splits, 2**30, 16))
    case = decode_case(spec, CPU, LENS)
    table, lens = case.plan_args
    run = _plan(spec, table, lens, True)
    steps = [LENS, [0, 70, 0, 1, 45, 0, 17, 2, 300], [0] * len(LENS), LENS]
    for step in steps:
        lens.copy_(torch.tensor(step))
        out = run(*case.inputs, **case.kwargs)
        ref = _reference(spec, case, step)
        for b, n in enumerate(step):
            if n == 0:
                assert out[b].abs().max().item() == 0, (step, b)
        _check_rows(spec, case, out, ref)
