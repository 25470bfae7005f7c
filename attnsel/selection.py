"""Selection: the chosen backend per phase and the object engines hold (plan_prefill / plan_decode pick a phase's
backend per batch and return its run function); ``select`` checks its arguments, has rank 0 make the selection
(selector.py: validate, time, build the dispatch tables, store) and chooses each phase's backend."""
from __future__ import annotations

import dataclasses
import logging
import numbers
import sys
from typing import Literal

import torch

from . import backends, metadata_values, selector
from .backends import PHASES, Phase, RunFn
from .cache import ResultCache
from .canary import Canary, every_from, shape_text
from .device import kind as device_kind
from .dispatch import DispatchTable, build_table  # noqa: F401 (build_table: importable from here)
from .dist import agree, several_ranks
from .errors import AttnselError, CannotRun, InvalidArgument
from .priority import identities, priority_list
from .run_checks import (
    _host_int,
    _pages_checked,
    check_decode_metadata,
    check_extend_metadata,
    check_longest,
    check_prefill_metadata,
    checked_decode,
    checked_extend,
    checked_prefill,
    planned,
    viewed_b1hd,
)
from .selector import Candidate, one_line
from .validate.extend_grid import extend_key
from .settings import Settings
from .spec import AttentionSpec

log = logging.getLogger(__name__)

AUTO = "auto"
POLICIES = ("measure", "priority")
MODES = ("eager", "graph")


class SelectionError(AttnselError, RuntimeError):
    """No backend can serve a phase, or an explicitly requested backend is unavailable or failed validation.
    ``selection``: what was found (every candidate, the phases that can be served), for reports; may be None."""

    def __init__(self, message: str, selection: "Selection | None" = None):
        super().__init__(message)
        self.selection = selection

    def __reduce__(self):  # keeps the selection when rank 0 broadcasts the error
        return (type(self), (str(self), self.selection))


