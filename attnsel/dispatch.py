"""The dispatch table: shape bucket -> backend for one phase, from timings. Pure data: built from timing.measure's
result (``build_table``), looked up from host ints (``DispatchTable.backend_for``), printed (``str``), through JSON
and back (``to_json`` / ``from_json``)."""
from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import numbers

from .errors import InvalidArgument
from .validate import timing
from .validate.extend_grid import EXTEND_AXES
from .validate.grid import DECODE_SKEW, ragged_decode_lens

LOOKUP_RULES = ("interpolation", "ragged", "skew", "blend")  # DispatchTable.without's names of the lookup's rules
TIE = 0.01  # measured within 1% of the fastest: priority order decides (a wider band lets a backend 2% slower win a
# bucket by priority, and serve the shapes around it where it is slower still)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One timed bucket of a dispatch table: its representative shape (``key``, on the table's axes), the backend
    chosen there, its time per call, and the runner-up. ``times_us``/``spread`` hold every timed candidate. ``host``:
    the host's speed while it was timed, its probe over the phase's reference (eager on CUDA; timing.host_probe and
    timing.host_reference). ``pruned_near``: candidates not timed here, at least timing.PRUNE times the fastest at
    every coarse bucket around it (eager); lookups count each as timing.PRUNE times this bucket's fastest."""

    key: tuple[int, ...]
    label: str
    backend: str
    us: float
    runner_up: str | None
    runner_up_us: float | None
    times_us: dict[str, float]
    spread: dict[str, float]
    host: float | None = None
    pruned_near: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        near = self.pruned_near
        if not isinstance(near, (list, tuple)) or not all(isinstance(n, str) for n in near):
            raise ValueError(f"bucket {self.label}: pruned_near must be a list of candidate names, got {near!r}")
        if not all(map(_count, self.key)):  # a hand edit (lookups take logs of it; NaN fails every comparison)
            raise ValueError(f"bucket {self.label}: key {self.key!r}: expected one host int >= 0 per axis")
        object.__setattr__(self, "pruned_near", tuple(near))  # a tuple: equal buckets compare equal

    def estimated_us(self) -> dict[str, float]:
        """The usable times (finite numbers > 0) with each ``pruned_near`` candidate at timing.PRUNE times the fastest
        (the least it was at the coarse buckets around); {} without a usable time. Lookups and the headline read
        these."""
        times = {n: t for n, t in self.times_us.items() if _usable(t)}
        return {**{n: timing.PRUNE * min(times.values()) for n in self.pruned_near}, **times} if times else {}

    @property
    def ratio(self) -> float | None:
        """Runner-up time over the chosen backend's time (>= 1 unless the tie band let priority decide)."""
        return self.runner_up_us / self.us if self.runner_up_us and self.us else None

    def to_json(self) -> dict:
        return {"key": list(self.key), "label": self.label, "backend": self.backend, "us": self.us,
                "runner_up": self.runner_up, "runner_up_us": self.runner_up_us, "ratio": self.ratio,
                "times_us": self.times_us, "spread": self.spread, "host": self.host,
                **({"pruned_near": list(self.pruned_near)} if self.pruned_near else {})}

    @classmethod
    def from_json(cls, data: dict) -> "Bucket":
        return cls(tuple(data["key"]), data["label"], data["backend"], data["us"], data.get("runner_up"),
                   data.get("runner_up_us"), dict(data.get("times_us", {})), dict(data.get("spread", {})),
                   data.get("host"), data.get("pruned_near", ()))


_MISSING = object()


def _log2(x: float) -> float:
    return math.log2(max(x, 1))


def _count(x) -> bool:  # a host int >= 0 (numpy's too): not a bool, a float or a tensor (reading one: a sync)
    return (type(x) is int or isinstance(x, numbers.Integral) and not isinstance(x, bool)) and x >= 0  # int: fast


def _usable(t) -> bool:  # a time a lookup can use: a finite number > 0 (not a bool, NaN, inf or text)
    return isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf


