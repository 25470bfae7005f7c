"""Triton decode and multi-token decode planned on rows of one length (a CUDA graph's dummy lengths), with the split
room decode_splits keeps for a ragged replay (up to 64 splits, most of which a replay's rows leave empty), then run
on ragged lengths written into the planned tensors in place, as a replay reads them. Interpreted on the CPU with an
H100's SM count passed to the real decode_splits, so that the plan takes its GPU split counts; numbers against the
float32 reference of tests/fixtures/feature_cases.py."""

import pytest
import torch

import attnsel.backends.triton as tb
from attnsel.backends import get
from attnsel.spec import AttentionSpec
from tests.fixtures.feature_cases import decode_case, reference

CPU = torch.device("cpu")
SLOW = pytest.mark.slow
TOL = {"fp16": 2e-3, "bf16": 1.6e-2}
RAGGED = [0, 3, 600, 1, 0, 45, 130, 2]  # one long row among short and zero-length ones


def _gpu_splits(monkeypatch, seen):
    real = tb.decode_splits

    def as_on_an_h100(batch, kv_heads, max_len, total_len, block_n, sms, **kw):
        got = real(batch, kv_heads, max_len, total_len, block_n, 132 if sms is None else sms, **kw)
        seen.append(got[0])
        return got

    monkeypatch.setattr(tb, "decode_splits", as_on_an_h100)


def _merge_launches(monkeypatch, counts):
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: (counts.append(1) or real_zeros(*a, **kw))
                        if kw.get("dtype") == torch.int32 else real_zeros(*a, **kw))


SPECS = {
    "plain": dict(),
    "window-sinks-softcap": dict(sliding_window=40, sinks=True, softcap=5.0),
    "fp8": dict(dtype="bf16", kv_dtype="fp8_e4m3"),
    "d256": dict(head_dim=256),
}


FAST = {("window-sinks-softcap", "merge"), ("d256", "merge"), ("fp8", "reduce"), ("plain", "capture")}


@pytest.mark.parametrize("name,how", [pytest.param(n, h, id=f"{n}-{h}", marks=() if (n, h) in FAST else SLOW)
                                      for n in SPECS for h in ("merge", "reduce", "capture")])
def test_decode_planned_on_uniform_rows_replayed_ragged(name, how, monkeypatch):
    """merge / reduce: planned eagerly on dummy rows of 16 tokens, run with the in-kernel merge (past the merge
    tile, head_dim 256 at 64 splits: the reduce kernel) or the reduce kernel; capture: planned and run as during
    capture (no host read, the page table's bound, the reduce kernel)."""
    from tests.fixtures.host_reads import planning_in_capture

    kw = dict(SPECS[name])
    dtype, head_dim = kw.pop("dtype", "fp16"), kw.pop("head_dim", 64)
    spec = AttentionSpec(8, 2, head_dim, dtype=dtype, page_size=16, **kw)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", how == "merge")
    seen, counts = [], []
    _gpu_splits(monkeypatch, seen)
    case = decode_case(spec, CPU, RAGGED, "nan_page")
    table, ragged = case.plan_args
    lens = torch.full_like(ragged, 16)  # the dummy lengths a graph is planned on
    with monkeypatch.context() as m:
        _merge_launches(m, counts)
        if how == "capture":
            with planning_in_capture(monkeypatch):
                run = get("triton").plan_decode(spec, table, lens)
        else:
            run = get("triton").plan_decode(spec, table, lens)
    assert seen == [64]  # room: 8 x the uniform count, at most 64
    assert bool(counts) is (how == "merge" and head_dim <= 128)  # 64 splits x head_dim 256: past the merge tile
    lens.copy_(ragged)  # the replay's lengths, written in place
    out = run(*case.inputs, **case.kwargs)
    assert torch.isfinite(out.float()).all()
    err = (out.float() - case.ref).abs().max().item()
    assert err <= case.tolerance(spec), (err, case.tolerance(spec))
    assert out[0].abs().max().item() == 0 and out[4].abs().max().item() == 0
    assert torch.equal(run(*case.inputs, **case.kwargs), out)  # the merge's counts are whole again


def test_decode_replay_with_every_row_empty(monkeypatch):
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16, sinks=True)
    _gpu_splits(monkeypatch, [])
    case = decode_case(spec, CPU, RAGGED)
    table, ragged = case.plan_args
    lens = torch.full_like(ragged, 16)
    run = get("triton").plan_decode(spec, table, lens)
    lens.zero_()
    out = run(*case.inputs, **case.kwargs)
    assert torch.equal(out, torch.zeros_like(out))


