"""Is it right: validation cases derived from the spec, the float32 reference, the tolerance, the pass/fail checks.

Reference, yardstick and tolerance (yardstick.py): each row of an output (a query token, all heads) passes when its
max abs error against the float32 reference is at most ``TOL_FACTOR x`` the error of a careful low-precision
computation on that row ``+ TOL_FLOOR[dtype]`` (no backend is involved, so every backend, torch included, is judged
by the same yardstick). NaN or inf in the output rejects outright, so does an input the backend changed. Across
candidates, ``outlier_reason`` also rejects an error far larger than the best valid candidate's (applied by the
selection layer).

The cases' inputs and traps: inputs.py; the paged-cache cases (decode, extend): paged_cases.py.
"""
from __future__ import annotations

import dataclasses

import torch

from ..backends import decode_takes_b1hd
from ..spec import AttentionSpec
from .inputs import _attention, _sequence, _sinks, cumulative
from .paged_cases import DecodeCase, ExtendCase, decode_case, decode_lengths, extend_case, extend_lengths
from .yardstick import TOL_FACTOR, TOL_FLOOR, reference_attention, row_errors, row_tolerance, worst_row

__all__ = ["PrefillCase", "DecodeCase", "ExtendCase", "prefill_case", "decode_case", "extend_case",
           "decode_lengths", "extend_lengths", "prefill_lengths", "cumulative", "reference_attention", "make_case",
           "single_case", "run_case", "run_kwargs", "check_output", "clear_output", "TOL_FLOOR"]



@dataclasses.dataclass
class PrefillCase:
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor  # float32
    yard_err: torch.Tensor  # float32 [rows]: the yardstick's error on each row (sets that row's tolerance)
    sinks: torch.Tensor | None = None  # float32 [num_q_heads] when spec.sinks
    changed_inputs: list[str] = dataclasses.field(default_factory=list)  # set by run_case
    rerun_diff: torch.Tensor | None = None  # set by run_case: each row's max abs difference between two runs
    layout_error: str | None = None  # decode cases only (set by run_case for a backend with decode_takes_b1hd)

    INPUTS = ("cu_q", "cu_k", "q", "k", "v", "sinks")

    def judged(self, out):
        """The rows of an output that are judged: all of them."""
        return out

    def describe(self) -> str:
        lq = (self.cu_q[1:] - self.cu_q[:-1]).tolist()
        lk = (self.cu_k[1:] - self.cu_k[:-1]).tolist()
        return f"prefill q_lens={lq} k_lens={lk}"

    def sequence_of_row(self, row: int) -> str:
        cq = self.cu_q.tolist()
        b = next(i for i in range(len(cq) - 1) if cq[i] <= row < cq[i + 1])
        lk = int(self.cu_k[b + 1] - self.cu_k[b])
        return f"sequence {b} (q_len {cq[b + 1] - cq[b]}, k_len {lk})"

    def row_label(self, row: int) -> str:
        cq = self.cu_q.tolist()
        b = next(i for i in range(len(cq) - 1) if cq[i] <= row < cq[i + 1])
        lq, lk = cq[b + 1] - cq[b], int(self.cu_k[b + 1] - self.cu_k[b])
        return f"{self.sequence_of_row(row)}, query {row - cq[b]} at position {lk - lq + row - cq[b]} (row {row})"


Case = PrefillCase | DecodeCase | ExtendCase


def prefill_lengths(spec: AttentionSpec, device: torch.device) -> tuple[list[int], list[int], int]:
    """(query lengths, key lengths, number of window-boundary sequences at the end).

    Ragged lengths with 1, a prime, non-multiples of every block size, one long sequence, and one sequence whose
    queries are the last tokens of a longer key range (chunked prefill / prefix cache). With a sliding window w,
    boundary sequences of w - 1 and w keys (the window covers them) and w + 6 (the window cuts), their queries capped
    so that the case stays small when w is large."""
    if device.type == "cuda":
        q, k, cap = [1, 13, 97, 1031, 61], [1, 13, 97, 1031, 263], 600
    else:
        q, k, cap = [1, 7, 37, 83, 5], [1, 7, 37, 83, 40], 48
    w = spec.sliding_window
    boundary = [n for n in (w - 1, w, w + 6) if n >= 1] if w is not None else []
    return q + [min(n, cap) for n in boundary], k + boundary, len(boundary)


