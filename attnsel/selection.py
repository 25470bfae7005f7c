"""Selection: explicit or automatic backend per phase, validated in a worker, ranked by a policy, cached."""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import numbers
from typing import Literal

import torch

from . import backends, metadata_values
from .backends import PHASES, Phase, RunFn
from .cache import ResultCache, entry_key
from .canary import Canary, every_from
from .device import fingerprint, kind as device_kind
from .dist import agree
from .spec import AttentionSpec
from .validate import runner, seconds_from_env, timing

log = logging.getLogger(__name__)

AUTO = "auto"
POLICIES = ("measure", "priority")
MODES = ("eager", "graph")
TIE = 0.01  # measured within 1% of the fastest: priority order decides. H200 2026-12-03: with 3%, FA3 won the
# batch-16 decode bucket by priority while 1.02x slower there and 1.09-1.27x slower at batch 12 (bench/results)
# FlashInfer's template variants (flashinfer_fa2 prefill, flashinfer_fa3 decode) are registered but opt-in
# (--prefill-priority / --decode-priority): each is a further JIT build of about two minutes on a fresh machine.
# flashinfer_xqa is opt-in too: on the H200 under CUDA graphs it won the batch-1..16 buckets on uniform contexts but
# was 1.85x slower than Triton on a ragged batch (one 9000-token row among short ones) and 1.04-1.13x on long
# contexts, so the table lost (17 of 25 bench cells within 3%; 22 in round 6 without it; bench/results/2026-12-04-round9).
DEFAULT_PRIORITY: dict[str, tuple[str, ...]] = {
    "prefill": ("fa3", "flashinfer", "fa3_split", "fa3_packgqa", "triton", "torch"),
    "decode": ("flashinfer", "flashinfer_cuda_cores", "fa3", "fa3_packgqa", "triton", "torch"),
}


class SelectionError(RuntimeError):
    """No backend can serve a phase, or an explicitly requested backend is unavailable or failed validation.
    ``selection``: what was found (every candidate, the phases that can be served), for reports; may be None."""

    def __init__(self, message: str, selection: "Selection | None" = None):
        super().__init__(message)
        self.selection = selection

    def __reduce__(self):  # keeps the selection when rank 0 broadcasts the error
        return (type(self), (str(self), self.selection))


Status = Literal["selected", "valid", "rejected", "unavailable"]
Source = Literal["auto", "explicit"]


