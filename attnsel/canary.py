"""Opt-in canary while serving: one planned batch in N, per phase and backend, is recomputed by the float32
reference and judged by the validation's check; a backend that fails it stops serving that bucket in this process.

Why: a kernel can pass validation and still go wrong in service, after many requests or on one batch mix (outputs of
one sequence that change with another's length, NaN after a number of requests). Validation sees neither.

How (``Selection.plan_prefill``/``plan_decode``/``plan_extend`` call ``Canary.serve`` when the Selection holds a
canary):
- sampling is a counter per (phase, backend) over the plans made outside CUDA-graph capture: plans 0, N, 2N, ...
  are sampled (deterministic). A plan made while capturing is neither counted nor sampled; an unsampled plan gets
  the backend's run function unwrapped. A sampled plan's first run (one layer) is copied; its later runs are not.
- the copy is made off the serving stream: on the GPU a side stream waits on an event recorded after the run,
  copies the inputs (q, k/v or the pages the plan's bound covers, the metadata, the feature inputs) and the
  output, and the serving stream waits on the copy's event, so that the engine's next writes into those buffers
  come after it. Nothing is read on the host there: the run makes no host sync.
- the check is read later: each plan (and ``poll``/``report``) advances the sampled batches whose side-stream work
  is done (an event query, never a wait): first the reference is launched on the side stream (its metadata read on
  the host from the finished copies), then, once it is done, ``cases.check_output`` judges the output. On the CPU
  the same steps run at the next plan without waiting for anything. Each output row (a query token, all heads) is
  judged as in validation; extend rows past the batch's queries (padding) are not.
- a mismatch is logged with the batch's shape, counted, demotes the backend for the bucket that served the batch
  (the dispatch table's nearest timed bucket, extend's by requests x query tokens x context, under CUDA graphs by
  the number of requests; or the whole phase without a table): the next best there (by the bucket's times, then
  the phase's priority order) serves it from the next plan on; and its cached verdict is dropped, so that the next
  selection validates it again. An explicit choice has no next best: it keeps serving.
State lives in the Canary object a Selection holds (``Selection.canary``; None when off).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import numbers

import filelock
import torch

from . import backends, settings
from .backends.support import capturing
from .cache import ResultCache, entry_key
from .spec import AttentionSpec
from .validate import served

log = logging.getLogger(__name__)

ENV = "ATTNSEL_CANARY"
MAX_PENDING = 4  # sampled batches whose check is not read yet: a sampled run past this many is skipped (counted)
MAX_RECORDS = 32  # mismatches kept in the report (the counts hold them all)
COUNTS = ("plans", "sampled", "checked", "mismatches", "skipped", "errors")
_WHAT = "one planned batch in N, per phase and backend, is checked against the float32 reference"


def every_from(value) -> int:
    """N from ``select(canary_every=...)``: None reads $ATTNSEL_CANARY (unset or empty: 0); 0 is off. ValueError
    naming the setting for anything but a whole number >= 0."""
    if value is None:
        return settings.read("canary")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"canary_every must be None, 0 (off) or a whole number of plans N >= 1 ({_WHAT}; None: "
                         f"${ENV}), got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Where a demotion applies: ``key`` ("phase",) for a phase without a dispatch table, else ("uniform" or
    "ragged", the timed bucket's key); ``ranking``: who may serve it, best first."""

    key: tuple
    label: str
    ranking: tuple[str, ...]


