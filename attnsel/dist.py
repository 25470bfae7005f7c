"""Distributed agreement: every rank asks the same question, rank 0 decides, every rank receives the same answer.

Each call sets up its own gloo group of all ranks (``dist.new_group``; gloo also under an NCCL default group: the
question and the answer are small Python objects, no GPU takes part) with a timeout, so that a rank that never asks,
or a decision that never comes, gives an error on the waiting ranks instead of a hang:

1. the group is set up: every rank must call within ``timeout`` seconds;
2. the questions are all-gathered: ranks that asked different questions all raise AgreementError naming each rank's
   question (rank 0's answer to its own question would be wrong for the others);
3. rank 0 decides and broadcasts its answer or its error in a second group, whose timeout is ``decide_timeout``:
   the other ranks wait that long for it (a cold selection validates and times every candidate).
"""
from __future__ import annotations

import datetime
import logging
import numbers
import pickle
from typing import Callable, TypeVar

import torch.distributed as dist

from . import settings
from .errors import AttnselError, InvalidArgument

log = logging.getLogger(__name__)
T = TypeVar("T")

# every rank must ask within ATTNSEL_DIST_TIMEOUT_S (ranks load their models at different speeds); rank 0 decides
# within ATTNSEL_DIST_DECIDE_TIMEOUT_S (a cold selection: JIT builds of minutes each, validation, timing)
TIMEOUT_ENV, DECIDE_TIMEOUT_ENV = settings.ENV["dist_timeout_s"], settings.ENV["dist_decide_timeout_s"]
SAME_ORDER = ("every rank must make the same calls in the same order (a pipeline stage selects every kind of layer "
              "of the model, in one order, also those it does not hold)")


class AgreementError(AttnselError, RuntimeError):
    """The ranks could not agree: they asked different questions, or a rank did not come within the timeout."""


def describe(question) -> str:
    """A question in words: a dict as ``key=value`` pairs, anything else as its repr."""
    if isinstance(question, dict):
        return ", ".join(f"{key}={value}" for key, value in question.items())
    return repr(question)


def _seconds(arg: str, value: float | None, field: str) -> float:
    if value is None:
        return settings.read(field)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise InvalidArgument(f"{arg} must be a positive number of seconds or None (${settings.ENV[field]}, default "
                              f"{getattr(settings.Settings(), field):g}), got {value!r}")
    return float(value)


_ABSENT = object()


def mismatch(questions: list) -> str | None:
    """The error message when the ranks' questions (index: rank) differ; None when they are all the same."""
    if all(q == questions[0] for q in questions):
        return None
    lines = [f"rank {rank} asked: {describe(q)}" for rank, q in enumerate(questions)]
    differ = ""
    if all(isinstance(q, dict) for q in questions):
        keys = dict.fromkeys(k for q in questions for k in q)
        names = [k for k in keys if any(q.get(k, _ABSENT) != questions[0].get(k, _ABSENT) for q in questions)]
        differ = f" They differ in: {', '.join(map(str, names))}."
        if "backends" in names:
            differ += (" A backend of one name is another version or source, or unavailable, on some rank (rank 0 "
                       "validates only its own): install the same backends on every rank.")
    return (f"the {len(questions)} ranks asked different questions, so no rank got an answer (rank 0 decides once "
            f"for all: its answer would be wrong for the others; {SAME_ORDER}).{differ}\n  " + "\n  ".join(lines))


def agree(decide: Callable[[], T], question, *, timeout: float | None = None,
          decide_timeout: float | None = None) -> T:
    """Check that every rank asks ``question``, run ``decide`` on rank 0 only and broadcast its result (or its error)
    to all ranks.

    ``question``: a picklable description of what is decided, compared with ``==`` across ranks (a dict is shown
    as ``key=value`` pairs). ``timeout``: seconds every rank has to call (default $ATTNSEL_DIST_TIMEOUT_S or 600);
    ``decide_timeout``: seconds the other ranks wait for rank 0's decision (default $ATTNSEL_DIST_DECIDE_TIMEOUT_S
    or 3600). Without an initialised process group (or with one rank) this is just ``decide()``. Raises
    AgreementError on every rank when the questions differ, on the waiting ranks when a rank does not come in time;
    rank 0's error from ``decide`` is re-raised on every rank with rank 0's message, so that no rank goes on alone.
    """
    timeout = _seconds("timeout", timeout, "dist_timeout_s")
    decide_timeout = _seconds("decide_timeout", decide_timeout, "dist_decide_timeout_s")
    if not several_ranks():
        return decide()
    rank, world = dist.get_rank(), dist.get_world_size()
    asked = f"rank {rank} of {world} (asking: {describe(question)})"
    try:  # every rank sets up the group: this waits for all of them
        asking = _gloo_group(timeout)
    except Exception as exc:  # DistStoreError: a rank did not come in time
        raise AgreementError(
            f"{asked} waited {timeout:g} s for every rank to ask (${TIMEOUT_ENV}) and at least one rank never did: "
            f"{SAME_ORDER}; torch.distributed: {exc}") from exc
    try:
        _same_question(asking, question, asked, timeout)
        # A gloo operation waits as long as its group's timeout: the answer's wait (rank 0 deciding) has its own.
        answering = _gloo_group(decide_timeout)  # every rank is here: set up at once
        try:
            return _answer(answering, decide, asked, decide_timeout)
        finally:
            dist.destroy_process_group(answering)
    finally:
        dist.destroy_process_group(asking)


def several_ranks() -> bool:
    """Whether torch.distributed is initialised with more than one rank (agree then makes them agree)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gloo_group(seconds: float):
    """A gloo group of all ranks (also under an NCCL default group: only small Python objects travel) whose
    operations wait at most ``seconds``."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))


def _same_question(group, question, asked: str, timeout: float) -> None:
    """All-gather the ranks' questions; AgreementError (the same on every rank) when they differ."""
    questions: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(questions, question, group=group)
    except Exception as exc:
        raise AgreementError(f"{asked} could not gather every rank's question within {timeout:g} s: {exc}") from exc
    problem = mismatch(questions)
    if problem:
        raise AgreementError(f"rank {dist.get_rank()}: {problem}")


def _portable(exc: Exception) -> Exception:
    """``exc`` when it survives pickling (the other ranks raise it as it is), else a RuntimeError naming its type
    and message (an exception holding an unpicklable attribute, or one whose constructor does not take its args
    back, would otherwise fail the broadcast and leave the other ranks without rank 0's reason)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"rank 0 failed to decide: {type(exc).__name__}: {exc}")


def _answer(group, decide: Callable[[], T], asked: str, decide_timeout: float) -> T:
    """Rank 0 decides and broadcasts its answer or its error; the other ranks wait for it."""
    rank = dist.get_rank()
    payload: list = [None]
    own_error = None
    if rank == 0:
        try:
            payload[0] = ("ok", decide())
        except Exception as exc:
            log.error("rank 0 failed to decide: %s", exc)
            own_error = exc
            payload[0] = ("error", _portable(exc))
    try:
        dist.broadcast_object_list(payload, src=0, group=group)
    except Exception as exc:
        waited = ("waited for the other ranks to take its answer (they gave up waiting, or died)" if rank == 0
                  else f"waited {decide_timeout:g} s for rank 0's answer (${DECIDE_TIMEOUT_ENV})")
        raise AgreementError(f"{asked} {waited}: {exc}") from exc
    status, value = payload[0]
    if status == "error":
        raise own_error if own_error is not None else value
    if rank != 0:
        log.info("rank %d received the answer from rank 0", rank)
    return value