@dataclasses.dataclass
class Candidate:
    """One backend's result for one phase: status, the reason when it is not usable, its error and timings."""

    name: str
    status: Status
    reason: str = ""
    max_abs_err: float | None = None
    tolerance: float | None = None
    time_s: float | None = None
    score_us: float | None = None
    timings_us: dict | None = None
    from_cache: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One timed bucket of a dispatch table: its representative shape (``key``, on the table's axes), the backend
    chosen there, its time per call, and the runner-up. ``times_us``/``spread`` hold every timed candidate. ``host``:
    the host's speed while it was timed, its probe over the phase's reference (eager on CUDA; timing.host_probe and
    timing.host_reference)."""

    key: tuple[int, ...]
    label: str
    backend: str
    us: float
    runner_up: str | None
    runner_up_us: float | None
    times_us: dict[str, float]
    spread: dict[str, float]
    host: float | None = None

    @property
    def ratio(self) -> float | None:
        """Runner-up time over the chosen backend's time (>= 1 unless the tie band let priority decide)."""
        return self.runner_up_us / self.us if self.runner_up_us and self.us else None

    def to_json(self) -> dict:
        return {"key": list(self.key), "label": self.label, "backend": self.backend, "us": self.us,
                "runner_up": self.runner_up, "runner_up_us": self.runner_up_us, "ratio": self.ratio,
                "times_us": self.times_us, "spread": self.spread, "host": self.host}

    @classmethod
    def from_json(cls, data: dict) -> "Bucket":
        return cls(tuple(data["key"]), data["label"], data["backend"], data["us"], data.get("runner_up"),
                   data.get("runner_up_us"), dict(data.get("times_us", {})), dict(data.get("spread", {})),
                   data.get("host"))


_MISSING = object()


def _log2(x: float) -> float:
    return math.log2(max(x, 1))


@dataclasses.dataclass(frozen=True)
class DispatchTable:
    """Shape bucket -> backend for one phase, from timings (policy "measure" with an automatic choice).

    Axes: prefill ("num_seqs", "total_tokens", "longest"); decode ("batch", "context") in eager mode, ("batch",) in
    graph mode (an engine captures one graph per batch size and replays it at every context length, so the backend
    there is the one best over the timed context range: least geometric-mean time). ``cell`` gives a shape's
    per-axis bucket index on a log scale (boundaries at the geometric midpoints of neighbouring timed values, shapes
    beyond the ends clamped); ``bucket_for`` gives the timed bucket nearest to the shape in log space (clamped to
    the timed range). ``default`` is the phase's headline backend: the best single backend over all buckets.

    ``backend_for`` interpolates between timed shapes: where every corner of the box of timed values around a shape
    was timed (per axis the values just below and above it, in log space), each candidate's slowdown (log of its time
    over the corner's fastest) is interpolated multilinearly in log space and the least wins; within ``TIE`` of it,
    the candidate whose worst corner is least (H200 round 11: the nearest corner's choice, FA3 in a three-way 1% tie
    at 91 rows, 5% behind at 128, served 100 rows 1.24x slower than FlashInfer; replayed over rounds 10 and 11 by
    scripts/replay_dispatch.py, eager decode 138 -> 142 of 150 cells within 3%, graph unchanged). A backend that
    wins one corner and loses badly at the next then does not serve the shapes between them (on the H200: FA3 won
    batch-16 decode by 0.9% and was 1.24-1.31x slower at batch 12, where Triton was within 1% at both batch 8 and
    16). Elsewhere (sparse corners, e.g. prefill) the nearest bucket serves.
    """

    phase: str
    mode: str
    axes: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    default: str
    grid_version: int
    skipped: tuple[str, ...] = ()
    wall_s: float | None = None
    tie: float = TIE  # the lookup's tie band (the buckets' choices were made with the selection's)
    pruned: tuple[tuple[str, float], ...] = ()  # (candidate, least ratio to the fastest on the coarse grid): not
    # timed on the finer levels (timing.prune)
    ragged: "DispatchTable | None" = None  # eager decode: the table of the ragged buckets (timing.RAGGED_*), same
    # axes, for batches whose longest row is at least timing.RAGGED_SKEW times their mean context

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError(f"a {self.phase} dispatch table needs at least one bucket")
        if self.ragged is not None and not (self.phase == self.ragged.phase == "decode"
                                            and self.mode == self.ragged.mode == "eager"
                                            and self.ragged.axes == self.axes == tuple(timing.DECODE_AXES)
                                            and self.ragged.ragged is None):
            raise ValueError(f"ragged buckets form one eager decode sub-table keyed by {timing.DECODE_AXES}, under an "
                             f"eager decode table; got a {self.ragged.mode} {self.ragged.phase} sub-table keyed by "
                             f"{self.ragged.axes}{' with its own sub-table' if self.ragged.ragged else ''} under a "
                             f"{self.mode} {self.phase} table keyed by {self.axes}")
        values = [sorted({b.key[i] for b in self.buckets}) for i in range(len(self.axes))]
        bounds = [[math.sqrt(a * b) for a, b in zip(v, v[1:])] for v in values]
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_cells", {})
        object.__setattr__(self, "_by_key", {b.key: b for b in self.buckets})
        slowdowns = {}
        for b in self.buckets:  # a bucket without usable times (hand-made tables) just never takes part
            times = {n: t for n, t in b.times_us.items() if isinstance(t, (int, float)) and t > 0}
            if times:
                best = min(times.values())
                slowdowns[b.key] = {n: math.log(t / best) for n, t in times.items()}
        object.__setattr__(self, "_slowdowns", slowdowns)
        object.__setattr__(self, "_picks", {})
        # candidates in the order the tables were built with (bucket winners first): the last tie-break
        order = list(dict.fromkeys([b.backend for b in self.buckets] + sorted({n for b in self.buckets
                                                                              for n in b.times_us})))
        object.__setattr__(self, "_order", order)

    def _check_key(self, key: tuple[int, ...]) -> None:
        if len(key) != len(self.axes):  # zip would drop the extra values or the missing axes silently
            raise ValueError(f"a {self.phase} dispatch table ({self.mode}) is keyed by ({', '.join(self.axes)}), got "
                             f"{tuple(key)!r}")

    def cell(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """The per-axis bucket index of a shape (log-spaced boundaries, clamped at both ends)."""
        self._check_key(key)
        return tuple(bisect.bisect_right(b, x) for b, x in zip(self._bounds, key))

    def bucket_for(self, key: tuple[int, ...]) -> Bucket:
        """The timed bucket that serves a shape given on the table's axes: the one nearest to the shape in log
        space, the shape first clamped per axis to the timed range and rounded to 1/16 octave (nearby shapes share
        one memoised answer; within 1/32 octave of a midpoint the rounding may pick the other side); ties go to
        the earlier bucket (coarse grid first). Measured from the
        shape itself, not from the centre of its cell: on the H200 (2026-12-04) 40 prompts x 100 tokens lies in
        the cell of (32 prompts, 4608 tokens, longest 102), which was not timed; from that cell's centre the
        timed (32, 3264, 102) and (32, 4608, 144) were equally near and FA3's 144-token bucket served it, 1.31x
        slower than FlashInfer, while the shape itself is nearest to (32, 3264, 102), FlashInfer's."""
        self._check_key(key)
        point = tuple(round(16 * _log2(min(max(x, v[0]), v[-1]))) / 16 for x, v in zip(key, self._values))
        hit = self._cells.get(point)
        if hit is None:
            hit = min(self.buckets, key=lambda b: sum((_log2(x) - p) ** 2 for x, p in zip(b.key, point)))
            if len(self._cells) >= 4096:  # bounded memo
                self._cells.clear()
            self._cells[point] = hit
        return hit

    def backend_for(self, key: tuple[int, ...], longest: int | None = None) -> str:
        """The backend that serves a shape given on the table's axes (interpolated between timed shapes, see the
        class docstring). Per axis the position between two timed values is rounded to 1/32 of their log distance,
        so that shapes a few tokens apart share one memoised answer. ``longest``: a decode batch's longest context
        (exact); for a batch of at least 2 rows whose longest row is at least timing.RAGGED_SKEW times the mean
        (``key[1]``), near a timed ragged bucket (``covers``), the ragged buckets decide
        (a ragged batch's speed is not its mean's uniform batch's: module timing); elsewhere the uniform ones (no
        extrapolation of the ragged timings over the uniform ones)."""
        self._check_key(key)
        if self.ragged is not None and longest is not None and self.ragged.covers(key, longest):
            return self.ragged.backend_for(key)
        sides = []  # per axis: ((value, weight), ...): one entry on a timed value or beyond the ends, else two
        for values, x in zip(self._values, key):
            x = max(x, 1)
            i = bisect.bisect_left(values, x)
            if i < len(values) and values[i] == x or i == 0 or i == len(values):
                sides.append(((values[min(i, len(values) - 1)], 1.0),))
            else:
                lo, hi = values[i - 1], values[i]
                w = round(32 * (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))) / 32
                sides.append(((lo, 1.0 - w), (hi, w)))
        sides = tuple(sides)
        hit = self._picks.get(sides, _MISSING)
        if hit is _MISSING:
            hit = self._picks[sides] = self._interpolated(sides)
        # the fallback is looked up from the exact key (bucket_for memoises on its own, finer rounding)
        return hit or self.bucket_for(key).backend

    def covers(self, key: tuple[int, ...], longest: int) -> bool:
        """Whether this (ragged) table serves a decode batch of ``key`` = (batch, mean context) whose longest row is
        ``longest``: at least 2 rows, longest >= timing.RAGGED_SKEW x the mean (the timed ragged batches' skew), and
        a timed bucket within a factor of 2 of the batch and of the mean (a hole in the grid, e.g. a bucket left out
        by the memory cap, is not bridged)."""
        batch, mean = key[0], max(key[-1], 1)
        return (batch >= 2 and longest >= timing.RAGGED_SKEW * mean
                and any(b.key[0] / 2 <= batch <= 2 * b.key[0] and b.key[-1] / 2 <= mean <= 2 * b.key[-1]
                        for b in self.buckets))

    def _interpolated(self, sides: tuple) -> str | None:
        """The least interpolated slowdown over the box of timed values ``sides`` (per axis, (value, weight) pairs);
        None where a corner of the box was not timed."""
        corners = []
        for combo in itertools.product(*sides):
            weight = math.prod(w for _, w in combo)
            if weight <= 0:  # rounded onto the other corner: it does not take part
                continue
            corner = tuple(v for v, _ in combo)
            if corner not in self._slowdowns:
                return None
            corners.append((corner, weight))
        if len(corners) == 1:  # on a timed shape (or beyond the ends): that bucket's choice
            return self._by_key[corners[0][0]].backend
        names = set.intersection(*(set(self._slowdowns[c]) for c, _ in corners))
        if not names:
            return None
        cost = {n: sum(w * self._slowdowns[c][n] for c, w in corners) for n in names}
        best = min(cost.values())
        tied = {n for n, c in cost.items() if c <= best + math.log1p(self.tie) + 1e-12}
        worst = {n: max(self._slowdowns[c][n] for c, _ in corners) for n in tied}
        return min(tied, key=lambda n: (worst[n], cost[n], self._order.index(n)))

    def wins(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for b in self.buckets:
            counts[b.backend] = counts.get(b.backend, 0) + 1
        return counts

    def to_json(self) -> dict:
        return {"phase": self.phase, "mode": self.mode, "axes": list(self.axes), "default": self.default,
                "grid_version": self.grid_version, "skipped": list(self.skipped), "wall_s": self.wall_s,
                "tie": self.tie, "pruned": dict(self.pruned), "buckets": [b.to_json() for b in self.buckets],
                "ragged": self.ragged.to_json() if self.ragged is not None else None}

    @classmethod
    def from_json(cls, data: dict) -> "DispatchTable":
        ragged = data.get("ragged")
        return cls(data["phase"], data["mode"], tuple(data["axes"]),
                   tuple(Bucket.from_json(b) for b in data["buckets"]),
                   data["default"], data["grid_version"], tuple(data.get("skipped", ())), data.get("wall_s"),
                   tie=data.get("tie", TIE), pruned=tuple(data.get("pruned", {}).items()),
                   ragged=cls.from_json(ragged) if ragged else None)


def pick(times: dict[str, float], order: list[str], tie: float = TIE) -> str:
    """The fastest of ``times`` (name -> us); within ``tie`` of the fastest, the earliest in ``order`` wins."""
    best = min(times.values())
    return next(n for n in order if n in times and times[n] <= best * (1 + tie))


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _make_bucket(key: tuple, label: str, times: dict[str, float], spread: dict[str, float], order: list[str],
                 host: float | None = None) -> Bucket:
    chosen = pick(times, order)
    others = sorted((t, n) for n, t in times.items() if n != chosen)
    return Bucket(tuple(key), label, chosen, times[chosen], others[0][1] if others else None,
                  others[0][0] if others else None, dict(times), dict(spread), host)


def build_table(measured: dict, order: list[str], usable: set[str] | None = None) -> DispatchTable | None:
    """A dispatch table from ``timing.measure``'s result (or hand-made timings of the same form).

    ``order``: the candidates in priority order (ties within TIE go to the earlier); ``usable``: the candidates
    allowed to win (default: all in ``order``). Buckets where no usable candidate has a time are dropped; None when
    nothing is left.
    """
    usable = set(order) if usable is None else usable
    order = [n for n in order if n in usable]
    phase, mode = measured["phase"], measured["mode"]
    uniform = [b for b in measured["buckets"] if not b.get("ragged")]
    ragged = [{k: v for k, v in b.items() if k != "ragged"} for b in measured["buckets"] if b.get("ragged")]
    if ragged and phase == "decode" and mode == "eager":  # the ragged buckets' own table (graph mode: none)
        sub = build_table({**measured, "buckets": ragged, "pruned": {}, "wall_s": None,
                           "skipped": [x for x in measured.get("skipped", ()) if x.startswith("ragged ")]},
                          order, usable)
        table = build_table({**measured, "buckets": uniform,  # ragged labels stay here when no sub-table holds them
                             "skipped": [x for x in measured.get("skipped", ())
                                         if sub is None or not x.startswith("ragged ")]},
                            order, usable)
        # without uniform times there is no table (the ragged buckets alone do not serve uniform batches)
        return dataclasses.replace(table, ragged=sub) if table is not None else None
    rows = []
    for b in uniform:
        times = {n: t for n, t in b["us"].items() if n in usable and t and t > 0}
        if times:
            rows.append((tuple(b["key"]), b["label"], times, b.get("spread", {}), b.get("host")))
    if not rows:
        return None
    axes = tuple(measured["axes"])
    if phase == "decode" and mode == "graph":  # one bucket per batch size, best over the context range
        by_batch: dict[int, list] = {}
        for key, label, times, spread, _ in rows:  # graph mode: no host probes
            by_batch.setdefault(key[0], []).append((key, times, spread))
        rows = []
        for batch, group in sorted(by_batch.items()):
            names = [n for n in order if all(n in times for _, times, _ in group)]
            if not names:  # no candidate was timed at every context of this batch size
                continue
            ctxs = [key[1] for key, _, _ in group]
            times = {n: _geomean([t[n] for _, t, _ in group]) for n in names}
            spread = {n: max(s.get(n, 0.0) for _, _, s in group) for n in names}
            rows.append(((batch,), f"batch {batch} (ctx {min(ctxs)}-{max(ctxs)})", times, spread, None))
        axes = axes[:1]
        if not rows:
            return None
    buckets = tuple(_make_bucket(key, label, times, spread, order, host) for key, label, times, spread, host in rows)
    everywhere = [n for n in order if all(n in b.times_us for b in buckets)]
    if everywhere:
        default = pick({n: _geomean([b.times_us[n] for b in buckets]) for n in everywhere}, order)
    else:
        wins: dict[str, int] = {}
        for b in buckets:
            wins[b.backend] = wins.get(b.backend, 0) + 1
        default = max(order, key=lambda n: (wins.get(n, 0), -order.index(n)))
    return DispatchTable(phase, mode, axes, buckets, default, measured["grid_version"],
                         tuple(measured.get("skipped", ())), measured.get("wall_s"),
                         pruned=tuple((n, r) for n, r in measured.get("pruned", {}).items() if n in usable))


@dataclasses.dataclass(frozen=True)
class PhaseChoice:
    """What was chosen for one phase, how (auto or explicit), every candidate considered (priority order), and the
    dispatch table when the choice depends on the batch's shape (None: ``backend`` serves every shape)."""

    backend: str
    source: Source
    candidates: list[Candidate]
    table: DispatchTable | None = None
    error: str = ""  # why the phase cannot be served (backend is "" then)

    def to_json(self) -> dict:
        return {"backend": self.backend, "source": self.source, "candidates": [c.to_dict() for c in self.candidates],
                "dispatch": self.table.to_json() if self.table else None, "error": self.error}


DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return "None" if t is None else type(t).__name__
    dt = next((n for n, d in DTYPE_NAMES.items() if d == t.dtype), str(t.dtype).replace("torch.", ""))
    return f"[{', '.join(map(str, t.shape))}] {dt} on {t.device}"


def _expect(arg: str, t, shape: tuple, dtype: torch.dtype, device: int) -> ValueError:
    dims = ", ".join("*" if d is None else str(d) for d in shape)
    dt = next((n for n, d in DTYPE_NAMES.items() if d == dtype), str(dtype))
    where = "cpu" if device < 0 else f"cuda:{device}"
    return ValueError(f"{arg}: expected [{dims}] {dt} on {where}, got {_describe(t)}")


def _check_features(spec: AttentionSpec, kwargs: dict, phase: str) -> None:
    """The run-time feature inputs against the spec (reached only when the spec has features or kwargs are given)."""
    unknown = set(kwargs) - {"sinks", "k_scale", "v_scale"}
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s) {', '.join(sorted(unknown))}; allowed: sinks, "
                        "k_scale, v_scale")
    sinks = kwargs.get("sinks")
    if spec.sinks and not (isinstance(sinks, torch.Tensor) and sinks.shape == (spec.num_q_heads,)
                           and sinks.dtype == torch.float32):
        raise ValueError(f"sinks: expected [{spec.num_q_heads}] fp32 (the spec has attention sinks), got "
                         f"{_describe(sinks)}")
    if not spec.sinks and sinks is not None:
        raise ValueError("sinks: given, but the spec has no attention sinks (AttentionSpec(sinks=True))")
    scaled = spec.kv_dtype is not None and phase == "decode"  # prefill takes k/v in spec.dtype either way
    for name in ("k_scale", "v_scale"):
        scale = kwargs.get(name)
        if scaled and not (isinstance(scale, torch.Tensor) and scale.numel() == 1
                                  and scale.dtype == torch.float32):
            raise ValueError(f"{name}: expected a one-element fp32 tensor (the spec's KV cache is {spec.kv_dtype}), "
                             f"got {_describe(scale)}")
        if not scaled and scale is not None:
            why = ("prefill takes k/v in the activation dtype" if spec.kv_dtype
                   else f"the spec's KV cache is {spec.dtype}")
            raise ValueError(f"{name}: given, but {why} (no scales)")


