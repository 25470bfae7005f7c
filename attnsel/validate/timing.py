"""How fast: the interleaved timing of a phase's candidates over its bucket grid (grid.py; eager launches or
CUDA-graph replays, inputs read from HBM), the graph-capture check, and the bandwidth probes that decode speeds are
compared with. Used by the worker (policy "measure") and `attnsel bench`.

Timing rules (what a number in a report means):
- Every timed call reads its inputs from HBM, not L2: each bucket allocates several input sets whose total is at
  least ``grid.ROTATE_L2`` times the device's L2 size and the calls go round-robin over them (one shared cursor for all
  candidates, so a candidate never reads what the previous one just pulled into L2).
- Candidates are interleaved: repetition r times every candidate once (in an order rotated each repetition) before
  repetition r + 1 starts; a bucket's number per candidate is the median over ``reps_for(mode)`` samples of the time
  per call (``REPS_EAGER`` in eager mode, ``REPS`` under CUDA graphs), and its spread is (max - min) / median of
  those samples. A sample lasts at least ``SAMPLE_S``: after one untrusted call, its number of calls grows (at least
  doubling) until a measured sample is that long (one cold call can be several times slower than a warm one).
- Eager host-bound calls are noisy: with 21 samples a candidate's ratio to the fastest stays within 5% between
  repeats, so eager buckets take 21; CUDA-graph replays vary by 1-3% and take 7 (see the results file). A
  candidate far behind needs no such precision: after ``RACE_AFTER`` eager samples each, one whose every sample is
  at least ``RACE_OUT`` times the leader's median takes no more (listed in the bucket's "raced"). The leader is the
  fastest so far whose output checks (race.py): one that is wrong or raises later races no one out. Samples of one
  repetition share the host's speed, so a slow host does not race anyone out; a raced candidate's time, the median
  of its samples, is scaled by how much the leader's median moved after them (a host slowing later must not make
  it look faster).
- Eager: the host's speed moves. Before each repetition a host probe (``host_probe``: launches of a one-element
  add) times the host; a bucket's ``host_us`` is the median of its probes, its ``host`` that over the phase's
  reference probe (the lower decile of its buckets' ``host_us``: one lucky bucket does not make the rest look slow),
  shown by the report. A slow host slows every host-bound candidate alike, so the winner rarely changes: slow-host
  buckets are recorded, not timed again (timing them again showed no gain and took budget from the grid; see the
  results file).
- Pruning: once the coarse grid (level 0) is timed, a candidate at least ``PRUNE`` times slower than the fastest in
  every coarse bucket is not timed on the finer levels (listed in "pruned" with its best ratio): it is unlikely to
  win there (an extrapolation from the coarse grid, not a check), and the finer grid then costs less. A finer
  bucket where a timed candidate fails is timed again with every candidate, so that a pruned one can serve it.
  Eager mode also prunes near each finer bucket: a candidate at least ``PRUNE`` times slower in every coarse bucket
  within ``NEAR`` on every axis, where those bracket the bucket on every axis (``near_coarse``), is not timed there
  (counted in "pruned_near"); FlashInfer's FA3 decode template wins the smallest batches and is 3-5x slower at
  hundreds of rows, where its samples would be the longest. Graph mode does not: a batch size is scored over all
  its contexts.
- Checked: after the timing, what the timed plan computes (eager: two more calls, the first one's output NaN-filled
  and held during the second; graph: outputs NaN-filled, one more replay, the first and last input set) is compared
  with the float32 reference on sampled rows (spot.spot_reference, once per bucket and set; the race's leader also
  at the race); a wrong candidate gets no time in that bucket, with the reason.
- Eager: a sample is m consecutive ``run`` calls (host launch cost included: an engine in eager mode pays it).
  Graph: one CUDA graph per candidate and bucket holds one call per input set, planned and captured on the
  lengths engines capture with, then given the bucket's (engine_capture); a sample is m replays. A candidate
  whose capture fails gets no time in that bucket, with the reason.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import statistics
import time
from typing import Callable

import torch

from ..spec import AttentionSpec
from . import TIMING_TASK, WRONG_OUTPUT  # noqa: F401 (timing.TIMING_TASK: the worker's and selector's name for it)
from .cases import clear_output
from .engine_capture import capture_args
from .spot import spot_compare, spot_reference
from ..backends import planner
from .extend_grid import EXTEND_AXES, extend_grid, extend_label
from .grid import (DECODE_AXES, PREFILL_AXES, decode_timing_grid, device_sms, feature_inputs, prefill_grid,
                   left_out, prefill_key, prefill_label, ragged_key, rotated_workloads, whole_batch_sizes)
from .grid import RAGGED_SKEW  # noqa: F401  dispatch.py reads it as timing.RAGGED_SKEW
from .host_probe import host_probe, host_reference
from .race import Race

log = logging.getLogger(__name__)
AXES = {"prefill": PREFILL_AXES, "decode": DECODE_AXES, "extend": EXTEND_AXES}

GRID_VERSION = 17  # part of the dispatch-table cache key: bump when the grid or the timing rules change
REPS = 7  # samples per candidate and bucket under CUDA graphs
REPS_EAGER = 21  # eager (host-bound calls are noisier): see the module doc
PRUNE = 1.3  # a candidate this much slower than the fastest in every coarse bucket skips the finer levels
NEAR = 4.0  # eager: a finer bucket's nearby coarse buckets lie within this factor on every axis (decode's and
# prefill's coarse step; extend's is 16-32x, so there few finer buckets are bracketed and pruned so)
SAMPLE_S = 1e-3  # a sample lasts at least this long (CUDA event resolution is ~0.5 us)
MAX_REPEAT = 10000  # units per sample at most
PLAN_ALLOWANCE_S = 30.0  # per phase: this much of the plans-and-first-calls step is not counted against the
# budget. The step holds first-use compiles (Triton compiling on an empty kernel cache) and, under CUDA graphs, the
# captures, inside which Triton compiles its graph variants: a cost of a machine's first selections, not of timing,
# which would otherwise take a large share of a cold selection's buckets (see the results file).
PLAN_ALLOWANCE_SHARE = 0.8  # the allowance is at most this share of the most a phase's budget may be (half the
# worker's task timeout): a phase, budget plus allowance, ends within 0.9 of the timeout
CPU_REPS = 3
RACE_AFTER = 7  # eager: after this many samples a candidate far behind is not sampled further (module doc)
RACE_OUT = PRUNE  # far behind: each of its samples at least this many times the leader's median


def reps_for(mode: str, device: torch.device) -> int:
    """Samples per candidate and bucket (module doc)."""
    if device.type != "cuda":
        return CPU_REPS
    return REPS_EAGER if mode == "eager" else REPS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(fn, device: torch.device, target_s: float = 0.02, reps: int = 5) -> float:
    """Median seconds per call of fn, timed with CUDA events (host clock on CPU), after a warm-up. fn's inputs are
    the caller's: for HBM-resident numbers use ``measure`` (it rotates input sets)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    n = max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def capture(run, sets: list[tuple], device: torch.device) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """One CUDA graph holding run(*s) for every input set s (after a warm-up call outside capture); returns the
    graph and the outputs it writes. Raises what the capture raises. The caller keeps ``run`` (and so the buffers
    its plan allocated) alive as long as the graph: the graph holds device pointers only."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(*sets[0])  # warm-up outside capture (lazy init, autotuning)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [run(*s) for s in sets]
    return graph, outs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


