"""Adversarial host ints of the extend path: ``longest`` at every entry (plan_extend, Selection.extend_backend_for,
DispatchTable.backend_for) and the FA-compatible calls' host bounds. A tensor where a host int goes would be read (a
device sync on the GPU); a value that contradicts the plan's other host ints is refused, naming what is allowed."""
import pytest
import torch

import attnsel
from attnsel.errors import InvalidArgument
from tests.test_flash_extend import D, Paged, _torch_everywhere  # noqa: F401 (the torch-everywhere fixture)
from tests.test_plan_extend import WHOLE_VS_SPLIT, _meta_plan, _select, recorders  # noqa: F401 (fixture)

BAD_LONGEST = [torch.tensor(12000), 12000.0, -5, True, "12000"]


@pytest.mark.parametrize("longest", BAD_LONGEST, ids=repr)
def test_every_lookup_refuses_a_longest_that_is_not_a_host_int(longest, monkeypatch, recorders):
    """extend_backend_for and the table's backend_for are public lookups: a tensor there is read (a sync), a
    string fails deep inside, a float, a bool or a negative number is taken as a context."""
    sel = _select(monkeypatch, WHOLE_VS_SPLIT)
    for lookup in (lambda: sel.extend_backend_for(32, 2, 1500, longest),
                   lambda: sel.dispatch["extend"].backend_for((32, 2, 1500), longest)):
        with pytest.raises(InvalidArgument, match=r"^longest: expected None or a non-negative Python int \(the "
                                                  r"batch's longest context, exact\), got "):
            lookup()


@pytest.mark.parametrize("longest, message", [
    (12001, r"^longest=12001 is more than max_seq_len=12000, which bounds every row's context; allowed: "
            r"longest <= max_seq_len$"),
    (10**6, r"^longest=1000000 is more than max_seq_len=12000, which bounds every row's context; allowed: "),
    (1000, r"^longest=1000 is less than the mean context 1500 \(context_tokens=48000 over 32 requests\); allowed: "
           r"longest >= context_tokens / requests \(the longest row holds at least the mean\)$"),
])
def test_plan_extend_refuses_a_longest_that_contradicts_the_bounds(longest, message, monkeypatch, recorders):
    sel = _select(monkeypatch, WHOLE_VS_SPLIT)
    with pytest.raises(InvalidArgument, match=message):
        _meta_plan(sel, 32, 1024, 2, 12000, total_q=64, context_tokens=32 * 1500, longest=longest)
    assert recorders == []
    _meta_plan(sel, 32, 1024, 2, 12000, total_q=64, context_tokens=32 * 1500, longest=12000)  # the edges hold
    _meta_plan(sel, 32, 1024, 2, 12000, total_q=64, context_tokens=32 * 1500, longest=1500)
    assert recorders == ["rec_b", "rec_a"]


def test_plan_extend_refuses_a_longest_past_the_page_tables_reach(monkeypatch, recorders):
    sel = _select(monkeypatch, WHOLE_VS_SPLIT)
    reach = 8 * sel.spec.page_size
    with pytest.raises(InvalidArgument, match=rf"^longest={reach + 1} is more than the page table's reach {reach} "
                                              rf"\(8 pages of {sel.spec.page_size}\), which bounds every row's "
                                              r"context; allowed: longest <= "):
        _meta_plan(sel, 2, 8, 2, total_q=4, longest=reach + 1)
    _meta_plan(sel, 2, 8, 2, total_q=4, longest=reach)
    _meta_plan(sel, 0, 8, 2, longest=0)  # no requests: harmless
    assert len(recorders) == 2


def test_check_metadata_holds_longest_to_seq_lens(monkeypatch, recorders):
    """ATTNSEL_CHECK_METADATA=1 reads seq_lens anyway: a longest that is not its maximum is refused, as decode's."""
    sel = _select(monkeypatch, WHOLE_VS_SPLIT)
    monkeypatch.setenv("ATTNSEL_CHECK_METADATA", "1")
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([20, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^longest=39 but the longest of seq_lens is 40 \(row 1\); allowed: "
                                         r"longest = max\(seq_lens\)"):
        sel.plan_extend(cu, table, lens, 2, 64, total_q=4, context_tokens=60, longest=39)
    sel.plan_extend(cu, table, lens, 2, 64, total_q=4, context_tokens=60, longest=40)


@pytest.mark.usefixtures("inproc_worker")
@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_flash_host_bounds_refuse_a_tensor(name):
    """operator.index reads a 0-dim integer tensor (a device sync on the GPU): a host bound must be a host int."""
    s = Paged(ctx=[9, 5, 50], qlen=[1, 5, 17], seed=1)
    q = torch.cat(s.q)
    with pytest.raises(InvalidArgument, match=rf"^attnsel\.flash_attn_\w+: {name} must be a non-negative Python "
                                              r"int \(.*\), got <tensor \(\) torch\.int64>$"):
        if name == "max_seqlen_q":
            attnsel.flash_attn_with_kvcache(q, s.kc, s.vc, page_table=s.table, cache_seqlens=s.ctx_lens(),
                                            cu_seqlens_q=s.cu_q, max_seqlen_q=torch.tensor(17), causal=True)
        else:
            attnsel.flash_attn_varlen_func(q, s.kc, s.vc, s.cu_q, None, 17, torch.tensor(50),
                                           seqused_k=s.ctx_lens(), page_table=s.table, causal=True,
                                           softmax_scale=D ** -0.5)