_INDEX_DTYPES = (torch.int32,)  # as FlashAttention: an int64 copy made at plan time would not see in-place updates


def _host_int(value) -> bool:
    """An integer on the host (int, numpy integer; not bool, not a tensor: reading one would sync)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_prefill_metadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Host-side checks of a prefill plan's arguments (shapes, dtypes, devices; never their values: no sync)."""
    for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 1 or cu.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{arg}: expected a 1-D int32 tensor of batch + 1 offsets, got {_describe(cu)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape or cu_seqlens_k.device != cu_seqlens_q.device:
        raise ValueError(f"cu_seqlens_k: expected the shape and device of cu_seqlens_q {_describe(cu_seqlens_q)}, "
                         f"got {_describe(cu_seqlens_k)}")
    for arg, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _host_int(value) or value < 0:
            raise ValueError(f"{arg}: expected a non-negative Python int (a host-side size), got {value!r}")


def check_decode_metadata(page_table, seq_lens, max_seq_len) -> None:
    """Host-side checks of a decode plan's arguments (shapes, dtypes, devices; never their values: no sync)."""
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"seq_lens: expected a 1-D int32 tensor [batch], got {_describe(seq_lens)}")
    if (not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.dtype not in _INDEX_DTYPES
            or page_table.shape[0] != seq_lens.shape[0] or page_table.device != seq_lens.device):
        raise ValueError(f"page_table: expected an int32 tensor [{seq_lens.shape[0]}, max_pages] on "
                         f"{seq_lens.device} (one row per sequence of seq_lens), got {_describe(page_table)}")
    if max_seq_len is not None and (not _host_int(max_seq_len) or max_seq_len < 0):
        raise ValueError(f"max_seq_len: expected None or a non-negative Python int, got {max_seq_len!r}")


