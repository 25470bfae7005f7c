"""Selection: explicit or automatic backend per phase, validated in a worker, ranked by a policy, cached."""
from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch

from . import backends
from .backends import PHASES, Phase, RunFn
from .cache import ResultCache, entry_key
from .device import fingerprint
from .dist import agree
from .spec import AttentionSpec
from .validate import runner

log = logging.getLogger(__name__)

AUTO = "auto"
POLICIES = ("measure", "priority")
MODES = ("eager", "graph")
TIE = 0.03  # measured within 3% of the fastest: priority order decides
DEFAULT_PRIORITY: dict[str, tuple[str, ...]] = {
    "prefill": ("fa3", "flashinfer", "triton", "torch"),
    "decode": ("flashinfer", "flashinfer_cuda_cores", "fa3", "triton", "torch"),
}


class SelectionError(RuntimeError):
    """No backend can serve a phase, or an explicitly requested backend is unavailable or failed validation."""


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
class PhaseChoice:
    """What was chosen for one phase, how (auto or explicit), and every candidate considered, in priority order."""

    backend: str
    source: Source
    candidates: list[Candidate]

    def to_json(self) -> dict:
        return {"backend": self.backend, "source": self.source, "candidates": [c.to_dict() for c in self.candidates]}


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen backend per phase and everything needed to explain the choice."""

    spec: AttentionSpec
    phases: dict[Phase, PhaseChoice]
    policy: str
    mode: str
    cache: Literal["hit", "miss", "off"]
    device: dict
    stats: dict

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
    def prefill_backend(self) -> backends.Backend:
        return backends.get(self.prefill)

    @property
    def decode_backend(self) -> backends.Backend:
        return backends.get(self.decode)

    def plan_prefill(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int) -> RunFn:
        """Plan a ragged prefill batch on the selected backend; see backends.Backend for shapes."""
        return self.prefill_backend.plan_prefill(self.spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    def plan_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn:
        """Plan a paged decode batch on the selected backend; see backends.Backend for shapes."""
        return self.decode_backend.plan_decode(self.spec, page_table, seq_lens)

    def to_json(self) -> dict:
        return {**{p: c.to_json() for p, c in self.phases.items()}, "cache": self.cache, "policy": self.policy,
                "mode": self.mode, "device": self.device, "spec": self.spec.to_dict(), "stats": self.stats}

    def summary(self) -> str:
        return f"prefill: {self.prefill} ({self.prefill_source}), decode: {self.decode} ({self.decode_source})"


def default_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def priority_list(phase: Phase, given: list[str] | tuple[str, ...] | None) -> list[str]:
    """The auto candidates of a phase in order: given names, or the default list with plugins before torch."""
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
           device: str | None = None) -> Selection:
    """Pick a backend per phase. ``prefill``/``decode``: "auto" or a backend name (validated, never replaced).

    policy "measure" times every valid candidate on workloads from the spec in ``mode`` ("eager" launches or CUDA
    "graph" replays) and takes the fastest (within 3%: the earlier in priority order); "priority" takes the first
    valid one. With torch.distributed initialised, rank 0 decides and every rank gets the same Selection.
    Raises UnknownBackendError/ValueError for bad names and SelectionError when a phase cannot be served.
    """
    _check_choice("policy", policy, POLICIES)
    _check_choice("mode", mode, MODES)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    device = device or default_device()
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a torch device ({exc})") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but no CUDA device is available")
    choices = {"prefill": prefill, "decode": decode}
    for choice in choices.values():
        if choice != AUTO:
            backends.get(choice)
    orders = {"prefill": priority_list("prefill", prefill_priority),
              "decode": priority_list("decode", decode_priority)}
    return agree(lambda: _select(spec, choices, orders, policy, mode, timeout, cache_dir, use_cache, device))


def _select(spec: AttentionSpec, choices: dict, orders: dict, policy: str, mode: str, timeout: float | None,
            cache_dir: str | None, use_cache: bool, device: str) -> Selection:
    fp = fingerprint(device)
    names = {p: [choices[p]] if choices[p] != AUTO else orders[p] for p in PHASES}
    if mode == "graph" and not device.startswith("cuda"):
        raise ValueError("mode 'graph' needs a CUDA device (CUDA graphs); use mode 'eager' on the CPU")
    found: dict[tuple[str, str], Candidate] = {}
    keys: dict[tuple[str, str], str] = {}
    for phase in PHASES:
        for name in names[phase]:
            backend = backends.get(name)
            try:
                reason = backend.unsupported(spec, phase)
            except Exception as exc:
                log.exception("availability check of %s for %s raised", name, phase)
                reason = f"availability check raised {type(exc).__name__}: {exc}"
            if reason:
                found[(name, phase)] = Candidate(name, "unavailable", reason)
            else:
                keys[(name, phase)] = entry_key(fp, spec.to_dict(), name, backends.version_of(backend), phase)
    # Timing is needed where an automatic choice has more than one runnable candidate.
    timed = {p for p in PHASES if policy == "measure" and choices[p] == AUTO
             and sum((n, p) in keys for n in names[p]) > 1}
    cache = ResultCache(cache_dir) if use_cache else None
    cached = cache.get_many(list(keys.values())) if cache else {}

    def usable(task) -> bool:
        entry = cached.get(keys[task])
        if entry is None:
            return False
        return task[1] not in timed or entry["status"] != "valid" or mode in entry.get("timings", {})

    todo = [task for task in keys if not usable(task)]
    stats = {"spawns": 0, "deaths": 0, "worker_wall_s": 0.0, "worker_peak_rss_mb": None,
             "worker_peak_gpu_mem_mb": None}
    fresh: dict[str, dict] = {}
    if todo:
        results, run_stats = runner.run_tasks(spec, todo, device=device, timeout=timeout, measure=bool(timed),
                                              mode=mode)
        stats.update(spawns=run_stats.spawns, deaths=run_stats.deaths, worker_wall_s=run_stats.wall_s,
                     worker_peak_rss_mb=run_stats.peak_rss_mb, worker_peak_gpu_mem_mb=run_stats.peak_gpu_mem_mb)
        for task, result in results.items():
            entry = {k: v for k, v in result.items() if k not in ("timings_us", "score_us", "timing_error")}
            entry.update(backend=task[0], phase=task[1], spec=spec.to_dict(), device=fp.get("gpu") or "cpu")
            if "score_us" in result:
                entry["timings"] = {mode: {"timings_us": result["timings_us"], "score_us": result["score_us"]}}
            elif "timing_error" in result:
                entry["timings"] = {mode: {"error": result["timing_error"]}}
            fresh[keys[task]] = entry
        if cache:  # transient rejections (timeouts) are reported, not remembered
            cache.put_many({k: e for k, e in fresh.items() if not e.get("transient")})
    for task, key in keys.items():
        entry = fresh.get(key) or cached[key]
        timing = entry.get("timings", {}).get(mode, {})
        found[task] = Candidate(task[0], entry["status"], entry.get("reason", ""), entry.get("max_abs_err"),
                                entry.get("tolerance"), entry.get("time_s"), timing.get("score_us"),
                                timing.get("timings_us"), from_cache=key not in fresh)
        if timing.get("error"):
            found[task].reason = timing["error"]

    chosen = {}
    for phase in PHASES:
        ranked = [found[(n, phase)] for n in names[phase]]
        chosen[phase] = _choose(phase, choices[phase], ranked, phase in timed)
        chosen[phase].status = "selected"
    phases = {p: PhaseChoice(chosen[p].name, "auto" if choices[p] == AUTO else "explicit",
                             [found[(n, p)] for n in names[p]]) for p in PHASES}
    selection = Selection(spec, phases, policy, mode, "off" if cache is None else ("miss" if todo else "hit"), fp,
                          stats)
    log.info("%s", selection.summary())
    return selection


def _choose(phase: Phase, choice: str, ranked: list[Candidate], timed: bool) -> Candidate:
    if choice != AUTO:
        cand = ranked[0]
        if cand.status != "valid":
            raise SelectionError(f"{phase} backend {choice!r} was requested explicitly but is {cand.status}: "
                                 f"{cand.reason}")
        return cand
    valid = [c for c in ranked if c.status == "valid"]
    if not valid:
        detail = "; ".join(f"{c.name}: {c.status}: {c.reason}" for c in ranked)
        raise SelectionError(f"no backend can serve {phase}: {detail}")
    scored = [c for c in valid if c.score_us is not None]
    if not timed or not scored:
        return valid[0]
    best = min(c.score_us for c in scored)
    return next(c for c in scored if c.score_us <= best * (1 + TIE))