def bucket_of(choice, key: tuple, longest: int | None) -> Bucket:
    """The bucket of a batch (``key`` on the phase's axes, decode (batch, context), extend (requests, query tokens,
    context), of which a graph table reads the first; ``longest`` as the table's lookup takes it) in a PhaseChoice:
    the nearest timed bucket of its dispatch table (the ragged sub-table where it serves the batch), ranked by that
    bucket's times and then the phase's valid candidates in priority order; an explicit choice ranks itself alone."""
    valid = [c.name for c in choice.candidates if c.status in ("selected", "valid")]
    if choice.source == "explicit":
        return Bucket(("phase",), "every shape", (choice.backend,))
    table = choice.table
    if table is None:
        return Bucket(("phase",), "every shape", tuple(dict.fromkeys([choice.backend, *valid])))
    ragged = table.ragged is not None and longest is not None and table.ragged.covers(key, longest)
    sub = table.ragged if ragged else table
    timed = sub.bucket_for(tuple(key[:len(sub.axes)]))
    fastest = [n for _, n in sorted((t, n) for n, t in timed.times_us.items() if t and t > 0)]
    ranking = tuple(dict.fromkeys([n for n in fastest if not valid or n in valid] + valid))
    return Bucket(("ragged" if ragged else "uniform", timed.key), timed.label + (" (ragged)" if ragged else ""),
                  ranking)


def shape_text(phase: str, key: tuple, longest: int | None) -> str:
    """The batch's shape as plan_prefill/plan_decode/plan_extend bucket it (host ints, no sync)."""
    if phase == "prefill":
        return f"{key[0]} sequences, {key[1]} query tokens, longest {key[2]}"
    if phase == "extend":
        return f"{key[0]} requests, mean {key[1]} query tokens over a mean context of {key[2]}"
    if longest is not None:
        return f"{key[0]} rows, mean context {key[1]}, longest {longest}"
    return f"{key[0]} rows, context {key[1]}"


@dataclasses.dataclass
class _Job:
    """One sampled batch on its way: copied (event ``copied``), reference launched (``computed``), judged."""

    sample: "Sample"
    snap: served.Snapshot
    side: "torch.cuda.Stream | None"
    copied: "torch.cuda.Event | None"
    refs: served.Reference | None = None
    computed: "torch.cuda.Event | None" = None


