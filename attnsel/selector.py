"""How a selection is made: every candidate's availability, then in one worker job what the cache lacks (validation,
timing), the dispatch tables, and what is stored. ``decide`` reads as those steps; ``selection.select`` checks the
arguments, agrees across ranks and chooses each phase's backend from the ``Outcome``."""
from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch

from . import backends
from .backends import PHASES, Phase
from .device import fingerprint
from .dispatch import DispatchTable, _geomean, build_table
from .errors import InvalidArgument
from .spec import AttentionSpec
from .store import (Store, TableKey, bucket_errors, recorded_share, time_again, usable, validate_again,
                    wrong_outputs)
from .validate import runner, timing

log = logging.getLogger(__name__)

Status = Literal["selected", "valid", "rejected", "unavailable"]


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


@dataclasses.dataclass
class Outcome:
    """What a selection found: each candidate's verdict by (name, phase), the dispatch table of each timed phase,
    the worker statistics, whether the cache served it all, and the device fingerprint."""

    found: dict[tuple[str, Phase], Candidate]
    tables: dict[Phase, DispatchTable]
    stats: dict
    cache: Literal["hit", "miss", "off"]
    fingerprint: dict


def decide(spec: AttentionSpec, names: dict[Phase, list[str]], measure: dict[Phase, bool], mode: str,
           timeout: float | None, cache_dir: str | None, use_cache: bool, device: str, budget_s: float) -> Outcome:
    """Validate, time, build the tables, store. ``names``: each phase's candidates in priority order; ``measure``:
    the phases whose automatic choice is timed (a table is timed where such a phase has more than one runnable
    candidate)."""
    if mode == "graph" and not device.startswith("cuda"):
        raise InvalidArgument("mode 'graph' needs a CUDA device (CUDA graphs); use mode 'eager' on the CPU")
    fp = fingerprint(device)
    run = _Run(spec, names, mode, device, timeout, budget_s, Store(fp, spec, mode, cache_dir, use_cache))
    timed = [p for p in PHASES if measure[p] and len(run.runnable(p)) > 1]
    to_time = run.phases_to_time(timed)  # a candidate to validate, or stored timings that do not serve
    if run.todo or to_time:
        run.validate_and_time(to_time)  # one worker job: the verdicts and timings the cache lacks
    run.judge()  # the candidates from their verdicts, then the cross-candidate outlier rule
    tables = {p: t for p in timed if (t := run.table(p, to_time)) is not None}  # stored when complete
    run.note_untimed(timed)
    cache = "off" if not run.store.on else "miss" if run.todo or to_time else "hit"
    return Outcome(run.found, tables, run.jobs.stats, cache, fp)


def one_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