def _check_unit_stride(**tensors: torch.Tensor) -> None:
    """Every tensor's last dimension is contiguous (kernels index it with stride 1); ValueError naming the first
    that is not."""
    for arg, t in tensors.items():
        if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{arg}: its last dimension must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}; pass {arg}.contiguous()")


def _raise_first_non_tensor(device: int, **args: tuple) -> None:
    """ValueError naming the first argument that is not a torch.Tensor (args: name -> (value, shape, dtype))."""
    for arg, (value, shape, dtype) in args.items():
        if not isinstance(value, torch.Tensor):
            raise _expect(arg, value, shape, dtype, device) from None


def checked_prefill(run: RunFn, spec: AttentionSpec, device: int, total_q: int | None,
                    total_k: int | None, seen: tuple[int, int] | None = None) -> RunFn:
    """run(q, k, v, **features) with the tensors checked against the spec and plan: host metadata only, no sync.
    ``device``: the plan's device index (-1: CPU). ``seen``: the last offsets a value-checked plan read
    (``ATTNSEL_CHECK_METADATA``): q and k must hold at least that many rows (rows after them are padding)."""
    hq, hk, d, dt = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.torch_dtype
    plain = not spec.sinks

    def checked(q, k, v, **kwargs):
        try:
            try:
                tq, q1, q2 = q.shape
            except (AttributeError, ValueError):
                tq = -1
            if (tq < 0 or q1 != hq or q2 != d or q.dtype is not dt or q.get_device() != device
                    or (total_q is not None and tq != total_q)):
                raise _expect("q", q, (total_q, hq, d), dt, device)
            try:
                tk, k1, k2 = k.shape
            except (AttributeError, ValueError):
                tk = -1
            if (tk < 0 or k1 != hk or k2 != d or k.dtype is not dt or k.get_device() != device
                    or (total_k is not None and tk != total_k)):
                raise _expect("k", k, (total_k, hk, d), dt, device)
            try:
                tv, v1, v2 = v.shape
            except (AttributeError, ValueError):
                tv = -1
            if tv != tk or v1 != k1 or v2 != k2 or v.dtype is not dt or v.get_device() != device:
                raise _expect("v", v, (tk, hk, d), dt, device)
            if seen is not None:
                for arg, rows, least in (("q", tq, seen[0]), ("k", tk, seen[1])):
                    if rows < least:
                        raise ValueError(f"{arg} has {rows} tokens but cu_seqlens_{arg}[-1] is {least} "
                                         f"(${metadata_values.ENV} found this); allowed: at least cu_seqlens_{arg}"
                                         f"[-1] rows (rows after it are padding)")
            if (d > 1 and not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())  # the cheap common case
                    and (q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1)):
                _check_unit_stride(q=q, k=k, v=v)
        except AttributeError:  # an object with a shape but not a tensor's other attributes
            _raise_first_non_tensor(device, q=(q, (total_q, hq, d), dt), k=(k, (total_k, hk, d), dt),
                                    v=(v, (None, hk, d), dt))
            raise
        if kwargs or not plain:
            _check_features(spec, kwargs, "prefill")
        return run(q, k, v, **kwargs)

    _keep_current(checked, run)
    return checked


def checked_decode(run: RunFn, spec: AttentionSpec, device: int, batch: int, b1hd: bool = False,
                   pages_needed: int | None = None) -> RunFn:
    """run(q, k_cache, v_cache, **features) with the tensors checked against the spec and plan (no sync). With
    ``b1hd`` q must be ``[batch, 1, heads, head_dim]`` (run takes that layout, natively or through
    ``viewed_b1hd``). ``pages_needed``: from a value-checked plan (``ATTNSEL_CHECK_METADATA``), the pages the caches
    must hold."""
    hq, hk, d, ps = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.page_size
    dt, kdt = spec.torch_dtype, spec.kv_torch_dtype
    plain = not (spec.sinks or spec.kv_dtype)
    q_shape = (batch, 1, hq, d) if b1hd else (batch, hq, d)

    def checked(q, k_cache, v_cache, **kwargs):
        try:
            try:
                if b1hd:
                    b, one, q1, q2 = q.shape
                    if one != 1:
                        b = -1
                else:
                    b, q1, q2 = q.shape
            except (AttributeError, ValueError):
                b = -1
            if b != batch or q1 != hq or q2 != d or q.dtype is not dt or q.get_device() != device:
                raise _expect("q", q, q_shape, dt, device)
            try:
                kn, p, k1, k2 = k_cache.shape
            except (AttributeError, ValueError):
                p = -1
            if p != ps or k1 != hk or k2 != d or k_cache.dtype is not kdt or k_cache.get_device() != device:
                raise _expect("k_cache", k_cache, (None, ps, hk, d), kdt, device)
            try:
                vn, vp, v1, v2 = v_cache.shape
            except (AttributeError, ValueError):
                vp = -1
            if (vp != ps or v1 != hk or v2 != d or vn != kn or v_cache.dtype is not kdt
                    or v_cache.get_device() != device):
                raise _expect("v_cache", v_cache, tuple(k_cache.shape), kdt, device)
            if kn == 0 and batch:  # the backends gather page 0 for rows with nothing to read
                raise ValueError(f"k_cache/v_cache hold 0 pages ({list(k_cache.shape)}); allowed: at least one page "
                                 "(a batch of padding rows still needs a page for its page ids to point at)")
            if (d > 1 and not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
                    and (q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1)):
                _check_unit_stride(q=q, k_cache=k_cache, v_cache=v_cache)
        except AttributeError:  # an object with a shape but not a tensor's other attributes
            _raise_first_non_tensor(device, q=(q, q_shape, dt), k_cache=(k_cache, (None, ps, hk, d), kdt),
                                    v_cache=(v_cache, (None, ps, hk, d), kdt))
            raise
        if pages_needed is not None:
            metadata_values.check_decode_run(pages_needed, k_cache)
        if kwargs or not plain:
            _check_features(spec, kwargs, "decode")
        return run(q, k_cache, v_cache, **kwargs)

    _keep_current(checked, run)
    return checked


