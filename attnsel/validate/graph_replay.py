"""Can a backend serve under CUDA graphs: the graph contract, checked the way engines use it.

The contract (docs/ARCHITECTURE.md, "CUDA graphs"): an engine plans a batch outside capture, captures the run once
per batch size, and before each replay writes the new values into the same metadata tensors it planned with (decode:
``seq_lens`` and ``page_table``; prefill: ``cu_seqlens_q`` / ``cu_seqlens_k``, within the plan's ``max_seqlen``
bounds), the queries and the caches; then replays. Nothing is called between replays. A run captured in a graph
must therefore read the metadata's values at replay time, not values its plan copied on the host.

``check`` plans on the validation case through an engine's kind of tensors (the page table a column slice of a wider
one, as engines slice their block tables), captures the run, and replays it several times after in-place updates:
rows that cross pages, a row going from 0 tokens to some and another to 0, lengths moving between rows (prefill:
the sequences' lengths rotated within the plan's bounds). Every replay is judged like a validation output against
that step's own float32 reference. A backend that declares a phase stale under replay (``graph_stale_reason``) is
refused with its reason before anything is captured.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..backends import graph_stale_reason
from ..spec import AttentionSpec
from . import cases
from .timing import _first_line, capture

# capture(run, inputs) -> replay: the CUDA-graph capture (tests pass a fake that calls run again)
Capture = Callable[[Callable, tuple], Callable[[], torch.Tensor]]
EXTRA_COLUMNS = 4  # the engine's table is wider than the plan's view of it (a column slice)
MTP_QUERIES = 2  # queries per row in the extend phase's first replay (multi-token decode)
MAX_QUERIES = 3  # the most queries of a row in the later replays (speculative verify)


def cuda_capture(device: torch.device) -> Capture:
    def captured(run, inputs):
        graph, outs = capture(run, [inputs], device)

        def replay() -> torch.Tensor:
            outs[0].fill_(float("nan"))  # the replay must write the output, not leave an earlier replay's values
            graph.replay()
            torch.cuda.synchronize(device)
            return outs[0]

        replay.keep = (graph, run)  # the graph holds device pointers only: keep the plan alive with it
        return replay

    return captured


def decode_steps(spec: AttentionSpec, lens: list[int]) -> list[list[int]]:
    """Context lengths of the replays after the first: every row one page and a bit longer (the zero-length padding
    row gets tokens), then the lengths moved one row down, then the first row emptied and the longest grown."""
    grown = [n + spec.page_size + 3 for n in lens]
    moved = grown[-1:] + grown[:-1]
    longest = max(range(len(moved)), key=moved.__getitem__)
    last = [0 if b == 0 else n + (2 * spec.page_size if b == longest else 0) for b, n in enumerate(moved)]
    return [grown, moved, last]


def check(backend, spec: AttentionSpec, phase: str, device: torch.device, capture: Capture | None = None) -> dict:
    """{"graph_capture": "ok"} or {"graph_capture": reason} (the field validation results carry)."""
    stale = graph_stale_reason(backend, phase)
    if stale:
        return {"graph_capture": f"cannot serve CUDA-graph replays: {stale}"}
    capture = capture or cuda_capture(device)
    try:
        steps = {"prefill": _prefill, "decode": _decode, "extend": _extend}[phase](backend, spec, device, capture)
        for n, (label, case, replay) in enumerate(steps):
            out = replay()
            checked = cases.check_output(spec, case.judged(out), case)
            if checked["status"] != "valid":
                return {"graph_capture": f"wrong under CUDA graph replay ({label}, replay {n + 1}): "
                                         f"{checked['reason']}"}
    except Exception as exc:
        return {"graph_capture": f"CUDA graph capture or replay failed: {type(exc).__name__}: {_first_line(exc)}"}
    return {"graph_capture": "ok"}


def _decode(backend, spec: AttentionSpec, device: torch.device, capture: Capture):
    first = cases.decode_case(spec, device)
    step_cases = [cases.decode_case(spec, device, seed=10 + i, lengths=lens)
                  for i, lens in enumerate(decode_steps(spec, first.seq_lens.tolist()))]
    return _paged(backend, spec, device, capture, [first, *step_cases])


def _extend(backend, spec: AttentionSpec, device: torch.device, capture: Capture):
    """Multi-token decode and verify as engines capture them: first every row MTP_QUERIES queries (padding rows
    too), then each row 0 to MAX_QUERIES queries, moved between rows at every step (cu_seqlens_q rewritten in place
    within the plan's max_seqlen_q), the contexts moving as in decode's steps (rows crossing pages, a row going from
    0 tokens to some and back)."""
    lens = cases.decode_lengths(spec, device)[0]
    every = [cases.extend_case(spec, device, seed=20, lengths=([MTP_QUERIES] * len(lens),
                                                                [n if n == 0 else max(n, MTP_QUERIES) for n in lens]))]
    for i, step in enumerate(decode_steps(spec, lens)):
        q_lens = [(b + i + 1) % (MAX_QUERIES + 1) for b in range(len(step))]
        step = [n if n == 0 else max(n, q) for n, q in zip(step, q_lens)]
        every.append(cases.extend_case(spec, device, seed=21 + i, lengths=(q_lens, step)))
    return _paged(backend, spec, device, capture, every)


def _paged(backend, spec: AttentionSpec, device: torch.device, capture: Capture, every: list):
    """(label, case, replay) per step; the inputs of each step are written in place before its replay."""
    first = every[0]
    batch = len(first.seq_lens)
    width = max(c.page_table.shape[1] for c in every)
    pages = max(c.k_cache.shape[0] for c in every)
    table = torch.full((batch, width + EXTRA_COLUMNS), -1, dtype=torch.int32, device=device)
    view = table[:, :width]  # the plan's page table: a column slice, as engines pass their block tables
    seq_lens = torch.empty(batch, dtype=torch.int32, device=device)
    q = torch.empty((max(c.q.shape[0] for c in every), *first.q.shape[1:]), dtype=first.q.dtype, device=device)
    cu_q = first.cu_q.clone() if isinstance(first, cases.ExtendCase) else None
    nan_pages = torch.full((pages, *first.k_cache.shape[1:]), float("nan"), device=device).to(first.k_cache.dtype)
    k_cache, v_cache = nan_pages.clone(), nan_pages.clone()

    def write(case) -> None:
        table.fill_(-1)
        view[:, :case.page_table.shape[1]].copy_(case.page_table)
        seq_lens.copy_(case.seq_lens)
        q.fill_(float("nan"))  # rows past this step's queries: padding
        q[:case.q.shape[0]].copy_(case.q)
        if cu_q is not None:
            cu_q.copy_(case.cu_q)
        k_cache.copy_(nan_pages)  # pages no row of this step owns hold NaN
        v_cache.copy_(nan_pages)
        k_cache[:case.k_cache.shape[0]].copy_(case.k_cache)
        v_cache[:case.v_cache.shape[0]].copy_(case.v_cache)

    write(first)
    if isinstance(first, cases.ExtendCase):
        bound = max(max(c.max_len for c in every), width * spec.page_size)  # the engine's bound: its table's reach
        run = backend.plan_extend(spec, cu_q, view, seq_lens, max(c.max_q for c in every), bound)
    else:
        run = backend.plan_decode(spec, view, seq_lens)
    replay = capture(functools.partial(run, **cases.run_kwargs(spec, first)), (q, k_cache, v_cache))
    for case in every:
        write(case)
        yield f"{case.describe().split(' pages=')[0]}", case, replay


def _prefill(backend, spec: AttentionSpec, device: torch.device, capture: Capture):
    first = cases.prefill_case(spec, device)
    lq = (first.cu_q[1:] - first.cu_q[:-1]).tolist()
    lk = (first.cu_k[1:] - first.cu_k[:-1]).tolist()
    step_cases = [cases.prefill_case(spec, device, seed=10 + s, lengths=(lq[s:] + lq[:s], lk[s:] + lk[:s]))
                  for s in (1, 2)]
    cu_q, cu_k = first.cu_q.clone(), first.cu_k.clone()
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    run = backend.plan_prefill(spec, cu_q, cu_k, first.max_q, first.max_k)
    replay = capture(functools.partial(run, **cases.run_kwargs(spec, first)), (q, k, v))
    for case in (first, *step_cases):
        for mine, theirs in ((cu_q, case.cu_q), (cu_k, case.cu_k), (q, case.q), (k, case.k), (v, case.v)):
            mine.copy_(theirs)
        yield f"prefill q_lens {(case.cu_q[1:] - case.cu_q[:-1]).tolist()}", case, replay