Source = Literal["auto", "explicit"]


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
    def extend(self) -> str:
        return self.phases["extend"].backend

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

    def extend_backend_for(self, requests: int, q_len: int, context: int, longest: int | None = None) -> str:
        """The backend that serves an extend batch of this shape (mean query tokens and mean context per request;
        ``longest``: the longest row's context, which decides for a skewed batch, see DispatchTable.backend_for;
        mode "graph": the number of requests alone decides)."""
        table = self.phases["extend"].table
        if table is None:
            return self.extend
        if len(table.axes) == 1:
            return table.backend_for((requests,))
        return table.backend_for((requests, q_len, context), longest)

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
                raise InvalidArgument(f"{arg}: expected None or a non-negative Python int (the rows of "
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
        shape = lambda: shape_text("prefill", (n, tokens, max_seqlen_q), None)  # noqa: E731 (formatted on failure)
        run = planned("prefill", name, self.phases["prefill"].source, shape, backends.get(name).plan_prefill,
                      self.spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if sample is not None:
            run = sample.wrap(run, (cu_seqlens_q, cu_seqlens_k))
        if not checked:
            return run
        return checked_prefill(run, self.spec, cu_seqlens_q.get_device(), total_q, total_k, seen)

    def plan_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None,
                    context_tokens: int | None = None, *, longest: int | None = None, q_layout: str = "bhd",
                    checked: bool = True) -> RunFn:
        """Plan a paged decode batch on the backend its shape dispatches to; returns ``run(q, k_cache, v_cache)``
        (shapes: backends.Backend). No device sync: the bucket is (batch = ``seq_lens.shape[0]``, context) from host
        ints: context is the batch's mean context ceil(``context_tokens`` / batch) when ``context_tokens`` (the context
        tokens summed over the batch) is given: a decode's time follows the tokens it reads (keyed by its longest row, a
        ragged batch can be served by a backend twice as slow as the fastest); with ``longest`` too (the batch's longest
        context, exact: ``max_seq_len`` may be a bound; read only with ``context_tokens``; checked against seq_lens
        under ATTNSEL_CHECK_METADATA=1; InvalidArgument above ``max_seq_len`` or the page table's reach, or below the
        mean), a batch whose longest row is at least timing.RAGGED_SKEW times the mean is served by the eager table's
        ragged buckets where it has them, and one from grid.DECODE_SKEW times the mean elsewhere by its mean plus its
        longest row alone (DispatchTable.backend_for: which backend is fastest on rows of very different lengths is
        not what the uniform batch of the mean says); else ``max_seq_len``;
        else ``page_table.shape[1] * page_size``, the longest context the table can hold (an overestimate when the table
        is wider than needed: pass one of them). In mode "graph" only the batch size matters. The run function checks q
        and the caches against the spec and raises ValueError naming the argument. It owns the plan's device buffers:
        keep it alive as long as any CUDA graph that captured it may be replayed (a graph holds device pointers only; a
        freed plan's memory goes to the next allocation). ``q_layout="b1hd"``: the run takes q and returns out as
        FlashAttention's ``[batch, 1, heads, head_dim]`` (no views where the backend takes that layout itself: FA3,
        Triton). ``checked=False``: no checks of q and the caches per call, for a caller that makes them itself (the
        FA-compatible functions): the backend's run function itself, or in "b1hd" for a backend without that layout, the
        run between two views."""
        if q_layout not in ("bhd", "b1hd"):
            raise InvalidArgument(f"q_layout: expected 'bhd' ([batch, heads, head_dim]) or 'b1hd' ([batch, 1, "
                                  f"heads, head_dim]), got {q_layout!r}")
        check_decode_metadata(page_table, seq_lens, max_seq_len)
        if longest is not None and (not _host_int(longest) or longest < 0):
            raise InvalidArgument("longest: expected None or a non-negative Python int (the batch's longest "
                                  f"context, exact), got {longest!r}")
        if longest is not None:  # host ints that contradict each other: one of them is wrong
            check_longest(longest, max_seq_len, page_table.shape[1], self.spec.page_size, seq_lens.shape[0],
                          context_tokens, "rows")
        pages_needed = (metadata_values.check_decode(page_table, seq_lens, max_seq_len, self.spec.page_size,
                                                        self.spec.sliding_window, longest)
                        if metadata_values.enabled() else None)  # opt-in: one host copy per plan (see metadata_values)
        batch = seq_lens.shape[0]
        if context_tokens is not None:
            if not _host_int(context_tokens) or context_tokens < 0:
                raise InvalidArgument("context_tokens: expected None or a non-negative Python int (the batch's "
                                      f"context tokens, summed), got {context_tokens!r}")
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
        shape = lambda: shape_text("decode", (batch, ctx), longest_row)  # noqa: E731 (formatted on failure only)
        run = planned("decode", name, self.phases["decode"].source, shape, backend.plan_decode, self.spec, page_table,
                      seq_lens)
        if sample is not None:
            run = sample.wrap(run, (page_table, seq_lens), longest if longest is not None else max_seq_len)
        b1hd = q_layout == "b1hd"
        if b1hd and not backends.decode_takes_b1hd(backend):
            run = viewed_b1hd(run)
        if not checked:
            return run if pages_needed is None else _pages_checked(run, pages_needed)
        return checked_decode(run, self.spec, seq_lens.get_device(), batch, b1hd, pages_needed)

    def plan_extend(self, cu_seqlens_q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                    max_seqlen_q: int, max_seq_len: int | None = None, total_q: int | None = None,
                    context_tokens: int | None = None, *, longest: int | None = None, checked: bool = True) -> RunFn:
        """Plan ragged queries over the paged cache (chunked prefill over a cached prefix, a prompt-cache hit,
        multi-token decode, speculative verify) on the backend its shape dispatches to; returns ``run(q, k_cache,
        v_cache)`` with q ``[total_q, heads, head_dim]`` (shapes and semantics: backends.Backend, plan_extend).
        ``seq_lens`` counts each row's whole context, its new tokens included (already in the cache). No device
        sync: the bucket is (requests, mean query tokens, mean context) from host ints: ``total_q`` (the batch's
        query tokens; default requests x ``max_seqlen_q``) and ``context_tokens`` (the contexts summed; default
        requests x ``max_seq_len``, else the page table's reach). ``max_seq_len`` bounds every row's context (default:
        what the page table can hold). ``longest``: the longest row's exact context (a host int), which decides for
        a skewed batch (a backend that does not split a row's keys waits for its longest row; see
        DispatchTable.backend_for); unlike ``max_seq_len`` never a loose bound (InvalidArgument past that bound or
        below the mean context; under ATTNSEL_CHECK_METADATA=1, ValueError unless it is max(seq_lens)). The run
        function checks q (its rows against ``total_q`` when given) and the caches against the spec;
        ``checked=False``: the backend's run itself (under ATTNSEL_CHECK_METADATA=1 both also refuse caches with
        fewer pages than the rows read). Keep the run function alive as long as any CUDA graph that captured it may
        be replayed."""
        check_extend_metadata(cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)
        for arg, value, what in (("total_q", total_q, "q's rows: the batch's query tokens, padding included"),
                                 ("context_tokens", context_tokens, "the requests' contexts summed"),
                                 ("longest", longest, "the longest row's exact context")):
            if value is not None and (not _host_int(value) or value < 0):  # a tensor would be read: a device sync
                raise InvalidArgument(f"{arg}: expected None or a non-negative Python int ({what}), got {value!r}")
        requests = seq_lens.shape[0]
        bound = max_seq_len if max_seq_len is not None else page_table.shape[1] * self.spec.page_size
        if longest is not None:  # host ints that contradict each other: one of them is wrong
            check_longest(longest, max_seq_len, page_table.shape[1], self.spec.page_size, requests, context_tokens,
                          "requests")
        pages_needed = (metadata_values.check_extend(cu_seqlens_q, page_table, seq_lens, max_seqlen_q, bound,
                                                     self.spec.page_size, total_q, self.spec.sliding_window, longest)
                        if metadata_values.enabled() else None)  # opt-in: one host copy per plan (see metadata_values)
        tokens = total_q if total_q is not None else requests * max_seqlen_q
        context = context_tokens if context_tokens is not None else requests * bound
        if not self.extend:
            raise SelectionError(f"this selection cannot serve extend (ragged queries over the paged cache): "
                                 f"{self.phases['extend'].error}", self)
        key = extend_key(requests, tokens, context)
        name = self.extend_backend_for(*key, longest)
        sample = None
        if self.canary is not None:  # may demote the pick, may sample this plan (module canary)
            name, sample = self.canary.serve("extend", self.phases["extend"], key, None, name, seq_lens)
        run = planned("extend", name, self.phases["extend"].source, lambda: shape_text("extend", key, None),
                      backends.get(name).plan_extend, self.spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q,
                      bound)
        if sample is not None:
            run = sample.wrap(run, (cu_seqlens_q, page_table, seq_lens), bound)
        if not checked:
            return run if pages_needed is None else _pages_checked(run, pages_needed)
        return checked_extend(run, self.spec, seq_lens.get_device(), total_q, pages_needed)

    def to_json(self) -> dict:
        return {**{p: c.to_json() for p, c in self.phases.items()}, "cache": self.cache, "policy": self.policy,
                "mode": self.mode, "device": self.device, "spec": self.spec.to_dict(), "stats": self.stats,
                "canary": self.canary.report() if self.canary is not None else None}

    def backends_line(self) -> str:
        """The backend per phase in one line ("prefill: fa3, decode: triton, extend: none"), as the integrations
        log their selections."""
        return ", ".join(f"{phase}: {choice.backend or 'none'}" for phase, choice in self.phases.items())

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


def announce(spec: AttentionSpec, device, cache_dir: str | None = None) -> None:
    """One line on stderr before an integration's first selection of a kind of call: it can take seconds (validation
    and timing in a worker) on a cold cache, and an engine's first request would otherwise block in silence."""
    from .cache import ResultCache

    sys.stderr.write(f"attnsel: choosing the attention backends for {spec.describe()} on {device}: validated against "
                     f"a float32 reference and timed, or read from the result cache ({ResultCache(cache_dir).path}); "
                     "once per kind of call\n")


def backend_settings(env: Settings, options: dict) -> dict[str, str]:
    """Each phase's backend from its ATTNSEL_<PHASE>_BACKEND variable ("auto" where unset), as the integrations take
    them; one the options do not override must be "auto" or a registered backend: UnknownBackendError naming the
    variable and the valid values otherwise (the caller passed no name, so a bare "unknown backend" would not say
    where it came from)."""
    from .settings import ENV

    chosen = {p: getattr(env, f"{p}_backend") for p in PHASES}
    for phase, value in chosen.items():
        if phase not in options and value != AUTO and value not in backends.names():
            raise backends.UnknownBackendError(
                f"{ENV[f'{phase}_backend']}={value!r} (environment variable): unknown backend; expected "
                f"{', '.join([repr(AUTO)] + backends.names())}")
    return chosen


def default_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _check_choice(label: str, value: str, allowed) -> None:
    if value not in allowed:
        raise InvalidArgument(f"{label} must be one of {', '.join(allowed)}, got {value!r}")


def select(spec: AttentionSpec, prefill: str = AUTO, decode: str = AUTO, extend: str = AUTO, *,
           policy: str = "measure", mode: str = "eager", prefill_priority: list[str] | None = None,
           decode_priority: list[str] | None = None, extend_priority: list[str] | None = None,
           timeout: float | None = None, cache_dir: str | None = None, use_cache: bool = True,
           device: str | None = None, budget_s: float | None = None, canary_every: int | None = None) -> Selection:
    """Pick the backends per phase. ``prefill``/``decode``/``extend``: "auto" or a backend name (validated, never
    replaced). extend: ragged queries over the paged cache (Selection.plan_extend).

    policy "measure" times every valid candidate of an automatic phase on a grid of shape buckets in ``mode``
    ("eager" launches or CUDA "graph" replays) and keeps a dispatch table: per bucket the fastest (within 1%: the
    earlier in priority order); ``Selection.plan_prefill``/``plan_decode`` then pick the backend from the batch's
    shape. "priority" takes the first valid candidate for every shape; an explicit name serves every shape. In mode
    "graph" every candidate must also be captured and replayed correctly in a CUDA graph. ``budget_s``: seconds of
    bucket timing per selection (default $ATTNSEL_TIMING_BUDGET_S or 75, shared by the timed phases; a tight budget
    gives a coarser grid).
    With torch.distributed initialised, rank 0 decides and every rank gets the same Selection.
    ``canary_every``: N > 0 recomputes one planned batch in N (per phase and backend) by the float32 reference while
    serving and demotes a backend that fails the check (module canary; the Selection's ``canary``); 0 off; None
    reads $ATTNSEL_CANARY (default off).
    Raises UnknownBackendError for bad names, InvalidArgument (a ValueError) for other bad arguments, SettingsError
    for a bad ATTNSEL_* variable (every one is read here) and SelectionError when a phase cannot be served (its
    ``selection`` attribute holds what was found).
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an attnsel.AttentionSpec, got {type(spec).__name__} (AttentionSpec.from_dict "
                        "makes one from a dict)")
    _check_choice("policy", policy, POLICIES)
    _check_choice("mode", mode, MODES)
    for arg, value in (("timeout", timeout), ("budget_s", budget_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise InvalidArgument(f"{arg} must be a positive number of seconds or None, got {value!r}")
        if value is not None and not value > 0:
            raise InvalidArgument(f"{arg} must be a positive number of seconds, got {value!r}")
    # every ATTNSEL_* variable now, not where it happens to be read (a worker, a FlashInfer plan, a plugin check)
    settings = Settings.from_env()
    budget_s = settings.timing_budget_s if budget_s is None else budget_s
    device = _checked_device(device or default_device())
    every = settings.canary if canary_every is None else every_from(canary_every)
    choices = {"prefill": prefill, "decode": decode, "extend": extend}
    for phase, choice in choices.items():  # None or "" (a server's "default") too: named with what is allowed
        if choice != AUTO and (not isinstance(choice, str) or choice not in backends.names()):
            raise backends.UnknownBackendError(f"{phase}: expected 'auto' or a backend name ("
                                               f"{', '.join(backends.names())}), got {choice!r}")
    given = {"prefill": prefill_priority, "decode": decode_priority, "extend": extend_priority}
    for phase, choice in choices.items():  # the list would be dropped unread
        if choice != AUTO and given[phase] is not None:
            raise InvalidArgument(f"{phase}_priority sets {phase}'s automatic candidates, but {phase}={choice!r} "
                                  "names one backend: give the backend or the list, not both")
    orders = {"prefill": priority_list("prefill", prefill_priority),
              "decode": priority_list("decode", decode_priority),
              "extend": priority_list("extend", extend_priority)}
    # What decides the answer; timeout, budget and cache only shape rank 0's work (each rank may set its own).
    question = {"spec": spec, "prefill": prefill, "decode": decode, "extend": extend,
                "prefill_priority": orders["prefill"], "decode_priority": orders["decode"],
                "extend_priority": orders["extend"], "policy": policy, "mode": mode, "device": device_kind(device)}
    if several_ranks():  # what each name is on this rank: rank 0 validates only its own
        question["backends"] = identities(spec, {p: [c] if c != AUTO else orders[p] for p, c in choices.items()},
                                          mode, device)
    selection = agree(lambda: _decide(spec, choices, orders, policy, mode, timeout, cache_dir, use_cache, device,
                                      budget_s), question)
    if not every:
        return selection
    canary = Canary(every, spec, fingerprint=selection.device, device=device,
                    cache=ResultCache(cache_dir) if use_cache else None)  # per process: each rank its own
    return dataclasses.replace(selection, canary=canary)


def _checked_device(device: str) -> str:
    """The device, when torch can use it here; InvalidArgument naming it when it is none, CannotRun when this machine
    lacks it."""
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise InvalidArgument(f"device {device!r} is not a torch device ({exc})") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise CannotRun(f"device {device!r} was requested but no CUDA device is available")
    if kind == "cuda" and torch.device(device).index is not None and torch.device(device).index >= \
            torch.cuda.device_count():
        raise CannotRun(f"device {device!r} was requested but this machine has {torch.cuda.device_count()} "
                        "CUDA device(s)")
    if kind == "meta":
        raise InvalidArgument("device 'meta' holds no data: attnsel validates and times on a real device (cpu, cuda)")
    if kind not in ("cpu", "cuda"):  # xpu, mps, ...: the torch backend may serve them, when torch can use them
        available = getattr(getattr(torch, kind, None), "is_available", None)
        if available is None or not available():
            raise CannotRun(f"device {device!r} was requested but torch cannot use {kind} devices on this machine")
    return device


def _decide(spec: AttentionSpec, choices: dict, orders: dict, policy: str, mode: str, timeout: float | None,
            cache_dir: str | None, use_cache: bool, device: str, budget_s: float) -> Selection:
    """Rank 0's work: the selector's outcome, then each phase's choice; SelectionError when a phase cannot be
    served."""
    names = {p: [choices[p]] if choices[p] != AUTO else orders[p] for p in PHASES}
    measure = {p: policy == "measure" and choices[p] == AUTO for p in PHASES}
    out = selector.decide(spec, names, measure, mode, timeout, cache_dir, use_cache, device, budget_s)
    phases, failures = {}, []
    for phase in PHASES:
        ranked = [out.found[(n, phase)] for n in names[phase]]
        source: Source = "auto" if choices[phase] == AUTO else "explicit"
        try:
            chosen = _choose(phase, choices[phase], ranked, out.tables.get(phase))
        except SelectionError as exc:
            if phase != "extend" or source == "explicit":  # extend is optional unless asked for by name
                failures.append(str(exc))
            phases[phase] = PhaseChoice("", source, ranked, None, str(exc))
            continue
        chosen.status = "selected"
        phases[phase] = PhaseChoice(chosen.name, source, ranked, out.tables.get(phase))
    selection = Selection(spec, phases, policy, mode, out.cache, out.fingerprint, out.stats)
    if failures:
        raise SelectionError("; ".join(failures), selection)
    log.info("%s", selection.summary())
    return selection


def _choose(phase: Phase, choice: str, ranked: list[Candidate], table: DispatchTable | None) -> Candidate:
    if choice != AUTO:
        cand = ranked[0]
        if cand.status != "valid":
            raise SelectionError(f"{phase} backend {choice!r} was requested explicitly but is {cand.status}: "
                                 f"{cand.reason}")
        return cand
    valid = [c for c in ranked if c.status == "valid"]
    if not valid:
        detail = "; ".join(f"{c.name}: {c.status}: {one_line(c.reason)}" for c in ranked)
        raise SelectionError(f"no backend can serve {phase}: {detail}")
    if table is not None:
        return next(c for c in valid if c.name == table.default)
    return valid[0]