def _pages_checked(run: RunFn, pages_needed: int) -> RunFn:
    """An unchecked decode run (the FA-compatible calls check the rest) that still holds the caches to the pages its
    value-checked plan reads (``ATTNSEL_CHECK_METADATA``)."""
    def check_pages(k_cache):
        metadata_values.check_decode_run(pages_needed, k_cache)

    def pages_checked(q, k_cache, v_cache, **kwargs):
        check_pages(k_cache)
        return run(q, k_cache, v_cache, **kwargs)

    _keep_current(pages_checked, run)
    pages_checked.check_pages = check_pages  # for a caller that writes into the caches before the run (new k/v)
    return pages_checked


def viewed_b1hd(run: RunFn) -> RunFn:
    """A [batch, heads, head_dim] decode run taking and returning FlashAttention's [batch, 1, heads, head_dim]."""
    def viewed(q, k_cache, v_cache, **kwargs):
        return run(q.squeeze(1), k_cache, v_cache, **kwargs).unsqueeze(1)

    _keep_current(viewed, run)
    return viewed


def _keep_current(checked: RunFn, run: RunFn) -> None:
    """Carry the backend's optional ``run.current()`` (False once a later plan replaced this one) to the wrapper."""
    current = getattr(run, "current", None)
    if current is not None:
        checked.current = current