def _extend_case(spec, klens, qlens, seed=3):
    """Multi-token decode over a paged cache (NaN in unused slots): q, k_cache, v_cache, page_table, lens, cu_q and
    the float32 reference (each row's queries its last tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ps, kvh, d = spec.page_size, spec.num_kv_heads, spec.head_dim
    pages = [-(-n // ps) for n in klens]
    num_pages = sum(pages) + 1
    kv_dt = spec.kv_torch_dtype
    k_cache = torch.full((num_pages, ps, kvh, d), float("nan")).to(kv_dt)
    v_cache = torch.full((num_pages, ps, kvh, d), float("nan")).to(kv_dt)
    table = torch.full((len(klens), max(pages) + 1), num_pages - 1, dtype=torch.int32)
    q = torch.randn(sum(qlens), spec.num_q_heads, d, generator=gen).to(spec.torch_dtype)
    sinks = (torch.randn(spec.num_q_heads, generator=gen) * 2).float() if spec.sinks else None
    refs, used, row = [], 0, 0
    for b, (n, m) in enumerate(zip(klens, qlens)):
        k = torch.randn(n, kvh, d, generator=gen).to(kv_dt)
        v = torch.randn(n, kvh, d, generator=gen).to(kv_dt)
        for p in range(pages[b]):
            table[b, p] = used
            rows = slice(p * ps, min((p + 1) * ps, n))
            k_cache[used, :rows.stop - rows.start] = k[rows]
            v_cache[used, :rows.stop - rows.start] = v[rows]
            used += 1
        refs.append(reference(q[row:row + m], k, v, spec.scale, window=spec.sliding_window, softcap=spec.softcap,
                              sinks=sinks))
        row += m
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {"sinks": sinks} if spec.sinks else {}
    return (q, k_cache, v_cache), kwargs, table, torch.tensor(klens, dtype=torch.int32), cu, torch.cat(refs)


@pytest.mark.parametrize("features,merge", [
    pytest.param({}, True, id="plain-merge"), pytest.param({}, False, id="plain-reduce", marks=SLOW),
    pytest.param(dict(sliding_window=40, sinks=True, softcap=5.0), True, id="feats-merge", marks=SLOW),
    pytest.param(dict(sliding_window=40, sinks=True, softcap=5.0), False, id="feats-reduce")])
def test_multi_token_decode_planned_on_uniform_rows_replayed_ragged(features, merge, monkeypatch):
    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16, **features)
    monkeypatch.setattr(tb, "MERGE_IN_DECODE_KERNEL", merge)
    seen = []
    _gpu_splits(monkeypatch, seen)
    klens, qlens = [2, 500, 0, 7, 2, 90], [2, 2, 0, 2, 1, 2]
    inputs, kwargs, table, ragged, cu, ref = _extend_case(spec, klens, qlens)
    lens = torch.full_like(ragged, 2)  # planned on rows of two tokens, two queries each
    cu_plan = torch.arange(0, 2 * len(klens) + 1, 2, dtype=torch.int32)
    run = get("triton").plan_extend(spec, cu_plan, table, lens, 2, int(table.shape[1] * spec.page_size))
    assert not run.tiles.long and run.splits == seen[-1] and run.splits > 8
    lens.copy_(ragged)
    cu_plan.copy_(cu)  # fewer query rows on the replay
    out = run(*inputs, **kwargs)[:int(cu[-1])]
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref).abs().max().item() <= TOL["fp16"] * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("batch", [64, 256])
def test_split_room_holds_at_most_room_bytes_of_partials(monkeypatch, batch):
    """The room's partial outputs stay a captured plan's for as long as its graph: multi-token decode of 8 queries
    per row at 8 query heads over one KV head (head_dim 128) kept about 97 MB per plan at batch 64-256 (an engine
    holds one plan per captured batch size). The room now adds at most ROOM_BYTES; a plan's own need is unchanged."""
    seen, sizes = [], []
    _gpu_splits(monkeypatch, seen)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (sizes.append(torch.Size(a[0] if len(a) == 1 else a).numel())
                                                          if kw.get("dtype") == torch.float32 else None)
                        or real_empty(*a, **kw))
    spec = AttentionSpec(8, 1, 128, "bf16", page_size=16)
    queries = 8
    cu = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32)
    table = torch.arange(batch * 4, dtype=torch.int32).reshape(batch, 4)
    lens = torch.full((batch,), 40, dtype=torch.int32)  # rows of one length: the room applies
    run = get("triton").plan_extend(spec, cu, table, lens, queries, 40)
    partial_bytes = 4 * max(sizes, default=0)
    assert run.splits > 1 and partial_bytes <= tb.ROOM_BYTES, (run.splits, partial_bytes)
