"""A backend a dispatch table picks for a bucket fails at plan time: the error reaches the caller (no silent
fallback to another backend) and says which backend failed, for which phase and batch, and which bucket picked it:
with automatic dispatch the caller cannot know which backend it got."""
import logging

import pytest
import torch

from attnsel.dispatch import build_table
from attnsel.selection import PhaseChoice
from attnsel.validate.cases import cumulative
from tests.fixtures.dispatch import _selection, measured

CELLS = {(1, 256): {"flaky_a": 1.0, "flaky_b": 2.0}, (32, 256): {"flaky_a": 9.0, "flaky_b": 2.0}}


@pytest.fixture
def sel(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.plan_failures:PLANNERS")
    table = build_table(measured("decode", "eager", CELLS), ["flaky_a", "flaky_b"])
    pre = build_table(measured("prefill", "eager", {(1, 64, 64): {"flaky_a": 9.0, "flaky_b": 1.0}}),
                      ["flaky_a", "flaky_b"])
    return _selection({"decode": PhaseChoice("flaky_b", "auto", [], table),
                       "prefill": PhaseChoice("flaky_b", "auto", [], pre)})


def test_a_failing_plan_names_the_backend_phase_and_batch(sel, caplog):
    """The backend's RuntimeError ("workspace allocation failed") reaches the caller with its type, naming flaky_b
    (the table picked it), the phase and the batch's shape."""
    table = torch.zeros(40, 20, dtype=torch.int32)
    lens = torch.full((40,), 200, dtype=torch.int32)
    assert sel.plan_decode(table[:1], lens[:1], max_seq_len=200) is not None  # flaky_a's bucket plans
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="workspace allocation failed") as info:
        sel.plan_decode(table, lens, max_seq_len=200)
    text = "\n".join(getattr(info.value, "__notes__", []))
    assert "decode backend 'flaky_b'" in text and "40 rows, context 200" in text, text
    assert "not replaced" in text, text
    assert "flaky_b" in caplog.text and "40 rows, context 200" in caplog.text, caplog.text
    cu = cumulative([5, 7], "cpu")
    with pytest.raises(RuntimeError, match="workspace allocation failed") as info:
        sel.plan_prefill(cu, cu, 7, 7, 12)
    assert "prefill backend 'flaky_b'" in "\n".join(info.value.__notes__)