class _Run:
    """One selection while it is made: the runnable candidates' verdict keys and identities, their verdicts (cached,
    then fresh), the timings per phase (``{"measured", "budget_s"}``: stored, or made by this run)."""

    def __init__(self, spec: AttentionSpec, names: dict, mode: str, device: str, timeout: float | None,
                 budget_s: float, store: Store):
        self.spec, self.names, self.mode, self.budget_s, self.store = spec, names, mode, budget_s, store
        self.timeout = timeout
        self.found: dict[tuple[str, Phase], Candidate] = {}
        self.identity: dict[tuple[str, Phase], object] = {}
        for phase in PHASES:
            for name in names[phase]:
                reason, identity = backends.availability_in(backends.get(name), spec, phase, mode,
                                                            torch.device(device))
                if reason:
                    self.found[(name, phase)] = Candidate(name, "unavailable", reason)
                else:
                    self.identity[(name, phase)] = identity
        self.keys = {t: store.verdict_key(t[0], identity, t[1]) for t, identity in self.identity.items()}
        self.entries = store.verdicts(list(self.keys.values()))
        self.fresh: set[str] = set()
        self.todo = [t for t in self.keys if validate_again(self.entries.get(self.keys[t]), mode)]
        self.timings: dict[Phase, dict] = {}
        self.table_keys: dict[Phase, TableKey] = {}
        self.jobs = _Jobs(spec, device, timeout, mode)

    def runnable(self, phase: Phase) -> list[str]:
        return [n for n in self.names[phase] if (n, phase) in self.keys]

    def valid_names(self, phase: Phase) -> list[str]:
        """The phase's candidates whose verdict lets them serve in this mode (before the outlier rule)."""
        return [n for n in self.runnable(phase) if self.keys[(n, phase)] in self.entries
                and usable(self.entries[self.keys[(n, phase)]], self.mode)]

    def table_key(self, phase: Phase) -> TableKey:
        """The phase's TableKey, from the candidates valid in the cache (made once: a phase without a candidate to
        validate gets no new verdicts, one with some asks only after they are in)."""
        if phase not in self.table_keys:
            self.table_keys[phase] = self.store.table_key(
                phase, [(n, self.identity[(n, phase)]) for n in self.valid_names(phase)])
        return self.table_keys[phase]

    def phases_to_time(self, timed: list[Phase]) -> list[Phase]:
        """The timed phases this run times: those with a candidate to validate, and those whose stored timings do not
        serve (store.time_again); the others keep their stored timings."""
        to_time = []
        for phase in timed:
            if any(p == phase for _, p in self.todo):
                to_time.append(phase)
                continue
            valid = self.valid_names(phase)
            outliers = _outliers(self.spec, {n: self.entries[self.keys[(n, phase)]].get("max_abs_err") for n in valid})
            kept = [n for n in valid if n not in outliers]
            if len(kept) < 2:
                continue  # one candidate after the outlier rule: no table to time
            stored = self.store.timings(self.table_key(phase))
            why = time_again(stored, kept, self.budget_s / len(timed))  # at least this run's share
            if why is None:
                self.timings[phase] = stored
            else:
                if stored is not None:
                    log.info("timing %s again: %s", phase, why)
                to_time.append(phase)
        return to_time

    def validate_and_time(self, to_time: list[Phase]) -> None:
        """One worker job: the candidates to validate and the phases to time; the new verdicts are stored."""
        share = self.budget_s / len(to_time) if to_time else 0.0
        job = {p: self._timing_job(self.runnable(p), [n for n in self.valid_names(p) if (n, p) not in self.todo],
                                   share) for p in to_time}
        results = self.jobs.run(self.todo + [(timing.TIMING_TASK, p) for p in to_time], job)
        fresh = {}
        for task, result in results.items():
            if task[0] == timing.TIMING_TASK:
                continue
            entry = {k: v for k, v in result.items() if k not in ("timings_us", "score_us", "timing_error")}
            entry.update(backend=task[0], phase=task[1], spec=self.spec.to_dict(),
                         device=self.store.fingerprint.get("gpu") or "cpu")
            fresh[self.keys[task]] = entry
        self.store.put_verdicts(fresh)
        self.entries.update(fresh)
        self.fresh = set(fresh)
        self._take_timings(to_time, share)

    def _timing_job(self, names: list[str], vouched: list[str], share: float) -> dict:
        # a phase may inherit what the one before left; it must still end well inside the task timeout
        return {"backends": names, "vouched": vouched, "budget_s": share,
                "max_budget_s": (self.timeout or runner.default_timeout()) / 2}

    def _take_timings(self, phases: list[Phase], share: float) -> None:
        for phase in phases:
            if phase in self.jobs.measured:
                self.timings[phase] = {"measured": self.jobs.measured[phase], "budget_s": recorded_share(share)}

    def judge(self) -> None:
        """Every runnable candidate from its verdict (graph mode: valid ones that failed the replay check are
        rejected), then the cross-candidate outlier rule."""
        for task, key in self.keys.items():
            entry = self.entries[key]
            cand = Candidate(task[0], entry["status"], entry.get("reason", ""), entry.get("max_abs_err"),
                             entry.get("tolerance"), entry.get("time_s"), from_cache=key not in self.fresh)
            if entry["status"] == "valid" and not usable(entry, self.mode):
                cand.status = "rejected"
                cand.reason = f"cannot serve under CUDA graphs: {entry.get('graph_capture', 'not checked')}"
            self.found[task] = cand
        for phase in PHASES:
            valid = {n: self.found[(n, phase)].max_abs_err for n in self.runnable(phase)
                     if self.found[(n, phase)].status == "valid"}
            for name, reason in _outliers(self.spec, valid).items():
                log.warning("%s %s: rejected: %s", name, phase, reason)
                self.found[(name, phase)].status, self.found[(name, phase)].reason = "rejected", reason

    def table(self, phase: Phase, to_time: list[Phase]) -> DispatchTable | None:
        """The phase's dispatch table over its valid candidates, timed once more when this run's timings are
        incomplete (store.time_again), stored when this run timed it and it is complete."""
        valid = [n for n in self.runnable(phase) if self.found[(n, phase)].status == "valid"]
        if len(valid) < 2:
            return None
        share = self.budget_s / max(1, len(to_time))
        if phase in to_time and phase in self.timings and (why := time_again(self.timings[phase], valid, share)):
            log.info("timing %s again: %s", phase, why)
            self.jobs.run([(timing.TIMING_TASK, phase)], {phase: self._timing_job(valid, valid, share)})
            self._take_timings([phase], share)
        if phase not in self.timings:
            return None
        done = self.timings[phase]["measured"]
        garbage = wrong_outputs(done)
        table = build_table(done, valid, set(valid) - set(garbage))
        if table is None:
            failed = bucket_errors(done)
            self.jobs.errors[phase] = ("no candidate has a time on every shape of any bucket; first failure: "
                                       + next(iter(failed.values()))[1] if failed
                                       else "no candidate was timed in any bucket")
            # those that computed garbage are rejected with the reason (the others: not timed, note_untimed)
            _annotate(self.found, phase, list(garbage), None, {}, None, garbage)
            return None
        _annotate(self.found, phase, valid, table, bucket_errors(done), done.get("pruned_near") or {}, garbage)
        if phase in to_time and not done.get("transient") and time_again(self.timings[phase], valid, share) is None:
            self.store.put_timings(self.table_key(phase), len(table.buckets), valid, done, share)
        return table

    def note_untimed(self, timed: list[Phase]) -> None:
        """A valid candidate of a phase whose timing failed says so."""
        for phase in timed:
            if phase in self.jobs.errors:
                for name in self.names[phase]:
                    cand = self.found.get((name, phase))
                    if cand and cand.status == "valid" and not cand.reason and cand.score_us is None:
                        cand.reason = f"not timed: {one_line(self.jobs.errors[phase])}"