def prefill_case(spec: AttentionSpec, device: torch.device, seed: int = 0,
                 lengths: tuple[list[int], list[int]] | None = None) -> PrefillCase:
    """The ragged prefill case (prefill_lengths), or the given (query lengths, key lengths) without boundary traps."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lq, lk, boundary = prefill_lengths(spec, device) if lengths is None else (*lengths, 0)
    dt = spec.torch_dtype
    seqs = [_sequence(spec, gen, a, b, i >= len(lq) - boundary, dt, None)
            for i, (a, b) in enumerate(zip(lq, lk))]
    q, k, v = (torch.cat([s[i] for s in seqs]).to(device) for i in range(3))
    sinks = _sinks(spec)
    sinks = sinks.to(device) if sinks is not None else None
    cu_q, cu_k = cumulative(lq, device), cumulative(lk, device)
    ref = torch.empty(q.shape, dtype=torch.float32, device=device)
    low = torch.empty(q.shape, dtype=torch.float32, device=device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lq)):
        args = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], sinks
        ref[cq[i]:cq[i + 1]], low[cq[i]:cq[i + 1]] = _attention(spec, *args)
    return PrefillCase(cu_q, cu_k, max(lq), max(lk), q, k, v, ref, row_errors(low, ref), sinks)


def make_case(spec: AttentionSpec, phase: str, device: torch.device) -> Case:
    return {"prefill": prefill_case, "decode": decode_case, "extend": extend_case}[phase](spec, device)


def single_case(spec: AttentionSpec, phase: str, device: torch.device) -> Case:
    """A batch of one sequence, the other path of many kernels (split counts, grids and schedulers are sized by the
    batch): prefill, one long prompt; decode, one long context (the most KV splits); extend, one chunk over a long
    prefix. Checked after the ragged case."""
    if phase == "prefill":
        n = 1031 if device.type == "cuda" else 83
        return prefill_case(spec, device, seed=2, lengths=([n], [n]))
    if phase == "extend":
        q, n = (257, 4099) if device.type == "cuda" else (13, 157)
        return extend_case(spec, device, seed=5, lengths=([q], [n]))
    return decode_case(spec, device, seed=3, lengths=[4099 if device.type == "cuda" else 157])


def run_kwargs(spec: AttentionSpec, case: Case) -> dict:
    """The run-time feature inputs, passed only when the spec has the feature (older plugins take none)."""
    kwargs = {}
    if spec.sinks:
        kwargs["sinks"] = case.sinks
    if spec.kv_dtype is not None and isinstance(case, (DecodeCase, ExtendCase)):
        kwargs.update(k_scale=case.k_scale, v_scale=case.v_scale)
    return kwargs


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    return {name: getattr(case, name) for name in case.INPUTS if getattr(case, name) is not None}


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN, -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        a, b = a.view(_INT_OF_SIZE[a.element_size()]), b.view(_INT_OF_SIZE[b.element_size()])
    return torch.equal(a, b)


def _row_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's (first dim) max abs difference, float32 ``[rows]``; equal values (NaN with NaN, inf with inf
    included) count 0, NaN against a number inf."""
    if not a.numel():
        return torch.zeros(a.shape[0], device=a.device)
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    inf = float("inf")
    return torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=inf, posinf=inf)).reshape(a.shape[0], -1).amax(1)


def clear_output(out, inputs) -> None:
    """Fill a run's floating-point output with NaN (unless it is one of the inputs), so that a later run of the plan
    that writes nothing, or hands back this memory, shows as NaN instead of a stale right answer."""
    if (isinstance(out, torch.Tensor) and out.is_floating_point()
            and all(out.data_ptr() != t.data_ptr() for t in inputs)):
        out.fill_(float("nan"))