@dataclasses.dataclass
class _Timed:
    """One candidate prepared for one bucket: unit() runs `calls` calls (eager: from the shared cursor); outputs()
    gives (input set index, output) pairs to check once the timing is done. plan: the run function, kept alive as
    long as its graph (a CUDA graph holds device pointers, not Python references: a plan freed while its graph is
    replayed lets the graph write into memory the allocator has handed to someone else)."""

    unit: Callable[[int], None]
    calls: int
    outputs: Callable[[], list[tuple[int, torch.Tensor]]]
    plan: Callable
    repeat: int = 1


def _prepare(backend, spec: AttentionSpec, phase: str, plan_args: tuple, sets: list[tuple], mode: str,
             device: torch.device) -> _Timed:
    plan = planner(backend, phase)
    if mode == "graph":  # planned and captured on the lengths engines capture with, replayed on the bucket's
        plan_args, fill = capture_args(phase, plan_args)
    run = functools.partial(plan(spec, *plan_args), **feature_inputs(spec, phase, device))
    if mode == "graph":
        graph, outs = capture(run, sets, device)
        fill()

        def replayed() -> list[tuple[int, torch.Tensor]]:
            """After the timed replays: NaN into the outputs, one more replay; the first and last set's outputs (the
            last only when the plan writes every call into one buffer)."""
            for out in outs:
                out.fill_(float("nan"))
            graph.replay()
            last = len(outs) - 1
            return [(last, outs[last])] if outs[0].data_ptr() == outs[last].data_ptr() else [(0, outs[0]),
                                                                                             (last, outs[last])]

        return _Timed(lambda cursor: graph.replay(), len(sets), replayed, run)
    count = len(sets)

    def unit(cursor: int) -> None:
        run(*sets[cursor % count])

    def called_again() -> list[tuple[int, torch.Tensor]]:
        """After the timing: one call, its output NaN-filled and held, then the call that is checked (a run that skips
        its work would hand back the first call's memory)."""
        held = run(*sets[-1])
        clear_output(held, sets[-1])
        out = run(*sets[-1])  # computed while `held` is alive: it cannot reuse held's memory
        return [(count - 1, out)]

    unit(0)  # warm-up (lazy initialisation, first-call autotuning)
    return _Timed(unit, 1, called_again, run)


