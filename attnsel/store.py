"""What one selection reads from and writes to the result cache: a verdict per candidate (its validation entry) and
a phase's dispatch timings under one typed key (``TableKey``), with the one rule that says when stored timings no
longer serve (``time_again``). The file itself (lock, atomic replace, schema) is cache.py's."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math

from .cache import ResultCache, entry_key
from .spec import AttentionSpec
from .validate import WRONG_OUTPUT, timing

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=True)
class TableKey:
    """What a phase's dispatch timings depend on: the device fingerprint, the spec, the phase, the launch mode, the
    timed candidates in priority order with their identities (version and source hash, ``backends.availability``)
    and the bucket grid's version. The candidates are those valid in the cache before the cross-candidate outlier
    rule, which is applied on every selection from the cached errors (a candidate it rejects is timed with the rest
    and left out of the table by build_table)."""

    device: dict
    spec: AttentionSpec
    phase: str
    mode: str
    candidates: tuple[tuple[str, object], ...]
    grid_version: int = dataclasses.field(default_factory=lambda: timing.GRID_VERSION)

    def text(self) -> str:
        """The key as stored in the cache file."""
        blob = json.dumps({"kind": "dispatch", "device": self.device, "spec": self.spec.to_dict(), "phase": self.phase,
                           "mode": self.mode, "candidates": self.candidates, "grid_version": self.grid_version},
                          sort_keys=True)
        return "dispatch-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def bucket_errors(measured: dict) -> dict[str, tuple[int, str]]:
    """name -> (number of buckets where it got no time, the first reason): it failed there ("errors") or was not
    timed there ("left_out", timing.measure)."""
    out: dict[str, tuple[int, str]] = {}
    for b in measured["buckets"]:
        for name, reason in {**b.get("left_out", {}), **b.get("errors", {})}.items():
            count, first = out.get(name, (0, f"{b['label']}: {reason}"))
            out[name] = (count + 1, first)
    return out


def wrong_outputs(measured: dict) -> dict[str, str]:
    """name -> the first reason, for the candidates that computed a wrong output at some timed shape: they serve no
    shape of the phase (a lookup near a bucket they won could land past the shape where they break)."""
    out: dict[str, str] = {}
    for b in measured["buckets"]:
        for name, reason in b.get("errors", {}).items():
            if reason.startswith(WRONG_OUTPUT):
                out.setdefault(name, f"{b['label']}: {reason}")
    return out


def time_again(timings: dict | None, valid: list[str], share: float) -> str | None:
    """Why a phase's timings cannot serve a selection (stale or incomplete: time again), or None when they serve.

    ``timings``: a stored dispatch entry, or this run's in the same form (``{"measured", "budget_s"}``); ``valid``:
    the candidates the table must cover (after the outlier rule); ``share``: this run's share of the timing budget
    (at least). Incomplete: a valid candidate with neither a time in some bucket nor a recorded reason for none (one
    validated by a worker that died before the timing job). Stale: the budget cut the table short (skipped buckets)
    and this run's share is larger than the one it was timed with (null: no limit; an entry without a recorded
    budget: unknown, so timed again)."""
    measured = (timings or {}).get("measured")
    if not measured:
        return "no timings"
    errors = bucket_errors(measured)
    missing = [n for n in valid if n not in errors and not any(n in b["us"] for b in measured["buckets"])]
    if missing:
        return f"{', '.join(missing)} were validated by an earlier worker (no time, no reason for none)"
    budget = timings.get("budget_s", "unknown")
    if measured.get("skipped") and (budget == "unknown" or budget is not None and share > budget * (1 + 1e-9)):
        return (f"its table skipped {len(measured['skipped'])} bucket(s) under a budget of {budget} s, this run's "
                f"share is at least {share:g} s")
    return None


class Store:
    """The result cache as one selection sees it (device fingerprint, spec and mode fixed); ``use`` False: nothing is
    read or written."""

    def __init__(self, fingerprint: dict, spec: AttentionSpec, mode: str, cache_dir: str | None, use: bool):
        self.fingerprint, self.spec, self.mode = fingerprint, spec, mode
        self.cache = ResultCache(cache_dir) if use else None
        self._unstored = False  # a write failed (warned once)
        if self.cache is not None:
            self.cache.prepare()  # a directory that cannot be one is named before any worker starts

    @property
    def on(self) -> bool:
        return self.cache is not None

    def verdict_key(self, name: str, identity, phase: str) -> str:
        """The key of one candidate's validation entry (cache.entry_key)."""
        return entry_key(self.fingerprint, self.spec.to_dict(), name, identity, phase)

    def table_key(self, phase: str, candidates: list[tuple[str, object]]) -> TableKey:
        return TableKey(self.fingerprint, self.spec, phase, self.mode, tuple(candidates))

    def verdicts(self, keys: list[str]) -> dict[str, dict]:
        return self.cache.get_many(keys) if self.cache is not None else {}

    def put_verdicts(self, entries: dict[str, dict]) -> None:
        """Store validation entries; transient rejections (timeouts, machine faults) are reported, not remembered."""
        if self.cache is not None:
            self._put({k: e for k, e in entries.items() if not e.get("transient")})

    def timings(self, key: TableKey) -> dict | None:
        """The stored dispatch entry of a key, or None."""
        return self.cache.get_many([key.text()]).get(key.text()) if self.cache is not None else None

    def _put(self, entries: dict[str, dict]) -> None:
        """Merge entries into the cache; a write that fails (a full disk, a read-only directory, a lock held past its
        timeout) is a warning, not the selection's failure: what was validated and timed still serves, the next
        selection makes it again."""
        try:
            self.cache.put_many(entries)
        except OSError as exc:  # filelock.Timeout is one
            if not self._unstored:
                self._unstored = True
                log.warning("results could not be stored in the cache %s (%s: %s): this selection serves what it "
                            "found, the next one validates and times it again; free or fix the directory, or give "
                            "another (--cache-dir, $ATTNSEL_CACHE_DIR) or --no-cache", self.cache.dir,
                            type(exc).__name__, exc)

    def put_timings(self, key: TableKey, buckets: int, candidates: list[str], measured: dict,
                    share: float) -> None:
        """Store a phase's timings; ``share``: the phase's share of the budget (recorded as null when unlimited)."""
        if self.cache is None:
            return
        self._put({key.text(): {
            "kind": "dispatch", "backend": "(dispatch table)", "phase": key.phase, "status": f"{buckets} buckets",
            "mode": key.mode, "spec": self.spec.to_dict(), "device": self.fingerprint.get("gpu") or "cpu",
            "candidates": candidates, "budget_s": recorded_share(share), "measured": measured}})


def recorded_share(share: float) -> float | None:
    """A budget share as a dispatch entry records it (null: no limit)."""
    return share if math.isfinite(share) else None


def usable(entry: dict, mode: str) -> bool:
    """A validation entry that lets the candidate serve in this mode (graph: also captured and replayed)."""
    return entry["status"] == "valid" and (mode != "graph" or entry.get("graph_capture") == "ok")


def validate_again(entry: dict | None, mode: str) -> bool:
    """Whether a candidate is validated (again): no stored verdict, or in graph mode a valid one made without the
    CUDA-graph replay check."""
    return entry is None or (mode == "graph" and entry["status"] == "valid" and "graph_capture" not in entry)
