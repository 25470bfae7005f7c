"""Adversarial findings: graph-mode scoring of a batch size whose ragged bucket nobody could serve, the Triton
extend plan's eager read of lengths that the page table cannot hold, and malformed left_out in a cached table."""
import itertools
import re

import pytest
import torch

from attnsel import AttentionSpec
from attnsel import backends
from attnsel.cache import ResultCache
from attnsel.selection import build_table
from attnsel.store import bucket_errors
from attnsel.validate import grid as bucket_grid


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


def _extend_batch(klens, qlens, page_size=16):
    pages = [-(-n // page_size) for n in klens]
    table = torch.zeros((len(klens), max(pages)), dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    cu = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    return cu, table, nxt


@pytest.mark.parametrize("bad,words", [(-5, "seq_lens[3] is -5"), (60, "seq_lens[3] is 60")])
def test_triton_extend_eager_plan_refuses_lengths_its_read_shows_wrong(bad, words):
    """The eager Triton extend plan reads the lengths on the host anyway (its split count): a negative length gave
    zeros silently, and one past the page table's reach (3 pages x 16 = 48 tokens) read the next row's page ids
    (silently wrong output). The read it already makes refuses both, naming the row."""
    spec = AttentionSpec(4, 2, 64, "fp16", 16)
    cu, table, pages = _extend_batch([2, 0, 7, 40, 1], [1, 0, 2, 4, 1])
    lens = torch.tensor([2, 0, 7, bad, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(words) + ".*allowed: 0"):
        backends.get("triton").plan_extend(spec, cu, table, lens, 4, 64)