class _Jobs:
    """The worker runs of one selection: their statistics, the timings they made and the phases whose timing
    failed."""

    def __init__(self, spec: AttentionSpec, device: str, timeout: float | None, mode: str):
        self.spec, self.device, self.timeout, self.mode = spec, device, timeout, mode
        self.stats = {"spawns": 0, "deaths": 0, "worker_wall_s": 0.0, "worker_peak_rss_mb": None,
                      "worker_peak_gpu_mem_mb": None, "timing_wall_s": 0.0}
        self.measured: dict[Phase, dict] = {}
        self.errors: dict[Phase, str] = {}

    def run(self, tasks: list, job: dict) -> dict:
        results, run_stats = runner.run_tasks(self.spec, tasks, device=self.device, timeout=self.timeout,
                                              measure=job or False, mode=self.mode)
        self.stats["spawns"] += run_stats.spawns
        self.stats["deaths"] += run_stats.deaths
        self.stats["worker_wall_s"] += run_stats.wall_s
        for field, value in (("worker_peak_rss_mb", run_stats.peak_rss_mb),
                             ("worker_peak_gpu_mem_mb", run_stats.peak_gpu_mem_mb)):
            if value is not None:
                self.stats[field] = max(self.stats[field] or 0, value)
        for (name, phase), result in results.items():
            if name != timing.TIMING_TASK:
                continue
            if result.get("status") == "timed":
                self.measured[phase] = result["measured"]
                self.stats["timing_wall_s"] += result["measured"].get("wall_s") or 0.0
            else:
                self.errors[phase] = result.get("reason") or "timing produced no result"
                log.warning("timing %s failed: %s", phase, self.errors[phase])
        return results


def _annotate(found: dict, phase: Phase, valid: list[str], table: DispatchTable | None, errors: dict,
              pruned_near: dict | None = None, garbage: dict | None = None) -> None:
    """Each valid candidate's times per bucket, its score, and why it has no time somewhere or was pruned
    (``pruned_near``: timing.measure's count of the finer buckets that skipped each candidate), or serves nothing
    (``garbage``: store.wrong_outputs)."""
    pruned = dict(table.pruned) if table is not None else {}
    for name in valid:
        cand = found[(name, phase)]
        times = {b.label: b.times_us[name] for b in table.buckets if name in b.times_us} if table is not None else {}
        cand.timings_us = times or None
        cand.score_us = _geomean(list(times.values())) if times else None
        if name in (garbage or {}):  # rejected: without a table the first valid candidate would serve
            cand.status = "rejected"
            cand.reason = f"computed a wrong output at a timed shape, so it serves no {phase} batch: {garbage[name]}"
        elif name in errors:
            count, first = errors[name]
            cand.reason = f"no time in {count} bucket(s): {first}"
        elif name in pruned:
            cand.reason = (f"not timed on the finer grid: at least {pruned[name]:.2f}x the fastest in every coarse "
                           f"bucket (its score covers the coarse buckets only)")
        elif (pruned_near or {}).get(name):
            cand.reason = (f"not timed in {pruned_near[name]} finer bucket(s): at least {timing.PRUNE:.2f}x the "
                           f"fastest in every coarse bucket near them (its score covers the buckets it was timed in)")


def _outliers(spec: AttentionSpec, errors: dict[str, float | None]) -> dict[str, str]:
    """name -> reason for the valid candidates of one phase (``errors``: name -> max abs error, None when unknown)
    whose error is far above the best's (cases.py's cross-candidate rule). Applied on every selection, never
    cached: it depends on which candidates ran."""
    from .validate.yardstick import outlier_reason

    known = {n: e for n, e in errors.items() if e is not None}
    if len(known) < 2:
        return {}
    best = min(known.values())
    return {n: r for n, e in known.items() if (r := outlier_reason(e, best, spec))}