def plan_is_current(run: RunFn) -> bool:
    """Whether a run function may still be called: False once its backend replaced the plan (a backend with one plan
    per handle; attnsel's FlashInfer backend gives every live run function its own wrapper, so its runs stay
    current). A caller that caches run functions re-plans when this is False."""
    current = getattr(run, "current", None)
    return current is None or bool(current())


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen backend per phase, the dispatch table where the choice depends on the shape, and everything
    needed to explain the choice. ``prefill``/``decode`` name each phase's headline backend: the one that serves
    every shape when the phase has no table, else the best single backend over the table's buckets."""

    spec: AttentionSpec
    phases: dict[Phase, PhaseChoice]
    policy: str
    mode: str
    cache: Literal["hit", "miss", "off"]
    device: dict
    stats: dict
    canary: Canary | None = None  # opt-in (select's canary_every): checks one plan in N against the reference

    @property
    def prefill(self) -> str:
        return self.phases["prefill"].backend

    @property
    def decode(self) -> str:
        return self.phases["decode"].backend

    @property
    def prefill_source(self) -> Source:
        return self.phases["prefill"].source

    @property
    def decode_source(self) -> Source:
        return self.phases["decode"].source

    @property
    def candidates(self) -> dict[Phase, list[Candidate]]:
        return {p: c.candidates for p, c in self.phases.items()}

    @property
    def dispatch(self) -> dict[Phase, DispatchTable | None]:
        """The dispatch table per phase (None where one backend serves every shape)."""
        return {p: c.table for p, c in self.phases.items()}

    @property
    def prefill_backend(self) -> backends.Backend:
        return backends.get(self.prefill)

    @property
    def decode_backend(self) -> backends.Backend:
        return backends.get(self.decode)

    def prefill_backend_for(self, num_seqs: int, total_tokens: int, longest: int) -> str:
        """The backend that serves a prefill batch of this shape."""
        table = self.phases["prefill"].table
        return table.backend_for((num_seqs, total_tokens, longest)) if table else self.prefill

    def decode_backend_for(self, batch: int, context: int, longest: int | None = None) -> str:
        """The backend that serves a decode batch of this shape (context: its mean context, longest: its longest
        row's, see plan_decode; mode "graph": the batch size alone decides)."""
        table = self.phases["decode"].table
        if table is None:
            return self.decode
        return table.backend_for((batch,) if len(table.axes) == 1 else (batch, context), longest)

    def plan_prefill(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, total_q: int | None = None, *, total_k: int | None = None,
                     checked: bool = True) -> RunFn:
        """Plan a ragged prefill batch on the backend its shape dispatches to; returns ``run(q, k, v)`` (shapes:
        backends.Backend). No device sync: the bucket comes from host ints: the number of sequences
        (``cu_seqlens_q.shape[0] - 1``), ``total_q`` (query tokens in the batch) and ``max_seqlen_q``. When
        ``total_q`` is None it is taken as ``num_seqs * max_seqlen_q``: exact for equal lengths, an overestimate for
        ragged batches (pass it). The run function checks q/k/v against the spec, q's token count against
        ``total_q`` and k's against ``total_k`` when given, and raises ValueError naming the argument. Keep the run
        function alive as long as any CUDA graph that captured it may be replayed (it owns the plan's buffers).
        ``checked=False`` returns the backend's run function itself, for a caller that checks q/k/v against the spec
        on every call on its own (the FA-compatible functions do): a wrong tensor then reaches the kernel."""
        check_prefill_metadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        n = cu_seqlens_q.shape[0] - 1
        for arg, total in (("total_q", total_q), ("total_k", total_k)):  # q's / k's rows (padding included)
            if total is not None and (not _host_int(total) or total < 0):  # a tensor would be read: a device sync
                raise ValueError(f"{arg}: expected None or a non-negative Python int (the rows of "
                                 f"{arg[-1]}: the batch's tokens), got {total!r}")
        seen = None
        if metadata_values.enabled():  # opt-in: one host copy per plan (see metadata_values)
            seen = metadata_values.check_prefill(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q,
                                                 total_k)
        tokens = total_q if total_q is not None else seen[0] if seen else n * max_seqlen_q
        name = self.prefill_backend_for(n, tokens, max_seqlen_q)
        sample = None
        if self.canary is not None:  # may demote the pick, may sample this plan (module canary)
            name, sample = self.canary.serve("prefill", self.phases["prefill"], (n, tokens, max_seqlen_q), None,
                                             name, cu_seqlens_q)
        run = backends.get(name).plan_prefill(self.spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if sample is not None:
            run = sample.wrap(run, (cu_seqlens_q, cu_seqlens_k))
        if not checked:
            return run
        return checked_prefill(run, self.spec, cu_seqlens_q.get_device(), total_q, total_k, seen)

    def plan_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None,
                    context_tokens: int | None = None, *, longest: int | None = None, q_layout: str = "bhd",
                    checked: bool = True) -> RunFn:
        """Plan a paged decode batch on the backend its shape dispatches to; returns ``run(q, k_cache, v_cache)``
        (shapes: backends.Backend). No device sync: the bucket is (batch = ``seq_lens.shape[0]``, context) from
        host ints: context is the batch's mean context ceil(``context_tokens`` / batch) when ``context_tokens`` (the
        context tokens summed over the batch) is given: a decode's time follows the tokens it reads (H200
        2026-12-03: keyed by its longest row, a ragged batch of 8 was served by a backend 2.04x slower than the
        fastest); with ``longest`` too (the batch's longest context, exact: ``max_seq_len`` may be a bound; read
        only with ``context_tokens``; checked against seq_lens under ATTNSEL_CHECK_METADATA=1), a
        batch whose longest row is at least timing.RAGGED_SKEW times the mean is served by the eager table's ragged
        buckets where it has them (DispatchTable.backend_for: which backend is fastest on rows of very different
        lengths is not what the uniform batch of the mean says: H200 2026-12-06, 1.17-1.65x at 32 and 128 rows); else
        ``max_seq_len``; else ``page_table.shape[1] * page_size``, the longest context the table can hold (an
        overestimate when the table is wider than needed: pass one of them). In mode "graph" only the batch size
        matters. The run function checks q and the caches against the spec and raises ValueError naming the
        argument. It owns the plan's device buffers: keep it alive as long as any CUDA graph that captured it may
        be replayed (a graph holds device pointers only; a freed plan's memory goes to the next allocation).
        ``q_layout="b1hd"``: the run takes q and returns out as FlashAttention's ``[batch, 1, heads, head_dim]``
        (no views where the backend takes that layout itself: FA3, Triton). ``checked=False``: no checks of q and
        the caches per call, for a caller that makes them itself (the FA-compatible functions): the backend's run
        function itself, or in "b1hd" for a backend without that layout, the run between two views."""
        if q_layout not in ("bhd", "b1hd"):
            raise ValueError(f"q_layout: expected 'bhd' ([batch, heads, head_dim]) or 'b1hd' ([batch, 1, heads, "
                             f"head_dim]), got {q_layout!r}")
        check_decode_metadata(page_table, seq_lens, max_seq_len)
        if longest is not None and (not _host_int(longest) or longest < 0):
            raise ValueError("longest: expected None or a non-negative Python int (the batch's longest context, "
                             f"exact), got {longest!r}")
        pages_needed = (metadata_values.check_decode(page_table, seq_lens, max_seq_len, self.spec.page_size,
                                                        self.spec.sliding_window, longest)
                        if metadata_values.enabled() else None)  # opt-in: one host copy per plan (see metadata_values)
        batch = seq_lens.shape[0]
        if context_tokens is not None:
            if not _host_int(context_tokens) or context_tokens < 0:
                raise ValueError("context_tokens: expected None or a non-negative Python int (the batch's context "
                                 f"tokens, summed), got {context_tokens!r}")
            ctx = -(-context_tokens // max(batch, 1))
        elif max_seq_len is not None:
            ctx = max_seq_len
        else:
            ctx = page_table.shape[1] * self.spec.page_size
        longest_row = longest if context_tokens is not None else None
        name = self.decode_backend_for(batch, ctx, longest_row)
        sample = None
        if self.canary is not None:  # may demote the pick, may sample this plan (module canary)
            name, sample = self.canary.serve("decode", self.phases["decode"], (batch, ctx), longest_row, name,
                                             seq_lens)
        backend = backends.get(name)
        run = backend.plan_decode(self.spec, page_table, seq_lens)
        if sample is not None:
            run = sample.wrap(run, (page_table, seq_lens), longest if longest is not None else max_seq_len)
        b1hd = q_layout == "b1hd"
        if b1hd and not backends.decode_takes_b1hd(backend):
            run = viewed_b1hd(run)
        if not checked:
            return run if pages_needed is None else _pages_checked(run, pages_needed)
        return checked_decode(run, self.spec, seq_lens.get_device(), batch, b1hd, pages_needed)

    def to_json(self) -> dict:
        return {**{p: c.to_json() for p, c in self.phases.items()}, "cache": self.cache, "policy": self.policy,
                "mode": self.mode, "device": self.device, "spec": self.spec.to_dict(), "stats": self.stats,
                "canary": self.canary.report() if self.canary is not None else None}

    def summary(self) -> str:
        parts = []
        for phase, choice in self.phases.items():
            if not choice.backend:
                parts.append(f"{phase}: cannot be served")
                continue
            text = f"{phase}: {choice.backend} ({choice.source})"
            if choice.table and len(choice.table.wins()) > 1:
                wins = ", ".join(f"{n} {k}" for n, k in choice.table.wins().items())
                text += f", dispatch over {len(choice.table.buckets)} buckets ({wins})"
            parts.append(text)
        return "; ".join(parts)


def default_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def priority_list(phase: Phase, given: list[str] | tuple[str, ...] | None) -> list[str]:
    """The auto candidates of a phase in order: given names (a list, or one comma-separated string as the CLI
    takes them), or the default list with plugins before torch."""
    if isinstance(given, str):  # iterated, "fa3,torch" would be the names "f", "a", "3", ...
        given = [n.strip() for n in given.split(",") if n.strip()]
    if given:
        for name in given:
            backends.get(name)  # UnknownBackendError lists the valid names
        return list(dict.fromkeys(given))
    default = list(DEFAULT_PRIORITY[phase])
    plugins = [n for n in backends.names() if n not in backends.BUILTINS]
    return default[:-1] + plugins + default[-1:]


def _check_choice(label: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{label} must be one of {', '.join(allowed)}, got {value!r}")


def select(spec: AttentionSpec, prefill: str = AUTO, decode: str = AUTO, *, policy: str = "measure",
           mode: str = "eager", prefill_priority: list[str] | None = None, decode_priority: list[str] | None = None,
           timeout: float | None = None, cache_dir: str | None = None, use_cache: bool = True,
           device: str | None = None, budget_s: float | None = None, canary_every: int | None = None) -> Selection:
    """Pick the backends per phase. ``prefill``/``decode``: "auto" or a backend name (validated, never replaced).

    policy "measure" times every valid candidate of an automatic phase on a grid of shape buckets in ``mode``
    ("eager" launches or CUDA "graph" replays) and keeps a dispatch table: per bucket the fastest (within 1%: the
    earlier in priority order); ``Selection.plan_prefill``/``plan_decode`` then pick the backend from the batch's
    shape. "priority" takes the first valid candidate for every shape; an explicit name serves every shape. In mode
    "graph" every candidate must also be captured and replayed correctly in a CUDA graph. ``budget_s``: seconds of
    bucket timing per selection (default $ATTNSEL_TIMING_BUDGET_S or 50; a tight budget gives a coarser grid).
    With torch.distributed initialised, rank 0 decides and every rank gets the same Selection.
    ``canary_every``: N > 0 recomputes one planned batch in N (per phase and backend) by the float32 reference while
    serving and demotes a backend that fails the check (module canary; the Selection's ``canary``); 0 off; None
    reads $ATTNSEL_CANARY (default off).
    Raises UnknownBackendError/ValueError for bad names and SelectionError when a phase cannot be served (its
    ``selection`` attribute holds what was found).
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an attnsel.AttentionSpec, got {type(spec).__name__} (AttentionSpec.from_dict "
                        "makes one from a dict)")
    _check_choice("policy", policy, POLICIES)
    _check_choice("mode", mode, MODES)
    for arg, value in (("timeout", timeout), ("budget_s", budget_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"{arg} must be a positive number of seconds or None, got {value!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if timeout is None:
        runner.default_timeout()  # a bad ATTNSEL_VALIDATION_TIMEOUT is an error now, not when a worker starts
    # likewise ATTNSEL_CHECK_TIMEOUT_S (read by every backend's availability check, which turns errors into reasons)
    seconds_from_env(backends.CHECK_TIMEOUT_ENV, backends.DEFAULT_CHECK_TIMEOUT_S)
    # and ATTNSEL_FLASHINFER_WORKSPACE_MB, read only where FlashInfer runs (on a machine without it, never)
    from .backends.flashinfer import workspace_bytes
    workspace_bytes()
    metadata_values.enabled()  # and ATTNSEL_CHECK_METADATA, read at every plan
    every = every_from(canary_every)  # and ATTNSEL_CANARY
    if budget_s is None:
        budget_s = timing.budget_from_env()
    elif not budget_s > 0:
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    device = device or default_device()
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a torch device ({exc})") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but no CUDA device is available")
    if kind == "cuda" and torch.device(device).index is not None and torch.device(device).index >= \
            torch.cuda.device_count():
        raise ValueError(f"device {device!r} was requested but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")
    if kind == "meta":
        raise ValueError("device 'meta' holds no data: attnsel validates and times on a real device (cpu, cuda)")
    if kind not in ("cpu", "cuda"):  # xpu, mps, ...: the torch backend may serve them, when torch can use them
        available = getattr(getattr(torch, kind, None), "is_available", None)
        if available is None or not available():
            raise ValueError(f"device {device!r} was requested but torch cannot use {kind} devices on this machine")
    choices = {"prefill": prefill, "decode": decode}
    for choice in choices.values():
        if choice != AUTO:
            backends.get(choice)
    orders = {"prefill": priority_list("prefill", prefill_priority),
              "decode": priority_list("decode", decode_priority)}
    # What decides the answer; timeout, budget and cache only shape rank 0's work (each rank may set its own).
    question = {"spec": spec, "prefill": prefill, "decode": decode, "prefill_priority": orders["prefill"],
                "decode_priority": orders["decode"], "policy": policy, "mode": mode, "device": device_kind(device)}
    selection = agree(lambda: _select(spec, choices, orders, policy, mode, timeout, cache_dir, use_cache, device,
                                      budget_s), question)
    if not every:
        return selection
    canary = Canary(every, spec, fingerprint=selection.device, device=device,
                    cache=ResultCache(cache_dir) if use_cache else None)  # per process: each rank its own
    return dataclasses.replace(selection, canary=canary)


def table_key(fp: dict, spec: AttentionSpec, phase: str, mode: str, candidates: list[tuple[str, str | None]]) -> str:
    """Cache key of a phase's dispatch table: device, spec, phase, mode, the timed candidates with their versions (in
    priority order) and the bucket grid's version."""
    blob = json.dumps({"kind": "dispatch", "device": fp, "spec": spec.to_dict(), "phase": phase, "mode": mode,
                       "candidates": candidates, "grid_version": timing.GRID_VERSION}, sort_keys=True)
    return "dispatch-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def _usable(entry: dict, mode: str) -> bool:
    """A validation entry that lets the candidate serve in this mode (graph: also captured and replayed)."""
    return entry["status"] == "valid" and (mode != "graph" or entry.get("graph_capture") == "ok")


def _outliers(spec: AttentionSpec, errors: dict[str, float | None]) -> dict[str, str]:
    """name -> reason for the valid candidates of one phase (``errors``: name -> max abs error, None when unknown)
    whose error is far above the best's (yardstick.py's cross-candidate rule)."""
    from .validate.yardstick import outlier_reason

    known = {n: e for n, e in errors.items() if e is not None}
    if len(known) < 2:
        return {}
    best = min(known.values())
    return {n: r for n, e in known.items() if (r := outlier_reason(e, best, spec))}


def _reject_outliers(spec: AttentionSpec, names: dict, found: dict) -> None:
    """Reject a valid candidate whose error is far above the best valid candidate's on the same case (yardstick.py's
    cross-candidate rule). Applied on every selection, never cached: it depends on which candidates ran."""
    for phase in PHASES:
        valid = {n: found[(n, phase)].max_abs_err for n in names[phase]
                 if (n, phase) in found and found[(n, phase)].status == "valid"}
        for name, reason in _outliers(spec, valid).items():
            log.warning("%s %s: rejected: %s", name, phase, reason)
            found[(name, phase)].status, found[(name, phase)].reason = "rejected", reason


def _select(spec: AttentionSpec, choices: dict, orders: dict, policy: str, mode: str, timeout: float | None,
            cache_dir: str | None, use_cache: bool, device: str, budget_s: float) -> Selection:
    fp = fingerprint(device)
    names = {p: [choices[p]] if choices[p] != AUTO else orders[p] for p in PHASES}
    if mode == "graph" and not device.startswith("cuda"):
        raise ValueError("mode 'graph' needs a CUDA device (CUDA graphs); use mode 'eager' on the CPU")
    found: dict[tuple[str, str], Candidate] = {}
    keys: dict[tuple[str, str], str] = {}
    versions: dict[tuple[str, str], dict | None] = {}
    for phase in PHASES:
        for name in names[phase]:
            backend = backends.get(name)
            reason, identity = backends.availability(backend, spec, phase, torch.device(device))
            stale = backends.graph_stale_reason(backend, phase) if mode == "graph" and not reason else None
            if stale:
                reason = f"cannot serve CUDA-graph replays: {stale}"
            if reason:
                found[(name, phase)] = Candidate(name, "unavailable", reason)
            else:
                versions[(name, phase)] = identity
                keys[(name, phase)] = entry_key(fp, spec.to_dict(), name, identity, phase)
    # A dispatch table is timed where an automatic choice has more than one runnable candidate.
    timed = [p for p in PHASES if policy == "measure" and choices[p] == AUTO
             and sum((n, p) in keys for n in names[p]) > 1]
    cache = ResultCache(cache_dir) if use_cache else None
    if cache is not None:
        cache.prepare()
    cached = cache.get_many(list(keys.values())) if cache else {}
    todo = [t for t in keys if keys[t] not in cached
            or (mode == "graph" and cached[keys[t]]["status"] == "valid" and "graph_capture" not in cached[keys[t]])]

    def valid_names(phase: str, entries: dict) -> list[str]:
        return [n for n in names[phase] if (n, phase) in keys and keys[(n, phase)] in entries
                and _usable(entries[keys[(n, phase)]], mode)]

    measured: dict[str, dict] = {}
    tkeys: dict[str, str] = {}
    to_time = []
    for phase in timed:
        if any(t[1] == phase for t in todo):
            to_time.append(phase)
            continue
        valid = valid_names(phase, cached)
        if len(valid) - len(_outliers(spec, {n: cached[keys[(n, phase)]].get("max_abs_err") for n in valid})) < 2:
            continue  # one candidate (after the outlier rule, as below): no table to time
        tkeys[phase] = table_key(fp, spec, phase, mode, [(n, versions[(n, phase)]) for n in valid])
        hit = cache.get_many([tkeys[phase]]).get(tkeys[phase]) if cache else None
        # a table the budget cut short (skipped buckets) is timed again when this run's share of the budget is
        # larger than the one it was timed with (null: no limit; an entry from before budgets were stored: unknown)
        cut_short = (hit and hit.get("measured", {}).get("skipped")
                     and ("budget_s" not in hit or hit["budget_s"] is not None
                          and budget_s / len(timed) > hit["budget_s"] * (1 + 1e-9)))
        if hit and hit.get("measured") and not cut_short:
            measured[phase] = hit["measured"]
        else:
            if cut_short:
                log.info("timing %s again: its cached table skipped %d bucket(s) under a budget of %s s, this "
                         "run's share is at least %g s", phase, len(hit["measured"]["skipped"]), hit.get("budget_s"),
                         budget_s / len(timed))
            to_time.append(phase)
    stats = {"spawns": 0, "deaths": 0, "worker_wall_s": 0.0, "worker_peak_rss_mb": None,
             "worker_peak_gpu_mem_mb": None, "timing_wall_s": 0.0}
    fresh: dict[str, dict] = {}
    timing_errors: dict[str, str] = {}

    def work(tasks: list, job: dict) -> dict:
        results, run_stats = runner.run_tasks(spec, tasks, device=device, timeout=timeout, measure=job or False,
                                              mode=mode)
        stats["spawns"] += run_stats.spawns
        stats["deaths"] += run_stats.deaths
        stats["worker_wall_s"] += run_stats.wall_s
        for field, value in (("worker_peak_rss_mb", run_stats.peak_rss_mb),
                             ("worker_peak_gpu_mem_mb", run_stats.peak_gpu_mem_mb)):
            if value is not None:
                stats[field] = max(stats[field] or 0, value)
        for (name, phase), result in results.items():
            if name != timing.TIMING_TASK:
                continue
            if result.get("status") == "timed":
                measured[phase] = result["measured"]
                stats["timing_wall_s"] += result["measured"].get("wall_s") or 0.0
            else:
                timing_errors[phase] = result.get("reason") or "timing produced no result"
                log.warning("timing %s failed: %s", phase, timing_errors[phase])
        return results

    if todo or to_time:
        job = {p: {"backends": [n for n in names[p] if (n, p) in keys],
                   "vouched": [n for n in valid_names(p, cached) if (n, p) not in todo],
                   "budget_s": budget_s / len(to_time),
                   # a phase may inherit what the one before left; it must still end well inside the task timeout
                   "max_budget_s": (timeout or runner.default_timeout()) / 2} for p in to_time}
        results = work(todo + [(timing.TIMING_TASK, p) for p in to_time], job)
        for task, result in results.items():
            if task[0] == timing.TIMING_TASK:
                continue
            entry = {k: v for k, v in result.items() if k not in ("timings_us", "score_us", "timing_error")}
            entry.update(backend=task[0], phase=task[1], spec=spec.to_dict(), device=fp.get("gpu") or "cpu")
            fresh[keys[task]] = entry
        if cache:  # transient rejections (timeouts) are reported, not remembered
            cache.put_many({k: e for k, e in fresh.items() if not e.get("transient")})
    entries = {**cached, **fresh}
    for task, key in keys.items():
        entry = entries[key]
        found[task] = Candidate(task[0], entry["status"], entry.get("reason", ""), entry.get("max_abs_err"),
                                entry.get("tolerance"), entry.get("time_s"), from_cache=key not in fresh)
        if entry["status"] == "valid" and not _usable(entry, mode):
            found[task].status = "rejected"
            found[task].reason = f"cannot serve under CUDA graphs: {entry.get('graph_capture', 'not checked')}"
    _reject_outliers(spec, names, found)

    tables: dict[str, DispatchTable] = {}
    for phase in timed:
        valid = [n for n in names[phase] if (n, phase) in keys and found[(n, phase)].status == "valid"]
        if len(valid) < 2:
            continue
        done = measured.get(phase)
        missing = [n for n in valid if not done or not any(n in b["us"] for b in done["buckets"])]
        if done and missing and not any(n in _bucket_errors(done) for n in missing):
            # validated in a worker that died before the timing job: time the phase again, all vouched for
            log.info("timing %s again: %s were validated by an earlier worker", phase, ", ".join(missing))
            work([(timing.TIMING_TASK, phase)], {phase: {"backends": valid, "vouched": valid,
                                                         "budget_s": budget_s / max(1, len(to_time)),
                                                         "max_budget_s": (timeout or runner.default_timeout()) / 2}})
            done = measured.get(phase)
        if not done:
            continue
        table = build_table(done, valid)
        if table is None:
            timing_errors[phase] = "no candidate was timed in any bucket"
            continue
        tables[phase] = table
        errors = _bucket_errors(done)
        for name in valid:
            cand = found[(name, phase)]
            times = {b.label: b.times_us[name] for b in table.buckets if name in b.times_us}
            cand.timings_us = times or None
            cand.score_us = _geomean(list(times.values())) if times else None
            if name in errors:
                count, first = errors[name]
                cand.reason = f"no time in {count} bucket(s): {first}"
            elif name in dict(table.pruned):
                cand.reason = (f"not timed on the finer grid: at least {dict(table.pruned)[name]:.2f}x the fastest in "
                               f"every coarse bucket (its score covers the coarse buckets only)")
        # keyed like the lookup above: by the candidates valid in the cache, before the outlier rule (applied on
        # every selection from the cached errors); a candidate the rule rejects is timed with the rest and left
        # out of the table by build_table, on this run and the next
        key = table_key(fp, spec, phase, mode, [(n, versions[(n, phase)]) for n in valid_names(phase, entries)])
        # complete: every valid candidate has a time somewhere or its recorded reason for none (a worker that died
        # before the timing job leaves neither: timed again above, not stored)
        complete = all(any(n in b["us"] for b in done["buckets"]) or n in errors for n in valid)
        if cache and complete and phase in to_time and not done.get("transient"):  # out of memory: not a fact
            cache.put_many({key: {"kind": "dispatch", "backend": "(dispatch table)", "phase": phase,
                                  "status": f"{len(table.buckets)} buckets", "mode": mode, "spec": spec.to_dict(),
                                  "device": fp.get("gpu") or "cpu", "candidates": valid,
                                  # the phase's share of the budget (null: no limit), what the lookup compares
                                  "budget_s": share if math.isfinite(share := budget_s / len(to_time)) else None,
                                  "measured": done}})
    for phase in timed:
        if phase in timing_errors:
            for name in names[phase]:
                cand = found.get((name, phase))
                if cand and cand.status == "valid" and not cand.reason and cand.score_us is None:
                    cand.reason = f"not timed: {_one_line(timing_errors[phase])}"

    phases, failures = {}, []
    for phase in PHASES:
        ranked = [found[(n, phase)] for n in names[phase]]
        source: Source = "auto" if choices[phase] == AUTO else "explicit"
        try:
            chosen = _choose(phase, choices[phase], ranked, tables.get(phase))
        except SelectionError as exc:
            failures.append(str(exc))
            phases[phase] = PhaseChoice("", source, ranked, None, str(exc))
            continue
        chosen.status = "selected"
        phases[phase] = PhaseChoice(chosen.name, source, ranked, tables.get(phase))
    selection = Selection(spec, phases, policy, mode,
                          "off" if cache is None else ("miss" if todo or to_time else "hit"), fp, stats)
    if failures:
        raise SelectionError("; ".join(failures), selection)
    log.info("%s", selection.summary())
    return selection


def _one_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _bucket_errors(measured: dict) -> dict[str, tuple[int, str]]:
    """name -> (number of buckets where it got no time, the first reason)."""
    out: dict[str, tuple[int, str]] = {}
    for b in measured["buckets"]:
        for name, reason in b.get("errors", {}).items():
            count, first = out.get(name, (0, f"{b['label']}: {reason}"))
            out[name] = (count + 1, first)
    return out


def _choose(phase: Phase, choice: str, ranked: list[Candidate], table: DispatchTable | None) -> Candidate:
    if choice != AUTO:
        cand = ranked[0]
        if cand.status != "valid":
            raise SelectionError(f"{phase} backend {choice!r} was requested explicitly but is {cand.status}: "
                                 f"{cand.reason}")
        return cand
    valid = [c for c in ranked if c.status == "valid"]
    if not valid:
        detail = "; ".join(f"{c.name}: {c.status}: {_one_line(c.reason)}" for c in ranked)
        raise SelectionError(f"no backend can serve {phase}: {detail}")
    if table is not None:
        return next(c for c in valid if c.name == table.default)
    return valid[0]