class Sample:
    """A sampled plan: ``wrap`` gives its run function the copy of its first run."""

    def __init__(self, canary: "Canary", phase: str, name: str, bucket: Bucket, shape: str):
        self.canary, self.phase, self.name, self.bucket, self.shape = canary, phase, name, bucket, shape

    def wrap(self, run, plan_args: tuple, bound: int | None = None):
        """run with its first call copied for the check. ``plan_args``: prefill (cu_q, cu_k, ...), decode
        (page_table, seq_lens), extend (cu_q, page_table, seq_lens); ``bound``: decode and extend, a host bound on
        the batch's longest row (longest or max_seq_len; None: the page table's width) that limits the pages
        copied."""
        paged = self.phase != "prefill" and bound is not None
        pages = -(-bound // self.canary.spec.page_size) if paged else None
        taken = False

        def sampled(*inputs, **kwargs):
            nonlocal taken
            out = run(*inputs, **kwargs)
            if not taken:
                taken = True
                self.canary._take(self, plan_args, inputs, kwargs, out, pages)
            return out

        current = getattr(run, "current", None)  # the backend's plan-replaced test (backends protocol)
        if current is not None:
            sampled.current = current
        return sampled


class Canary:
    """The canary of one Selection: counts, demotions, the sampled batches in flight (see the module docstring).
    ``fingerprint``/``device``/``cache``: the selection's, to find and drop a failing backend's cached verdict (cache
    None: nothing to drop)."""

    def __init__(self, every: int, spec: AttentionSpec, *, fingerprint: dict, device: str,
                 cache: ResultCache | None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"a Canary checks one plan in N, N a whole number >= 1, got {every!r}")
        self.every, self.spec = every, spec
        self._fingerprint, self._device, self._cache = fingerprint, device, cache
        self._counts: dict[tuple[str, str], dict[str, int]] = collections.defaultdict(dict.fromkeys(COUNTS, 0).copy)
        self._demoted: dict[tuple[str, tuple], tuple[Bucket, set[str]]] = {}
        self._demoting: set[str] = set()  # phases with a demotion: only they look up a batch's bucket per plan
        self._records: collections.deque = collections.deque(maxlen=MAX_RECORDS)
        self._pending: list[_Job] = []
        self._streams: dict[int, torch.cuda.Stream] = {}

    def serve(self, phase: str, choice, key: tuple, longest: int | None, name: str, meta: torch.Tensor
              ) -> tuple[str, Sample | None]:
        """At a plan: (the backend that serves it, the Sample when this plan is checked, else None). Reads the
        checks that are done first. ``choice``: the phase's PhaseChoice; ``key``/``longest``: the batch on the
        table's axes; ``name``: the table's pick; ``meta``: a metadata tensor (capture test)."""
        if capturing(meta):  # nothing during capture: no event queries, no count, no sample
            return name, None
        self.poll()
        bucket = None
        if phase in self._demoting:
            bucket = bucket_of(choice, key, longest)
            name = self._serving(phase, bucket, name)
        counts = self._counts[(phase, name)]
        counts["plans"] += 1
        if (counts["plans"] - 1) % self.every:
            return name, None
        counts["sampled"] += 1
        return name, Sample(self, phase, name, bucket or bucket_of(choice, key, longest),
                            shape_text(phase, key, longest))

    def _serving(self, phase: str, bucket: Bucket, name: str) -> str:
        demoted = self._demoted.get((phase, bucket.key), (None, set()))[1]
        if name not in demoted:
            return name
        return next((n for n in bucket.ranking if n not in demoted), name)

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _take(self, sample: Sample, plan_args: tuple, inputs: tuple, kwargs: dict, out, pages: int | None) -> None:
        """Copy a sampled run's inputs and output (no host sync on the GPU: see the module docstring)."""
        counts = self._counts[(sample.phase, sample.name)]
        q = inputs[0]
        if len(self._pending) >= MAX_PENDING or capturing(q):  # first run inside a capture: no stream work there
            counts["skipped"] += 1
            return
        side = copied = None
        try:
            if q.is_cuda:
                main, side = torch.cuda.current_stream(q.device), self._side(q.device)
                ran = torch.cuda.Event()
                ran.record(main)
                side.wait_event(ran)
                with torch.cuda.stream(side):
                    snap = served.take(sample.phase, plan_args, inputs, kwargs, out, pages)
                    copied = torch.cuda.Event()
                    copied.record(side)
                main.wait_event(copied)  # later writes into q, the caches or out come after the copy
            else:
                snap = served.take(sample.phase, plan_args, inputs, kwargs, out, pages)
        except Exception as exc:  # e.g. out of memory for the copies: serving goes on, the failure is counted
            counts["errors"] += 1
            log.warning("canary: could not copy a %s batch of %s (%s) for the check: %s: %s", sample.phase,
                        sample.name, sample.shape, type(exc).__name__, exc)
            return
        self._pending.append(_Job(sample, snap, side, copied))

    def poll(self) -> None:
        """Advance the sampled batches whose device work is done; never waits (event queries)."""
        for job in list(self._pending):
            self._advance(job, wait=False)

    def drain(self) -> None:
        """Finish every sampled batch in flight, waiting for the side stream (tests, the end of a run)."""
        for job in list(self._pending):
            self._advance(job, wait=True)

    def _advance(self, job: _Job, wait: bool) -> None:
        on_side = torch.cuda.stream(job.side) if job.side is not None else contextlib.nullcontext()
        try:
            if job.refs is None:
                if not _done(job.copied, wait):
                    return
                with on_side:
                    job.refs = served.reference(self.spec, job.snap)
                    if job.side is not None:
                        job.computed = torch.cuda.Event()
                        job.computed.record(job.side)
            if not _done(job.computed, wait):
                return
            with on_side:
                result = served.judge(self.spec, job.snap, job.refs)
        except Exception as exc:
            self._pending.remove(job)
            self._counts[(job.sample.phase, job.sample.name)]["errors"] += 1
            log.warning("canary: the check of a %s batch of %s (%s) failed: %s: %s", job.sample.phase,
                        job.sample.name, job.sample.shape, type(exc).__name__, exc)
            return
        self._pending.remove(job)
        self._conclude(job.sample, result)

    def _conclude(self, sample: Sample, result: dict) -> None:
        phase, name, bucket = sample.phase, sample.name, sample.bucket
        counts = self._counts[(phase, name)]
        if result["status"] == "skipped":
            counts["skipped"] += 1
            log.info("canary: a %s batch of %s (%s) was not judged: %s", phase, name, sample.shape, result["reason"])
            return
        counts["checked"] += 1
        if result["status"] == "valid":
            return
        counts["mismatches"] += 1
        self._demoted.setdefault((phase, bucket.key), (bucket, set()))[1].add(name)
        self._demoting.add(phase)
        serves = self._serving(phase, bucket, name)
        if serves == name:
            why = "an explicit choice" if len(bucket.ranking) == 1 else "every backend of it was demoted"
            what = f"no other backend serves that bucket ({why}): {name} keeps serving it"
        else:
            what = f"{name} is demoted there in this process: {serves} serves it from the next plan on"
        verdict = self._drop_verdict(phase, name)
        self._records.append({"phase": phase, "backend": name, "bucket": bucket.label, "shape": sample.shape,
                              "reason": result["reason"], "serves": serves, "verdict": verdict})
        log.warning("canary: %s backend %s differs from the float32 reference on a batch of %s (bucket %s): %s; "
                    "%s; %s", phase, name, sample.shape, bucket.label, result["reason"], what, verdict)

    def _drop_verdict(self, phase: str, name: str) -> str:
        """Remove the backend's cached validation entry for this phase (the key select computed); what happened."""
        if self._cache is None:
            return "no cache: no verdict to drop"
        reason, identity = backends.availability(backends.get(name), self.spec, phase, torch.device(self._device))
        if reason:
            return f"its cached verdict was not dropped (the backend is unavailable now: {reason})"
        key = entry_key(self._fingerprint, self.spec.to_dict(), name, identity, phase)
        try:
            removed = self._cache.drop([key])
        except (OSError, ValueError, filelock.Timeout) as exc:
            return f"its cached verdict could not be dropped ({type(exc).__name__}: {exc})"
        return ("cached verdict dropped: the next selection validates it again" if removed
                else "no cached verdict to drop")

    def mismatches(self) -> dict[tuple[str, str], int]:
        """(phase, backend) -> mismatches found so far (reads the checks that are done first)."""
        self.poll()
        return {k: c["mismatches"] for k, c in self._counts.items() if c["mismatches"]}

    def report(self) -> dict:
        """For reports and engines (reads the checks that are done first): N; per phase and backend the plans
        counted, sampled, checked, mismatches, skipped (not judged: too many in flight, first run inside a capture,
        metadata past the copies, a reference with NaN/inf from the inputs) and errors (the canary's own failures);
        the demotions with who serves each bucket now; the last mismatches; the batches in flight."""
        self.poll()
        phases: dict[str, dict] = {}
        for (phase, name), counts in self._counts.items():
            phases.setdefault(phase, {})[name] = dict(counts)
        demoted = [{"phase": phase, "bucket": bucket.label, "backends": sorted(names),
                    "serves": next((n for n in bucket.ranking if n not in names), None)}
                   for (phase, _), (bucket, names) in self._demoted.items()]
        return {"every": self.every, "phases": phases, "demoted": demoted, "mismatches": list(self._records),
                "pending": len(self._pending)}

    def summary(self) -> str:
        """One line for the text report."""
        report = self.report()
        counts = [c for names in report["phases"].values() for c in names.values()]
        line = (f"canary: one plan in {self.every} per phase and backend checked against the float32 reference; "
                f"{sum(c['checked'] for c in counts)} checked, {sum(c['mismatches'] for c in counts)} mismatch(es)")
        for d in report["demoted"]:
            line += f"; {d['phase']} {d['bucket']}: {', '.join(d['backends'])} demoted, {d['serves']} serves it"
        return line


def _done(event, wait: bool) -> bool:
    if event is None:
        return True
    if wait:
        event.synchronize()
        return True
    return event.query()