def run_case(backend, spec: AttentionSpec, case: Case) -> torch.Tensor:
    """Plan one backend on a validation case and run the plan twice; returns the second output.

    Engines plan once per batch and run every layer with that plan, so a run function must be reusable: the two
    outputs' max abs difference is left in ``case.rerun_diff`` and ``check_output`` rejects a difference above the
    tolerance (state a kernel leaves behind, like a scheduler counter that is not reset, shows here). The first
    output is filled with NaN before the second run, so a second run that skips its work and hands back the first
    run's buffer (or the same memory) returns NaN, not a stale right answer.
    Every input is copied first and compared bit for bit afterwards (also when the backend raises): inputs the
    backend changed are restored, so the next candidate gets the case intact, and their names are left in
    ``case.changed_inputs``, which makes ``check_output`` reject this output.
    """
    originals = {name: t.clone() for name, t in _inputs(case).items()}
    case.changed_inputs, case.rerun_diff, case.layout_error = [], None, None
    try:
        if isinstance(case, PrefillCase):
            run = backend.plan_prefill(spec, case.cu_q, case.cu_k, case.max_q, case.max_k)
            inputs = (case.q, case.k, case.v)
        else:
            run = case.plan(backend, spec)
            inputs = (case.q, case.k_cache, case.v_cache)
        out = run(*inputs, **run_kwargs(spec, case))
        first = case.judged(out).clone() if isinstance(out, torch.Tensor) else out
        clear_output(out, _inputs(case).values())  # `out` is held until the second run returns
        second = case.judged(run(*inputs, **run_kwargs(spec, case)))
        if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and (
                first.shape == second.shape == case.ref.shape):
            case.rerun_diff = _row_difference(first, second)
        if isinstance(case, DecodeCase) and decode_takes_b1hd(backend) and isinstance(second, torch.Tensor):
            # a third run with q [B, 1, H, D], as attnsel.flash_attn_with_kvcache calls it: second is kept as a copy
            # and NaN-filled, so that a run that writes nothing in this layout shows as NaN
            kept = second.clone()
            clear_output(second, _inputs(case).values())
            try:
                out4 = run(case.q.unsqueeze(1), case.k_cache, case.v_cache, **run_kwargs(spec, case))
                case.layout_error = _b1hd_error(out4, kept, case, row_tolerance(spec, case.yard_err))
            except Exception as exc:
                case.layout_error = (f"declares decode_takes_b1hd but its run with q [B, 1, H, D] raised "
                                     f"{type(exc).__name__}: {exc}")
            second = kept
        return second
    finally:
        for name, original in originals.items():
            current = getattr(case, name)
            if not _same_bits(current, original):
                case.changed_inputs.append(name)
                if current.shape == original.shape and current.dtype == original.dtype:
                    current.copy_(original)
                else:  # resized or replaced in place: put a fresh copy back
                    setattr(case, name, original)


def _b1hd_error(out4, out3: torch.Tensor, case: DecodeCase, tol: torch.Tensor) -> str | None:
    """Why a decode run that declares ``decode_takes_b1hd`` fails that contract for q ``[B, 1, H, D]`` (its out
    must be ``[B, 1, H, D]`` in the same dtype and, row by row, within the validation tolerance of the ``[B, H, D]``
    run's out, as two runs of one plan must be; NaN where the other has a number counts as a difference), or None."""
    ref_shape = tuple(case.ref.shape)
    want = (ref_shape[0], 1, *ref_shape[1:])
    if not isinstance(out4, torch.Tensor) or tuple(out4.shape) != want:
        got = tuple(out4.shape) if isinstance(out4, torch.Tensor) else type(out4).__name__
        return f"declares decode_takes_b1hd but returned {got} for q [B, 1, H, D], expected {want}"
    if out4.dtype != out3.dtype:
        return f"declares decode_takes_b1hd but returned {out4.dtype} for q [B, 1, H, D], expected {out3.dtype}"
    if out3.shape != case.ref.shape:
        return None  # check_output rejects the shape
    diff = _row_difference(out4[:, 0], out3)
    if (beyond := _beyond(diff, tol, case)) is None:
        return None
    r, where = beyond
    return (f"declares decode_takes_b1hd but its out for q [B, 1, H, D] differs from its out for q [B, H, D] "
            f"by {float(diff[r]):.3g} (max abs) in {where}, over that row's tolerance {float(tol[r]):.3g}")