@dataclasses.dataclass(frozen=True)
class DispatchTable:
    """Shape bucket -> backend for one phase, from timings (policy "measure" with an automatic choice).

    Axes: prefill ("num_seqs", "total_tokens", "longest"); decode ("batch", "context") in eager mode, ("batch",) in
    graph mode (an engine captures one graph per batch size and replays it at every context length, so the backend
    there is the one best over the timed contexts and ragged batches: least geometric-mean time). Lookups work on a
    shape's ``point``: its key, except prefill's, which is (total_tokens / longest, longest): the timed uniform batches
    (n x L) form a full grid there, so that interpolation has its corners, and a ragged batch counts as the number
    of its longest prompt that it is worth (on held-out cells it predicted the winner best; see the results file).
    ``cell``: a shape's per-axis bucket index on a log scale (boundaries at the geometric midpoints of timed values,
    clamped); ``bucket_for``: the timed bucket nearest in log space. ``default``: the best single backend overall.

    ``backend_for`` interpolates between timed shapes: where every corner of the box of timed values around a shape
    was timed (per axis the values just below and above it), each candidate's slowdown (log of its time over the
    corner's fastest) is interpolated multilinearly in log space and the least wins (exact ties: the order the table
    was built with), so a backend that wins one corner narrowly and loses badly at the next does not serve the
    shapes between them. A shape past the grid's ends is clamped onto its edge; elsewhere (a corner not timed: a
    hole left by a cap) the nearest bucket serves. scripts/replay_dispatch.py replays recorded benches with these
    rules, each switched off too (``without``).
    """

    phase: str
    mode: str
    axes: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    default: str
    grid_version: int
    skipped: tuple[str, ...] = ()
    wall_s: float | None = None
    pruned: tuple[tuple[str, float], ...] = ()  # (candidate, least ratio to the fastest on the coarse grid): not
    # timed on the finer levels (timing.prune)
    ragged: "DispatchTable | None" = None  # eager decode: the table of the ragged buckets (timing.RAGGED_*), same
    # axes, for batches whose longest row is at least timing.RAGGED_SKEW times their mean context
    interpolate: bool = True  # False: the nearest bucket serves every shape (a lookup option, not stored: ``without``)
    skew: bool = True  # False: a skewed batch goes by its means alone (a lookup option: ``without("skew")``)
    blend: bool = True  # False: a batch the ragged buckets serve goes by them alone (``without("blend")``)

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError(f"a {self.phase} dispatch table needs at least one bucket")
        for n, r in self.pruned:  # a hand edit (the lookups take log(r x a time)); timing.prune's ratios are >= 1
            if not (_usable(r) and r >= 1):
                raise ValueError(f"pruned: candidate {n!r} has ratio {r!r}; expected a finite number >= 1")
        if self.ragged is not None and not (self.phase == self.ragged.phase == "decode"
                                            and self.mode == self.ragged.mode == "eager"
                                            and self.ragged.axes == self.axes == tuple(timing.DECODE_AXES)
                                            and self.ragged.ragged is None):
            raise ValueError(f"ragged buckets form one eager decode sub-table keyed by {timing.DECODE_AXES}, under an "
                             f"eager decode table; got a {self.ragged.mode} {self.ragged.phase} sub-table keyed by "
                             f"{self.ragged.axes}{' with its own sub-table' if self.ragged.ragged else ''} under a "
                             f"{self.mode} {self.phase} table keyed by {self.axes}")
        points = {b.key: tuple(max(x, 1) for x in self.point(b.key)) for b in self.buckets}  # 0 as 1, as lookups
        values = [sorted({p[i] for p in points.values()}) for i in range(len(points[self.buckets[0].key]))]
        bounds = [[math.sqrt(a * b) for a, b in zip(v, v[1:])] for v in values]
        object.__setattr__(self, "_points", points)  # each bucket's point, once: lookups compare with them
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_cells", {})
        by_point = {}  # buckets on one point (hand-made prefill tables) serve as the first, as the nearest's ties
        for b in self.buckets:
            by_point.setdefault(points[b.key], b)
        object.__setattr__(self, "_by_point", by_point)
        usable, slowdowns = {}, {}
        for b in self.buckets:  # a bucket without usable times (hand-made tables) just never takes part
            times = b.estimated_us()
            if times and b.backend not in times or not isinstance(b.backend, str):  # hand edits: the lookups serve it
                raise ValueError(f"bucket {b.label}: its backend {b.backend!r} is no candidate with a usable time "
                                 f"there (times_us: {b.times_us}); a usable time is a finite number > 0")
            if times and by_point[points[b.key]] is b:
                best = min(times.values())
                usable[points[b.key]] = times
                slowdowns[points[b.key]] = {n: math.log(t / best) for n, t in times.items()}
        object.__setattr__(self, "_usable", usable)
        object.__setattr__(self, "_slowdowns", slowdowns)
        object.__setattr__(self, "_picks", {})
        # candidates in the order the tables were built with (bucket winners first): the last tie-break
        # (a candidate only pruned near some buckets takes part in their lookups too)
        named = {n for b in self.buckets for n in (*b.times_us, *b.pruned_near)}
        order = list(dict.fromkeys([b.backend for b in self.buckets] + sorted(named)))
        object.__setattr__(self, "_order", order)
        means = {b.key[0]: b.key[-1] for b in reversed(self.ragged.buckets if self.ragged is not None else ())}
        lens = {n: ragged_decode_lens(n, max(m, 1)) for n, m in sorted(means.items()) if n > 0}  # as timed (grid)
        object.__setattr__(self, "_ragged_skews", [(math.log(n), math.log(max(max(x) * n / sum(x), 1.01)))
                                                   for n, x in lens.items()])  # (log batch, log skew), for _blended

    def _check_key(self, key: tuple[int, ...]) -> None:
        # zip would drop extra values or missing axes silently; NaN passes max() and fails every comparison
        if len(key) != len(self.axes) or not all(map(_count, key)):
            what = "" if len(key) != len(self.axes) else ": one host int >= 0 per axis"
            raise InvalidArgument(f"a {self.phase} dispatch table ({self.mode}) is keyed by ({', '.join(self.axes)}), "
                                  f"got {tuple(key)!r}{what}")

    def point(self, key: tuple[int, ...]) -> tuple[float, ...]:
        """Where a shape sits in the lookup space: its key; for prefill (total_tokens / longest, longest), as a batch
        can hold it: the longest at most the tokens (max_seqlen_q may be an upper bound), the ratio at most the
        sequences (total_q may count padding rows)."""
        if self.phase == "prefill" and len(key) == 3:
            tokens = max(key[1], 1)
            longest = min(max(key[2], 1), tokens)
            return (min(tokens / longest, max(key[0], 1)), longest)
        return tuple(key)

    def cell(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """The per-axis bucket index of a shape's point (log-spaced boundaries, clamped at both ends)."""
        self._check_key(key)
        return tuple(bisect.bisect_right(b, x) for b, x in zip(self._bounds, self.point(key)))

    def bucket_for(self, key: tuple[int, ...]) -> Bucket:
        """The timed bucket that serves a shape given on the table's axes: the one nearest to the shape in log
        space, the shape first clamped per axis to the timed range and rounded to 1/16 octave (nearby shapes share
        one memoised answer; within 1/32 octave of a midpoint the rounding may pick the other side); ties go to
        the earlier bucket (coarse grid first). Measured from the shape itself, not from the centre of its cell: a
        cell whose centre was not timed can be equally near to timed buckets on both sides, while the shape is
        nearer to one of them."""
        self._check_key(key)
        point = tuple(round(16 * _log2(min(max(x, v[0]), v[-1]))) / 16 for x, v in zip(self.point(key), self._values))
        hit = self._cells.get(point)
        if hit is None:
            hit = min(self.buckets, key=lambda b: sum((_log2(x) - p) ** 2 for x, p in zip(self._points[b.key], point)))
            if len(self._cells) >= 4096:  # bounded memo
                self._cells.clear()
            self._cells[point] = hit
        return hit

    def backend_for(self, key: tuple[int, ...], longest: int | None = None) -> str:
        """The backend that serves a shape given on the table's axes (interpolated between timed shapes, see the
        class docstring). Per axis the position between two timed values is rounded to 1/32 of their log distance,
        so that shapes a few tokens apart share one memoised answer. ``longest``: the batch's longest context (exact).
        Decode: for a batch of at least 2 rows whose longest row is at least timing.RAGGED_SKEW times the mean
        (``key[1]``), near a timed ragged bucket (``covers``), the ragged buckets decide (a ragged batch's speed is
        not its mean's uniform batch's: module timing), blended with the uniform ones below their timed skew
        (``_blended``). A skewed batch otherwise (``skewed``: extend from timing.RAGGED_SKEW, eager decode outside
        the ragged buckets from grid.DECODE_SKEW times the mean): ``_skewed``. InvalidArgument for a key entry or
        a ``longest`` (not None) that is not a host int >= 0 (a tensor would be read: a device sync)."""
        self._check_key(key)
        if longest is not None and not _count(longest):
            raise InvalidArgument("longest: expected None or a non-negative Python int (the batch's longest context, "
                                  f"exact), got {longest!r}")
        if self.ragged is not None and longest is not None and self.ragged.covers(key, longest):
            return self._blended(key, longest) if self.blend else self.ragged.backend_for(key)
        if self.skew and longest is not None and self.skewed(key, longest):
            hit = self._skewed(key, longest)
            if hit:
                return hit
        if not self.interpolate:
            return self.bucket_for(key).backend
        sides = self._sides(key)
        hit = self._memo(sides, lambda: self._interpolated(sides))
        # the fallback is looked up from the exact key (bucket_for memoises on its own, finer rounding)
        return hit or self.bucket_for(key).backend

    def _sides(self, key: tuple[int, ...]) -> tuple:
        """Per axis ((value, weight), ...): one entry on a timed value or beyond the ends, else the timed values
        below and above with their weights (the position rounded to 1/32 of their log distance)."""
        sides = []
        for values, x in zip(self._values, self.point(key)):
            x = max(x, 1)
            i = bisect.bisect_left(values, x)
            if i < len(values) and values[i] == x or i == 0 or i == len(values):
                sides.append(((values[min(i, len(values) - 1)], 1.0),))
            else:
                lo, hi = values[i - 1], values[i]
                w = round(32 * (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))) / 32
                sides.append(((lo, 1.0 - w), (hi, w)))
        return tuple(sides)

    def skewed(self, key: tuple[int, ...], longest: int) -> bool:
        """Whether a batch is skewed: at least 2 rows, the longest context at least timing.RAGGED_SKEW (extend:
        requests, mean queries, mean context) or grid.DECODE_SKEW (eager decode: batch, mean context) times the
        mean. Prefill and graph-mode decode (keyed by batch size alone) never are."""
        skew = {EXTEND_AXES: timing.RAGGED_SKEW, tuple(timing.DECODE_AXES): DECODE_SKEW}.get(self.axes)
        return skew is not None and key[0] >= 2 and longest >= skew * max(key[-1], 1)

    def _times(self, key: tuple[int, ...], sides: tuple) -> dict[str, float]:
        """Each candidate's time (us) at a shape (``sides``: its ``_sides``): interpolated multilinearly in log space
        where every corner of the timed box around it was timed, else (or with interpolation off) the nearest
        bucket's. Usable times only (a time of 0 or None in a loaded table takes no part, as in the interpolation)."""
        if self.interpolate:
            corners = [(tuple(v for v, _ in combo), math.prod(w for _, w in combo))
                       for combo in itertools.product(*sides)]
            corners = [(c, w) for c, w in corners if w > 0]
            if all(c in self._usable for c, _ in corners):
                names = set.intersection(*(set(self._usable[c]) for c, _ in corners))
                if names:
                    return {n: math.exp(sum(w * math.log(self._usable[c][n]) for c, w in corners)) for n in names}
        return dict(self._usable.get(self._points[self.bucket_for(key).key], {}))

    def _skewed(self, key: tuple[int, ...], longest: int) -> str | None:
        """A skewed batch: a kernel that does not split a row's keys waits for its longest row, which the uniform
        buckets never timed. Each candidate's estimate is its time at the batch's means plus its time for one row
        of the longest context (extend: with the mean queries): a splitting kernel spreads the long row over the
        GPU (a small term), one that does not runs it in one program per head (a large term; the larger of the two
        alone missed the waves a long row waits behind, see the results file). The least estimate wins."""
        lone = (1, key[1], longest) if self.axes == EXTEND_AXES else (1, longest)
        sides = (self._sides(key), self._sides(lone))
        # with the nearest buckets: where a corner is untimed or interpolation is off, _times reads the nearest
        # bucket, which shapes of one rounded position need not share (either side of a midpoint)
        memo = (*sides, self.bucket_for(key).key, self.bucket_for(lone).key)

        def least() -> str | None:
            even, alone = self._times(key, sides[0]), self._times(lone, sides[1])
            return self._least({n: even[n] + alone[n] for n in set(even) & set(alone)})
        return self._memo(memo, least)

    def _memo(self, key: tuple, compute) -> str | None:
        """The lookup's pick for a memo key (the rounded positions a pick depends on), computed once; bounded."""
        hit = self._picks.get(key, _MISSING)
        if hit is _MISSING:
            if len(self._picks) >= 4096:
                self._picks.clear()
            hit = self._picks[key] = compute()
        return hit

    def _least(self, cost: dict[str, float]) -> str | None:
        """The candidate of least cost (exact ties: the order the table was built with); None for no candidate."""
        return min(cost, key=lambda n: (cost[n], self._order.index(n))) if cost else None

    def _blended(self, key: tuple[int, ...], longest: int) -> str:
        """A batch the ragged buckets serve, timed at one skew (longest row / mean: 3x at 8 rows to 13x at 512), the
        winner moving between uniform and that (results file): slowdowns interpolated by log(skew) / log(timed)."""
        xs, logs = zip(*self._ragged_skews)  # the timed skew at this batch size: interpolated in log batch
        x = min(max(math.log(key[0]), xs[0]), xs[-1])
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)
        timed = logs[i] if xs[i] == x else logs[i - 1] + (logs[i] - logs[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        w = round(32 * min(1.0, (math.log(longest) - math.log(max(key[1], 1))) / timed)) / 32
        if w >= 1:  # as skewed as timed: the ragged buckets alone (their tie band, candidates pruned from the uniform)
            return self.ragged.backend_for(key)
        sides = (self._sides(key), self.ragged._sides(key))
        memo = ("blend", w, *sides, self.bucket_for(key).key, self.ragged.bucket_for(key).key)

        def least() -> str | None:  # slowdowns in logs of times: each side's fastest drops out
            even, skewed = self._times(key, sides[0]), self.ragged._times(key, sides[1])
            # a candidate the finer uniform grid did not time (pruned): its least coarse ratio there
            even = {**{n: r * min(even.values()) for n, r in self.pruned if even and n in self._order}, **even}
            return self._least({n: (1 - w) * math.log(even[n]) + w * math.log(skewed[n])
                                for n in set(even) & set(skewed)})
        return self._memo(memo, least) or self.ragged.backend_for(key)

    def without(self, *rules: str) -> "DispatchTable":
        """This table (and its ragged sub-table) with lookup rules off, to measure what each earns (replay_dispatch):
        "interpolation" (the nearest bucket serves), "skew" (no skewed-batch estimate), "blend" (the ragged sub-table
        alone serves what it covers) or "ragged" (no sub-table, no estimate: a skewed batch goes by its mean)."""
        unknown = [r for r in rules if r not in LOOKUP_RULES]
        if unknown:
            raise ValueError(f"unknown lookup rule(s) {', '.join(map(repr, unknown))}; the rules that can be switched "
                             f"off: {', '.join(LOOKUP_RULES)}")
        ragged = None if "ragged" in rules or self.ragged is None else self.ragged.without(*rules)
        return dataclasses.replace(self, interpolate=self.interpolate and "interpolation" not in rules, ragged=ragged,
                                   skew=self.skew and "ragged" not in rules and "skew" not in rules,
                                   blend=self.blend and "blend" not in rules)

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
            return self._by_point[corners[0][0]].backend
        names = set.intersection(*(set(self._slowdowns[c]) for c, _ in corners))  # none in common: None
        return self._least({n: sum(w * self._slowdowns[c][n] for c, w in corners) for n in names})

    def __str__(self) -> str:
        """The table as text: a line of what it is (phase, mode, axes, default backend, wins, skipped and pruned
        candidates), then one line per timed bucket (its backend, time, runner-up and ratio); the ragged sub-table
        after it."""
        return "\n".join(self._lines(""))

    def _lines(self, kind: str) -> list[str]:
        wins = ", ".join(f"{n} {k}" for n, k in self.wins().items())
        head = (f"{kind}{self.phase} dispatch ({self.mode}) over {' x '.join(self.axes)}: {len(self.buckets)} "
                f"buckets, default {self.default}; wins: {wins}")
        if self.skipped:
            head += f"; skipped: {', '.join(self.skipped)}"
        if self.pruned:
            head += "; pruned: " + ", ".join(f"{n} ({r:.2f}x)" for n, r in self.pruned)
        lines = [head]
        for b in self.buckets:
            runner_up = f" (runner-up {b.runner_up} {b.ratio:.2f}x)" if b.runner_up and b.ratio else ""
            lines.append(f"  {b.label}: {b.backend} {b.us:.1f} us{runner_up}")
        return lines + (self.ragged._lines("ragged ") if self.ragged is not None else [])

    def wins(self) -> dict[str, int]:
        return dict(collections.Counter(b.backend for b in self.buckets))

    def to_json(self) -> dict:
        return {"phase": self.phase, "mode": self.mode, "axes": list(self.axes), "default": self.default,
                "grid_version": self.grid_version, "skipped": list(self.skipped), "wall_s": self.wall_s,
                "pruned": dict(self.pruned), "buckets": [b.to_json() for b in self.buckets],
                "ragged": self.ragged.to_json() if self.ragged is not None else None}

    @classmethod
    def from_json(cls, data: dict) -> "DispatchTable":
        buckets = tuple(Bucket.from_json(b) for b in data["buckets"])
        return cls(data["phase"], data["mode"], tuple(data["axes"]), buckets, data["default"], data["grid_version"],
                   tuple(data.get("skipped", ())), data.get("wall_s"), pruned=tuple(data.get("pruned", {}).items()),
                   ragged=cls.from_json(data["ragged"]) if data.get("ragged") else None)


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
    """A dispatch table from ``timing.measure``'s result (or hand-made timings of the same form). ``order``: the
    candidates in priority order (ties within TIE go to the earlier); ``usable``: the candidates allowed to win
    (default: all in ``order``). Buckets where no usable candidate has a time are dropped; None when nothing is left."""
    usable = set(order) if usable is None else usable
    order = [n for n in order if n in usable]
    phase, mode = measured["phase"], measured["mode"]
    uniform = [b for b in measured["buckets"] if not b.get("ragged")]
    # ragged buckets are timed with every candidate: nothing was pruned near them
    ragged = [{k: v for k, v in b.items() if k not in ("ragged", "pruned_near")} for b in measured["buckets"]
              if b.get("ragged")]
    if ragged and phase == "decode" and mode == "eager":  # the ragged buckets' own table (graph mode: scored with
        # their batch size's uniform buckets, below)
        sub = build_table({**measured, "buckets": ragged, "pruned": {}, "wall_s": None,
                           "skipped": [x for x in measured.get("skipped", ()) if x.startswith("ragged ")]},
                          order, usable)
        table = build_table({**measured, "buckets": uniform,  # ragged labels stay here when no sub-table holds them
                             "skipped": [x for x in measured.get("skipped", ())
                                         if sub is None or not x.startswith("ragged ")]},
                            order, usable)
        # without uniform times there is no table (the ragged buckets alone do not serve uniform batches)
        return dataclasses.replace(table, ragged=sub) if table is not None else None
    graph = phase in ("decode", "extend") and mode == "graph"
    rows = []
    for b in uniform + ([dict(r, ragged=True) for r in ragged] if graph else []):
        times = {n: t for n, t in b["us"].items() if n in usable and t and t > 0}
        if times or graph:  # graph: a shape no candidate ran still bars them all from its batch size (below)
            rows.append((tuple(b["key"]), b["label"], times, b.get("spread", {}), b.get("host"), b.get("ragged")))
    if not rows:
        return None
    axes = tuple(measured["axes"])
    if graph:  # one bucket per batch size, best over its shapes (its ragged batches' too)
        by_batch: dict[int, list] = {}
        for key, label, times, spread, _, is_ragged in rows:  # graph mode: no host probes
            by_batch.setdefault(key[0], []).append((key, times, spread, is_ragged))
        # a candidate left out of a shape (timing.left_out: it would not fit) never serves its batch size, also
        # where no usable candidate has a time on that shape
        unfit: dict[int, set] = {}
        for b in measured["buckets"]:
            unfit.setdefault(b["key"][0], set()).update(b.get("left_out", {}))
        rows = []
        for batch, group in sorted(by_batch.items()):
            names = [n for n in order if n not in unfit.get(batch, ())
                     and all(n in times for _, times, _, _ in group)]
            if not names:  # no candidate was timed at every context of this batch size
                continue
            ctxs = [key[-1] for key, _, _, r in group if not r]  # the context: the last axis (decode and extend)
            means = [key[-1] for key, _, _, r in group if r]
            times = {n: _geomean([t[n] for _, t, _, _ in group]) for n in names}
            spread = {n: max(s.get(n, 0.0) for _, _, s, _ in group) for n in names}
            parts = ([f"ctx {min(ctxs)}-{max(ctxs)}"] if ctxs else []) + (
                [f"ragged mean {', '.join(map(str, means))}"] if means else [])
            rows.append(((batch,), f"batch {batch} ({', '.join(parts)})", times, spread, None))
        axes = axes[:1]
        if not rows:
            return None
    else:
        rows = [row[:5] for row in rows]
    near = {tuple(b["key"]): tuple(n for n in b.get("pruned_near", ()) if n in usable)
            for b in uniform} if mode == "eager" else {}
    buckets = tuple(dataclasses.replace(_make_bucket(key, label, times, spread, order, host),
                                        pruned_near=tuple(n for n in near.get(key, ()) if n not in times))
                    for key, label, times, spread, host in rows)
    # eager: a candidate pruned near a finer bucket (timing.near_coarse) counts there as timing.PRUNE times the
    # bucket's fastest (Bucket.estimated_us): it stays a contender for the headline, which it may well be
    est = [b.estimated_us() for b in buckets]
    everywhere = [n for n in order if all(n in t for t in est)]
    if everywhere:
        default = pick({n: _geomean([t[n] for t in est]) for n in everywhere}, order)
    else:
        wins = collections.Counter(b.backend for b in buckets)
        default = max(order, key=lambda n: (wins.get(n, 0), -order.index(n)))
    return DispatchTable(phase, mode, axes, buckets, default, measured["grid_version"],
                         tuple(measured.get("skipped", ())), measured.get("wall_s"),
                         pruned=tuple((n, r) for n, r in measured.get("pruned", {}).items() if n in usable))