def _sample(item: _Timed, cursor: int, device: torch.device) -> float:
    """Seconds per call of item.repeat units starting at cursor."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(item.repeat):
            item.unit(cursor + i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / (item.repeat * item.calls)
    t0 = time.perf_counter()
    for i in range(item.repeat):
        item.unit(cursor + i)
    return (time.perf_counter() - t0) / (item.repeat * item.calls)


def _calibrate(item: _Timed, cursor: int, device: torch.device) -> int:
    """Set item.repeat so that a sample lasts at least SAMPLE_S (CUDA), growing it until a measured sample does;
    returns the cursor after the calibration samples. The first sample (one call, possibly cold after the other
    candidates ran) is not trusted. On CPU one sample only checks that the candidate runs."""
    item.repeat = 1
    _sample(item, cursor, device)
    cursor += 1
    if device.type != "cuda":
        return cursor
    while True:
        seconds = _sample(item, cursor, device) * item.repeat * item.calls
        cursor += item.repeat
        if seconds >= SAMPLE_S or item.repeat >= MAX_REPEAT:
            return cursor
        item.repeat = min(MAX_REPEAT, max(2 * item.repeat, math.ceil(item.repeat * SAMPLE_S / max(seconds, 1e-9))))


def time_bucket(backends_: dict, spec: AttentionSpec, phase: str, shape, device: torch.device, mode: str,
                reps: int) -> dict:
    """Time every candidate on one bucket, interleaved. Returns {"us": {name: median us per call},
    "spread": {name: (max - min) / median}, "errors": {name: reason}, "host_us": the median host probe (eager on
    CUDA; else None), "wall_s": {step: seconds}}: where the bucket's time went (inputs, plans and first runs,
    calibration, samples, output checks; summed per phase by measure, so that a report can say what a selection's
    timing cost), "raced": [timed candidates sampled RACE_AFTER times only (race.py)] where any."""
    wall = {}
    t_step = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal t_step
        now = time.perf_counter()
        wall[step] = wall.get(step, 0.0) + now - t_step
        t_step = now

    plan_args, sets = rotated_workloads(spec, phase, shape, device)
    lap("inputs")
    prepared: dict[str, _Timed] = {}
    errors: dict[str, str] = {}
    for name, backend in backends_.items():
        try:
            prepared[name] = _prepare(backend, spec, phase, plan_args, sets, mode, device)
            _sync(device)
        except Exception as exc:
            what = "CUDA graph capture" if mode == "graph" else "plan or first run"
            errors[name] = f"{what} failed: {type(exc).__name__}: {_first_line(exc)}"
    lap("plans")
    cursor = 0
    for name, item in list(prepared.items()):  # calibrate: a sample lasts at least SAMPLE_S
        try:
            cursor = _calibrate(item, cursor, device)
        except Exception as exc:
            errors[name] = f"raised {type(exc).__name__}: {_first_line(exc)}"
            del prepared[name]
    lap("calibration")
    samples: dict[str, list[float]] = {name: [] for name in prepared}
    order = list(prepared)
    probes_us: list[float] = []
    references: dict = {}  # input set index -> spot.SpotReference, shared by the candidates

    def wrong(name: str) -> bool:  # a fast wrong answer must not win: check what the timed plan computed
        try:
            reason = _timed_output_reason(prepared[name], spec, phase, plan_args, sets, device, references)
            error = f"{WRONG_OUTPUT} {mode} runs: {reason}" if reason else None
        except Exception as exc:  # the check's own run raised (out of memory, say): no time here, no wrong output
            error = f"raised {type(exc).__name__} in the output check after the timed {mode} runs: {_first_line(exc)}"
        if error:
            errors[name] = error
            del prepared[name]
        return bool(error)

    race, racing = Race(RACE_AFTER, RACE_OUT), mode == "eager" and reps > RACE_AFTER
    for r in itertools.count():  # until every candidate still timed and not raced out has its reps samples
        if racing and r >= RACE_AFTER and race.leader not in prepared:  # raced again when the leader is gone
            race.run(samples, [n for n in order if n in prepared], wrong)
        active = [n for n in order if n in prepared and n not in race.out and len(samples[n]) < reps]
        if not active:
            break
        probe = host_probe(device) if mode == "eager" else None
        if probe is not None:
            probes_us.append(probe * 1e6)
        shift = r % len(active)
        for name in active[shift:] + active[:shift]:
            item = prepared[name]
            try:
                samples[name].append(_sample(item, cursor, device))
            except Exception as exc:
                errors[name] = f"raised {type(exc).__name__}: {_first_line(exc)}"
                del prepared[name]
            cursor += item.repeat
    lap("samples")
    for name in list(prepared):
        wrong(name)
    timed = {name for name in prepared if samples[name]}
    us, spread = {}, {}
    for name, values in samples.items():
        if name in timed:
            med = statistics.median(values)
            us[name] = race.seconds(name, samples, timed) * 1e6
            spread[name] = (max(values) - min(values)) / med if med > 0 else 0.0
    lap("checks")
    del prepared, sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    lap("freeing")
    return {"us": us, "spread": spread, "errors": errors,
            "host_us": statistics.median(probes_us) if probes_us else None, "wall_s": wall,
            **({"raced": sorted(n for n in race.out if n in us)} if set(race.out) & set(us) else {})}


def _timed_output_reason(item: _Timed, spec: AttentionSpec, phase: str, plan_args: tuple, sets: list[tuple],
                         device: torch.device, references: dict) -> str | None:
    """Why the candidate's timed plan computed a wrong output, or None (raises what its check's run raises). A
    reference that cannot be computed (out of memory, say) skips the check: the checker's failure is not theirs."""
    outputs = item.outputs()
    _sync(device)
    for index, out in outputs:
        if index not in references:
            try:
                references[index] = spot_reference(spec, phase, plan_args, sets[index], feature_inputs(spec, phase,
                                                                                                     device))
            except Exception as exc:
                log.warning("timed outputs of %s %s not checked: the reference failed: %s: %s", phase,
                            spec.describe(), type(exc).__name__, _first_line(exc))
                references[index] = None
        if references[index] is None:
            continue
        reason = spot_compare(references[index], out)
        if reason:
            return f"input set {index + 1} of {len(sets)}: {reason}"
    return None