def _beyond(err: torch.Tensor, tol: torch.Tensor, case: Case) -> tuple[int, str] | None:
    """(row furthest beyond its tolerance, its label with how many other rows are beyond theirs), or None when every
    row is within its tolerance."""
    over = int((~(err <= tol)).sum())
    if not over:
        return None
    r = worst_row(err, tol)
    return r, case.row_label(r) + (f" (and {over - 1} more rows)" if over > 1 else "")


def check_output(spec: AttentionSpec, out, case: Case) -> dict:
    """Compare one output with the case's reference, row by row against each row's tolerance; the fields of a
    result: status, reason, max_abs_err (the whole case's), tolerance and yardstick_err (of the row that decides:
    the row of max_abs_err when valid, the row furthest beyond its tolerance when rejected)."""
    if case.changed_inputs:
        return {"status": "rejected", "reason": f"the backend changed its input(s) {', '.join(case.changed_inputs)} "
                                                f"during plan/run (inputs must be left unchanged; {case.describe()})"}
    tol = row_tolerance(spec, case.yard_err)
    if case.rerun_diff is not None and (beyond := _beyond(case.rerun_diff, tol, case)):
        r, where = beyond
        return {"status": "rejected", "reason": f"a second run of the same plan differs from the first by "
                                                f"{float(case.rerun_diff[r]):.3g} (max abs) in {where}, over that "
                                                f"row's tolerance {float(tol[r]):.3g}: a plan must give the same "
                                                f"answer on every run ({case.describe()})"}
    if not isinstance(out, torch.Tensor) or out.shape != case.ref.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"status": "rejected", "reason": f"output shape {got}, expected {tuple(case.ref.shape)}"}
    if out.dtype != spec.torch_dtype:
        return {"status": "rejected", "reason": f"output dtype {out.dtype}, expected {spec.torch_dtype}"}
    if case.layout_error:
        return {"status": "rejected", "reason": f"{case.layout_error} ({case.describe()})"}
    finite = torch.isfinite(out.float()).flatten(1).all(1)
    if not finite.all():
        rows = (~finite).nonzero().flatten().tolist()
        bad = (~torch.isfinite(out.float())).sum().item()
        where = ", ".join(case.sequence_of_row(r) for r in _first_rows(rows, case))
        return {"status": "rejected", "max_abs_err": None, "tolerance": None,
                "reason": f"{bad} of {out.numel()} output values are NaN or inf, in {where} ({case.describe()})"}
    err = row_errors(out, case.ref)
    if not err.numel():
        return {"status": "valid", "reason": "", "max_abs_err": 0.0, "tolerance": TOL_FLOOR[spec.dtype]}
    beyond = _beyond(err, tol, case)
    r = beyond[0] if beyond else int(err.argmax())
    result = {"max_abs_err": float(err.max()), "tolerance": float(tol[r]), "yardstick_err": float(case.yard_err[r])}
    if beyond:
        return {**result, "status": "rejected",
                "reason": f"max abs error {float(err[r]):.3g} exceeds tolerance {float(tol[r]):.3g} in {beyond[1]} "
                          f"(a row's tolerance: {TOL_FACTOR:g} x the error of a careful {spec.dtype} computation on "
                          f"that row, {float(case.yard_err[r]):.3g} there, + {TOL_FLOOR[spec.dtype]:g}; "
                          f"{case.describe()})"}
    return {**result, "status": "valid", "reason": ""}


def _first_rows(rows: list[int], case: Case, limit: int = 3) -> list[int]:
    """The first rows of distinct sequences (prefill rows are tokens), at most ``limit``."""
    seen, picked = set(), []
    for r in rows:
        label = case.sequence_of_row(r)
        if label not in seen:
            seen.add(label)
            picked.append(r)
        if len(picked) == limit:
            break
    return picked
