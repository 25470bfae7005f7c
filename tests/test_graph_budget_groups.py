"""Graph mode scores a batch size over all its timed shapes (its uniform contexts and its ragged batch): a time budget
that stops part-way through a batch size must not leave that batch size scored on part of them. No GPU: timings
are made by hand, the budget counts buckets."""
import pytest
import torch

import attnsel.backends as backends_mod
from attnsel.selection import build_table
from attnsel.spec import AttentionSpec
from attnsel.validate import grid as bucket_grid
from attnsel.validate import timing

SPEC = AttentionSpec(32, 8, 128, "bf16", 16)


def _measure(monkeypatch, budget_buckets: int, phase: str = "decode") -> dict:
    """timing.measure in graph mode, each bucket counted as one second of budget: triton 10% faster on uniform
    contexts, 2x slower on a ragged batch (plan-time splits made on one-token rows), fa3 even."""
    timed = []

    def fake_bucket(cands, spec, phase_, shape, device, mode, reps):
        timed.append(shape)
        ragged = isinstance(shape, list)
        us = {"triton": 200.0 if ragged else 90.0, "fa3": 100.0}
        return {"us": {n: us[n] for n in cands}, "spread": {n: 0.0 for n in cands}, "errors": {}}

    monkeypatch.setattr(timing, "time_bucket", fake_bucket)
    monkeypatch.setattr(timing, "_counted", lambda elapsed, steps, allowance: float(len(timed)))
    monkeypatch.setattr(timing, "_free_bytes", lambda device: None)
    monkeypatch.setattr(timing, "device_sms", lambda device: 132)
    monkeypatch.setattr(backends_mod, "get", lambda name: name)
    return timing.measure(SPEC, phase, ["triton", "fa3"], torch.device("cuda"), "graph",
                          budget_s=budget_buckets - 0.5)


def _group_sizes(phase: str) -> dict[int, int]:
    cuda = torch.device("cuda")
    if phase == "decode":
        items = bucket_grid.decode_timing_grid(SPEC, cuda, mode="graph", sms=132)
        batches = [len(s) if isinstance(s, list) else s[0] for _, s in items]
    else:
        from attnsel.validate.extend_grid import extend_grid
        batches = [s[0] for _, s in extend_grid(SPEC, cuda, mode="graph")]
    sizes: dict[int, int] = {}
    for b in batches:
        sizes[b] = sizes.get(b, 0) + 1
    return sizes


@pytest.mark.parametrize("cut", [15, 17])  # batch 4: 2 of its 4 contexts timed; its 4 contexts but not its ragged
def test_a_budget_cut_leaves_no_graph_batch_size_scored_on_part_of_its_shapes(monkeypatch, cut):
    order = [len(s) if isinstance(s, list) else s[0]
             for _, s in bucket_grid.decode_timing_grid(SPEC, torch.device("cuda"), mode="graph", sms=132)]
    assert order[:13] == [1] * 4 + [256] * 4 + [16] * 5 and order[13:18] == [4] * 5  # then batch 4, cut part-way
    out = _measure(monkeypatch, cut)
    table = build_table(out, ["triton", "fa3"])
    # every batch size above 1 was scored with its ragged batch: fa3 serves them (triton's uniform lead is 1.1x,
    # its ragged loss 2x)
    assert [(b.label, b.backend) for b in table.buckets if b.key[0] > 1 and "ragged mean" not in b.label] == []
    assert {b.backend for b in table.buckets if b.key[0] > 1} == {"fa3"}
    sizes = _group_sizes("decode")
    per_batch: dict[int, int] = {}
    for b in out["buckets"]:
        per_batch[b["key"][0]] = per_batch.get(b["key"][0], 0) + 1
    assert per_batch == {b: sizes[b] for b in per_batch}, per_batch  # whole batch sizes only
    assert 4 not in per_batch and any(label.startswith("4x") for label in out["skipped"])


def test_a_budget_that_cuts_the_first_batch_size_keeps_it(monkeypatch):
    """A coarser table, never none: the first batch size, cut part-way, is all there is."""
    out = _measure(monkeypatch, 2)
    assert [b["key"] for b in out["buckets"]] == [[1, 256], [1, 1024]]
    assert build_table(out, ["triton", "fa3"]).backend_for((1,)) == "triton"


def test_a_budget_cut_in_graph_extend_leaves_whole_batch_sizes(monkeypatch):
    sizes = _group_sizes("extend")
    first = next(iter(sizes))
    out = _measure(monkeypatch, sizes[first] + 1, phase="extend")  # the second batch size: one shape timed
    assert {b["key"][0] for b in out["buckets"]} == {first}
    assert len(out["buckets"]) == sizes[first]


def test_the_report_of_a_cut_graph_table_claims_no_ragged_sub_table(monkeypatch):
    """Graph tables never have a ragged sub-table (a ragged batch counts in its batch size): a skipped ragged
    bucket there is one of its batch size's shapes, not the eager sub-table gone."""
    from rich.console import Console

    from attnsel.render import dispatch_table
    from attnsel.selection import PhaseChoice
    from tests.fixtures.dispatch import _selection

    out = _measure(monkeypatch, 17)
    table = build_table(out, ["triton", "fa3"])
    assert any(x.startswith("ragged ") for x in table.skipped)
    console = Console(width=200, record=True)
    console.print(dispatch_table(_selection({"decode": PhaseChoice("fa3", "auto", [], table)}, mode="graph"),
                                 "decode", 200))
    text = " ".join(console.export_text().split())
    assert f"{len(table.skipped)} bucket(s) skipped for the time budget" in text
    assert "no ragged table" not in text and "uniform buckets" not in text