def _free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def measure(spec: AttentionSpec, phase: str, names: list[str], device: torch.device, mode: str,
            budget_s: float | None = None, reps: int | None = None, grid: list | None = None,
            max_budget_s: float | None = None) -> dict:
    """Time the candidates ``names`` of one phase on every bucket of the phase's grid, interleaved (module doc).

    Buckets go coarse grid first; once ``budget_s`` seconds are spent the remaining buckets are skipped (listed in
    "skipped"), so a tight budget gives a coarser table, never a missing range (graph: whole batch sizes,
    grid.whole_batch_sizes). Up to ``plan_allowance`` of the candidates' plans and first calls (first-use compiles;
    under CUDA graphs also the captures) is not counted (``max_budget_s``: the most a phase's budget may be, half the
    worker's task timeout). ``grid``: (level, shape) items instead of the phase's grid (prefill: sequence lengths;
    decode: (batch, context), or a list of context lengths for a ragged bucket: grid.decode_timing_grid). Returns a
    JSON-able dict:
    ``{"phase", "mode", "grid_version", "axes", "reps", "buckets": [{"key", "label", "us", "spread", "errors",
    "host_us", "host" (eager on CUDA: the bucket's median probe and its ratio to host_reference), "ragged": true on a
    ragged decode bucket only, "pruned_near": [candidates pruned near it], "left_out": {candidate: why not timed
    there, not a failure} (grid.left_out), each where any}], "skipped": [labels], "pruned", "pruned_near": {name:
    finer buckets it skipped}, "wall_s", "counted_s": what the budget counted of it, "steps_s": {step: seconds}}``.
    """
    from .. import backends

    reps = reps or reps_for(mode, device)
    t0 = time.perf_counter()
    cands = {name: backends.get(name) for name in names}
    free = _free_bytes(device)
    if grid is None:
        if phase == "extend":
            grid = extend_grid(spec, device, free, mode)
        elif phase == "prefill":
            grid = [(lvl, lens) for lvl, lens in prefill_grid(spec, device)]
        else:
            grid = decode_timing_grid(spec, device, free, mode, device_sms(device))
    buckets, skipped, pruned = [], [], {}
    steps: dict[str, float] = {}  # seconds per time_bucket step, over the buckets
    allowance = plan_allowance(budget_s, max_budget_s)
    coarse: list[tuple] = []  # (key, time_bucket result) of the uniform coarse buckets: pruning reads them
    coarse_done, cut = False, None  # cut: the batch size (key[0]) that the budget stopped at
    for level, shape in grid:
        ragged = phase == "decode" and isinstance(shape, list)  # a decode batch's context lengths
        if phase == "extend":
            key, label = tuple(shape), extend_label(shape)
        elif phase == "prefill":
            key, label = prefill_key(shape), prefill_label(shape)
        elif ragged:
            key = ragged_key(shape)
            label = f"ragged {key[0]} (mean {key[1]}, max {max(shape)})"
        else:
            key, label = tuple(shape), f"{shape[0]}x{shape[1]}"
        if budget_s is not None and buckets and _counted(time.perf_counter() - t0, steps, allowance) > budget_s:
            skipped.append(label)
            cut = key[0] if cut is None else cut
            continue
        if level > 0 and not coarse_done:  # the coarse grid is done: prune once
            pruned = prune([timed for _, timed in coarse], list(cands))
            for name, ratio in pruned.items():
                log.info("%s %s: %s is not timed on the finer grid (at least %.2fx the fastest in every coarse "
                         "bucket)", phase, spec.describe(), name, ratio)
            cands = {n: b for n, b in cands.items() if n not in pruned}
            coarse_done = True
        local = prune(near_coarse(coarse, key), list(cands)) if level > 0 and mode == "eager" else {}
        out = left_out(spec, shape, free, mode, cands) if ragged else {}  # {candidate: why it is not timed here}
        timed = time_bucket({n: b for n, b in cands.items() if n not in {**local, **out}}, spec, phase, shape,
                            device, mode, reps)
        if (pruned or local) and timed["errors"]:  # a timed candidate failed: the pruned ones may have to serve
            log.info("%s %s %s: %s failed; timed again with the pruned candidates", phase, spec.describe(), label,
                     ", ".join(timed["errors"]))
            _add_steps(steps, timed)
            timed = time_bucket({n: b for n, b in {**cands, **{n: backends.get(n) for n in pruned}}.items()
                                 if n not in out}, spec, phase, shape, device, mode, reps)
            local = {}
        _add_steps(steps, timed)
        buckets.append({"key": list(key), "label": label, **({"ragged": True} if ragged else {}),
                        **({"pruned_near": sorted(local)} if local else {}), **({"left_out": out} if out else {}),
                        **timed})
        if level == 0 and not coarse_done and not ragged:  # pruning reads the uniform coarse grid only
            coarse.append((key, timed))
    if mode == "graph" and phase != "prefill":  # a batch size is scored over all its shapes: whole ones only
        buckets, skipped = whole_batch_sizes(buckets, skipped, cut)
    reference = host_reference([b["host_us"] for b in buckets if b.get("host_us")])
    for b in buckets:  # the host's speed while a bucket was timed, over the phase's reference
        if b.get("host_us"):
            b["host"] = b["host_us"] / reference
    wall = time.perf_counter() - t0
    pruned_near = collections.Counter(n for b in buckets for n in b.get("pruned_near", ()))
    return {"phase": phase, "mode": mode, "grid_version": GRID_VERSION,
            "axes": list(AXES[phase]), "reps": reps, "buckets": buckets,
            "skipped": skipped, "pruned": pruned, "pruned_near": dict(pruned_near), "wall_s": wall,
            "counted_s": _counted(wall, steps, allowance), "steps_s": steps}


def plan_allowance(budget_s: float | None, max_budget_s: float | None = None) -> float:
    """Seconds of a phase's plans and first calls that its budget does not count: PLAN_ALLOWANCE_S, at most
    PLAN_ALLOWANCE_SHARE of the most a phase's budget may be (``max_budget_s``, half the task timeout; else the
    budget itself), so that a phase ends within its task's timeout. Both launch modes (PLAN_ALLOWANCE_S)."""
    cap = max_budget_s if max_budget_s else budget_s
    return min(PLAN_ALLOWANCE_S, PLAN_ALLOWANCE_SHARE * cap) if budget_s else 0.0


def _counted(elapsed: float, steps: dict[str, float], allowance: float) -> float:
    """The part of a phase's elapsed seconds that its time budget counts: all but up to ``allowance`` of the
    candidates' plans and first calls (where first-use compiles happen)."""
    return elapsed - min(steps.get("plans", 0.0), allowance)


def _add_steps(steps: dict[str, float], timed: dict) -> None:
    """Move a time_bucket result's per-step seconds into the phase's sums."""
    for step, seconds in timed.pop("wall_s", {}).items():
        steps[step] = steps.get(step, 0.0) + seconds


def near_coarse(coarse: list[tuple[tuple, dict]], key: tuple) -> list[dict]:
    """The time_bucket results of the ``coarse`` (key, result) buckets within NEAR of ``key`` on every axis, where
    they bracket it (on every axis one at or below its value and one at or above): else none. Evidence from one side
    of an axis is an extrapolation: extend's coarse grid steps 16-32x per axis, so most of its finer buckets have a
    coarse bucket within NEAR on one side only, and a winner that turns between two coarse values would be pruned
    where it wins."""
    near = [(k, timed) for k, timed in coarse
            if all(max(a, 1) / max(b, 1) <= NEAR and max(b, 1) / max(a, 1) <= NEAR for a, b in zip(k, key))]
    if not all(any(k[i] <= x for k, _ in near) and any(k[i] >= x for k, _ in near) for i, x in enumerate(key)):
        return []
    return [timed for _, timed in near]


def prune(coarse: list[dict], names: list[str], factor: float = PRUNE) -> dict[str, float]:
    """The candidates at least ``factor`` times slower than the fastest in every one of the ``coarse`` buckets
    (time_bucket results) where they have a time, each with its least ratio there. A bucket where a candidate has
    no time (it failed there; the bucket reports why) does not keep it, but a candidate needs a time in at least
    one coarse bucket to be pruned. At least one candidate always stays."""
    ratios: dict[str, float] = {}
    for name in names:
        per_bucket = [timed["us"][name] / min(timed["us"].values()) for timed in coarse if name in timed["us"]]
        if per_bucket and min(per_bucket) >= factor:
            ratios[name] = min(per_bucket)
    if len(ratios) >= len(names):
        return {}
    return ratios


def probes(device: torch.device) -> dict:
    """Copy (bytes read + written) and read-only bandwidth in TB/s on 2 GiB."""
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.nbytes / bench(lambda: y.copy_(x), device) / 1e12
    read = x.nbytes / bench(lambda: x.sum(dtype=torch.float32), device) / 1e12
    return {"copy_tbps": copy, "read_tbps": read}  # x and y are freed on return
