"""Backend protocol and registry: built-ins by lazy import path, plus plugins.

Plugins come from the entry-point group ``attnsel.backends`` and from the environment variable
``ATTNSEL_BACKENDS="module:object,..."``; the object is a backend or a list of backends. A plugin that fails to load
is kept as an unavailable backend whose reason is the import error, so reports show it instead of hiding it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Callable, Literal, Protocol, runtime_checkable

import torch

from .. import settings
from ..device import source_hash
from ..errors import AttnselError
from ..spec import AttentionSpec

log = logging.getLogger(__name__)

Phase = Literal["prefill", "decode", "extend"]
PHASES: tuple[Phase, ...] = ("prefill", "decode", "extend")
RunFn = Callable[..., torch.Tensor]

BUILTINS: dict[str, str] = {
    "fa3": "attnsel.backends.fa3:BACKEND",
    "flashinfer": "attnsel.backends.flashinfer:BACKEND",
    "flashinfer_cuda_cores": "attnsel.backends.flashinfer:BACKEND_CUDA_CORES",
    "triton": "attnsel.backends.triton:BACKEND",
    "torch": "attnsel.backends.torch_sdpa:BACKEND",
    # library variants whose speed differs by shape
    "fa3_packgqa": "attnsel.backends.fa3:BACKEND_PACKGQA",
    "fa3_split": "attnsel.backends.fa3:BACKEND_SPLIT",
    "flashinfer_fa2": "attnsel.backends.flashinfer:BACKEND_FA2",
    "flashinfer_fa3": "attnsel.backends.flashinfer:BACKEND_FA3",
    "flashinfer_xqa": "attnsel.backends.flashinfer_xqa:BACKEND",
}
ENTRY_POINT_GROUP = "attnsel.backends"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@runtime_checkable
class Backend(Protocol):
    """What a backend (built-in or plugin) implements (docs/ARCHITECTURE.md, "Backend protocol").

    - ``unsupported(spec, phase, device=None)``: cheap check in the parent process; every reason it cannot serve,
      joined by "; " (or a list of reasons), or None. ``device: torch.device | None = None`` is the device the
      selection is for (check its capability, not the current device's); optional: a plugin whose ``unsupported``
      takes only (spec, phase) is called without it. It must look at every spec field it does not implement
      (sliding_window, softcap, sinks, kv_dtype, causal) and name it: a backend never ignores a feature.
    - ``plan_prefill(spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` -> ``run(q, k, v, *,
      sinks=None) -> out``: ragged prefill; q ``[total_q, num_q_heads, head_dim]``, k/v ``[total_k, num_kv_heads,
      head_dim]`` in ``spec.dtype``, cu_seqlens int32 ``[batch + 1]`` on the device; out like q. Sequences with
      fewer query than key tokens are aligned bottom-right (the queries are the last tokens).
    - ``plan_decode(spec, page_table, seq_lens)`` -> ``run(q, k_cache, v_cache, *, sinks=None, k_scale=None,
      v_scale=None) -> out``: one query token per sequence; q ``[batch, num_q_heads, head_dim]``, caches
      ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``spec.kv_torch_dtype``, page_table int32
      ``[batch, max_pages]``, seq_lens int32 ``[batch]`` (tokens in the cache, the new one included).
      Only the first ``ceil(seq_lens[b] / page_size)`` entries of row b of page_table are meaningful: later entries
      may hold anything (engines pad with -1 or num_pages), and cache slots past a sequence's length may hold
      anything (NaN, inf: caches are allocated with torch.empty). A row with ``seq_lens[b] == 0`` (CUDA-graph
      padding) has output zeros.
    - ``plan_extend(spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len)`` -> ``run(q, k_cache,
      v_cache, *, sinks=None, k_scale=None, v_scale=None) -> out``: ragged queries over the paged cache (chunked
      prefill, a prompt-cache hit, multi-token decode, speculative verify). q ``[total_q, num_q_heads, head_dim]``
      in ``spec.dtype``, out like q; cu_seqlens_q int32 ``[batch + 1]``; page_table, seq_lens and the caches as in
      decode. ``seq_lens[b]`` counts row b's whole context, its new tokens included (they are in the cache already);
      row b's ``q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` queries are its last tokens: query i sits at
      position ``seq_lens[b] - q_len + i`` and sees keys ``j <= position`` (and ``j > position - window``). A row
      may have 0 queries, or a context of only its queries (a fresh prompt); a query that sees no key gives zeros
      (a row with ``seq_lens[b] == 0``: CUDA-graph padding). ``max_seqlen_q`` (>= every q_len) and ``max_seq_len``
      (>= every seq_len) are host ints, bounds for sizing the launch without a sync. q rows past
      ``cu_seqlens_q[batch]`` are padding: their output is unspecified. Decode is extend with one query per row.
      A backend without ``plan_extend`` is unavailable for the phase.
    - Run-time feature inputs: ``sinks`` float32 ``[num_q_heads]`` when ``spec.sinks``; ``k_scale``/``v_scale``
      float32 one-element tensors when ``spec.kv_dtype`` is set (real value = stored value * scale).
    Plan runs once per batch (host work allowed); run is what every layer calls: no host sync, inputs unchanged.
    A backend whose later plans invalidate earlier ones (a library with one plan per handle) gives the run function a
    ``current()`` method, False once replaced; callers that cache run functions (the FA-compatible functions, the
    transformers integration) then plan again instead of calling a stale plan.
    Optional attributes: ``version`` (str or callable; part of the cache key, with a hash of the source file of the
    backend's module), ``first_use_note`` (str shown while a slow first use runs, e.g. a JIT build),
    ``report_extras()`` (dict of facts for reports, e.g. a JIT cache path), ``graph_stale`` ({phase: reason} for
    the phases whose run, captured in a CUDA graph, would not read the engine's in-place metadata updates at replay:
    the CUDA-graph contract, validate/graph_replay.py), ``decode_takes_b1hd`` (True when
    plan_decode's run also takes q as FlashAttention's ``[batch, 1, num_q_heads, head_dim]`` and then returns out in
    that shape: the FA-compatible decode then passes q as it comes, without two views per call). The parent reads
    all of them through ``availability``, ``first_use_note``, ``report_extras`` and ``decode_takes_b1hd`` below,
    which turn anything a plugin raises into a reason or a default instead of aborting the selection.
    """

    name: str

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None: ...

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn: ...

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn: ...

    # optional: plan_extend(spec, cu_seqlens_q, page_table, seq_lens, max_seqlen_q, max_seq_len) -> RunFn


class UnknownBackendError(AttnselError, ValueError):
    """A backend name that is not registered; the message lists the valid names."""


class BrokenPlugin:
    """Stands in for a plugin that failed to load: always unavailable, with the load error as reason."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        self.version = None

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None:
        return self.reason

    def plan_prefill(self, *args, **kwargs) -> RunFn:
        raise RuntimeError(self.reason)

    plan_decode = plan_extend = plan_prefill


def _load_object(target: str):
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{target!r} is not of the form module:object")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _as_backends(obj, origin: str) -> list:
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for item in items:
        missing = [m for m in ("name", "unsupported", "plan_prefill", "plan_decode") if not hasattr(item, m)]
        if missing:
            raise TypeError(f"{origin}: {item!r} lacks {', '.join(missing)} of the backend protocol")
        if not isinstance(item.name, str) or not _NAME.match(item.name):
            raise TypeError(f"{origin}: backend name {item.name!r} must match {_NAME.pattern}")
    return items


def _plugin_targets(env_targets: tuple[str, ...]) -> list[tuple[str, Callable[[], object]]]:
    targets: list[tuple[str, Callable[[], object]]] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        targets.append((f"entry point {ep.name} ({ep.value})", ep.load))
    for target in env_targets:
        targets.append((target, lambda t=target: _load_object(t)))
    return targets


def registry() -> dict[str, Backend]:
    """All backends by name: built-ins first (BUILTINS order), then plugins; re-read when ATTNSEL_BACKENDS changes."""
    return _registry(settings.read("backends"))


@functools.cache
def _registry(env_targets: tuple[str, ...]) -> dict[str, Backend]:
    """The registry for one value of ATTNSEL_BACKENDS, loaded once (a plugin's import runs once per value)."""
    backends: dict[str, Backend] = {}
    for name, target in BUILTINS.items():
        backends[name] = _load_object(target)
    for origin, load in _plugin_targets(env_targets):
        try:
            items = _as_backends(load(), origin)
        except Exception as exc:
            reason = f"plugin {origin} failed to load: {type(exc).__name__}: {exc}"
            log.warning("%s", reason)
            name = origin.split(" ")[2] if origin.startswith("entry point") else origin
            backends[name] = BrokenPlugin(name, reason)
            continue
        for item in items:
            if item.name in backends:
                log.warning("plugin %s: backend name %r is already registered; the plugin replaces it", origin,
                            item.name)
            backends[item.name] = item
    return backends


def names() -> list[str]:
    return list(registry())


def get(name: str) -> Backend:
    """The backend called ``name``; UnknownBackendError naming the valid ones otherwise."""
    backends = registry()
    if name not in backends:
        raise UnknownBackendError(f"unknown backend {name!r}; valid names: {', '.join(backends)}")
    return backends[name]


def version_of(backend: Backend) -> str | None:
    """Version a backend reports (part of the cache key), e.g. its kernel library's version. Raises what it raises."""
    version = getattr(backend, "version", None)
    return version() if callable(version) else version


def source_files(backend: Backend) -> list[Path]:
    """The source files of the module defining the backend's class (a package: all its .py files); [] if unknown."""
    module = sys.modules.get(type(backend).__module__)
    file = getattr(module, "__file__", None)
    if not file or not os.path.isfile(file):
        return []
    path = Path(file).resolve()
    if path.name == "__init__.py":
        return [p for p in path.parent.rglob("*.py") if "__pycache__" not in p.parts]
    return [path]


def _takes_device(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: call it the old way
        return False
    return any(p.name == "device" or p.kind is p.VAR_KEYWORD for p in params)


def _one_reason(reason) -> str | None:
    if isinstance(reason, (list, tuple)):
        return "; ".join(str(r) for r in reason if r) or None
    return str(reason) if reason else None


# what a plugin's call may raise and lose its backend by: all but a user's Ctrl-C (GeneratorExit and SystemExit too)
_FAULTS = (Exception, SystemExit, GeneratorExit)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _Hung(Exception):
    """A plugin call in the selecting process did not return in time."""


def _bounded(fn: Callable, name: str, what: str):
    """fn() in a daemon thread, its result or its exception; _Hung after ATTNSEL_CHECK_TIMEOUT_S (default 10 s).
    A plugin's cheap parent-side calls (unsupported, version) run in the selecting process, a server's start: one
    that never returns must cost that server a backend, not its start. Python cannot stop the thread: it is left
    running, named after the call. (A call that hangs without releasing the GIL still blocks everything.)"""
    timeout = settings.read("check_timeout_s")
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller, raised there
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"attnsel {name} {what}", daemon=True)
    thread.start()
    thread.join(min(timeout, threading.TIMEOUT_MAX))  # "inf" means no limit; join(inf) raises OverflowError
    if thread.is_alive():
        raise _Hung(f"{name}'s {what} did not return within {timeout:g} s ({settings.ENV['check_timeout_s']}); it "
                    "is left running in a background thread and the backend is treated as unavailable")
    if "error" in box:
        raise box["error"]
    return box["value"]


def availability(backend: Backend, spec: AttentionSpec, phase: Phase,
                 device: torch.device | None = None) -> tuple[str | None, dict | None]:
    """(reason the backend cannot serve (spec, phase) on ``device``, None) or (None, its cache identity: version
    and source hash). Never raises: whatever the backend's code raises becomes the reason ("unavailable")."""
    name = getattr(backend, "name", repr(backend))
    if phase == "extend" and not callable(getattr(backend, "plan_extend", None)):
        return "no plan_extend: this backend does not serve ragged queries over the paged cache", None
    if phase == "extend" and not spec.causal:  # the phase's contract, whatever a backend could compute
        return ("the spec is non-causal (causal=False); extend is causal attention of new tokens over their cached "
                "prefix"), None
    try:
        check = backend.unsupported
        reason = _one_reason(_bounded(lambda: check(spec, phase, device=device) if device is not None
                                      and _takes_device(check) else check(spec, phase), name, "unsupported()"))
    except _Hung as exc:
        log.error("%s", exc)
        return f"availability check did not return: {exc}", None
    except _FAULTS as exc:  # sys.exit() in a library's check: the backend, not the server, goes
        log.exception("availability check of %s for %s raised", name, phase)
        return f"availability check raised {type(exc).__name__}: {exc}", None
    if reason:
        return reason, None
    try:
        version = _bounded(lambda: version_of(backend), name, "version")
    except _Hung as exc:
        log.error("%s", exc)
        return f"version did not return: {exc}", None
    except _FAULTS as exc:
        log.exception("version of %s raised", backend.name)
        return f"version raised {type(exc).__name__}: {exc}", None
    try:  # part of the cache keys (JSON): a version object (packaging's Version) is keyed by its text
        json.dumps(version)
    except (TypeError, ValueError):
        try:
            text = str(version)
        except _FAULTS as exc:
            return f"version {type(version).__name__} has no text: str() raised {type(exc).__name__}: {exc}", None
        if _ADDRESS.search(text):  # object's repr: another address every run, a cache key never hit again
            return (f"version {type(version).__name__} has no stable text ({text[:80]!r} holds an object's address): "
                    "the cache key would change every run; return a string"), None
        version = text
    try:
        files = source_files(backend)
        source = source_hash(files) if files else None
    except OSError as exc:
        log.warning("source of %s unreadable (%s); keyed on its version only", backend.name, exc)
        source = None
    return None, {"version": version, "source": source}


def planner(backend: Backend, phase: Phase) -> Callable[..., RunFn]:
    """The backend's plan function of a phase: plan_prefill, plan_decode or plan_extend."""
    return getattr(backend, f"plan_{phase}")


def first_use_note(backend: Backend) -> str:
    """The backend's ``first_use_note`` ("" if none); a failing attribute gives a note saying so, never an error."""
    try:
        note = getattr(backend, "first_use_note", "")
    except Exception as exc:
        log.warning("first_use_note of %s raised %s: %s", backend.name, type(exc).__name__, exc)
        return f"first_use_note raised {type(exc).__name__}: {exc}"
    return note if isinstance(note, str) else ""


def decode_takes_b1hd(backend: Backend) -> bool:
    """Whether the backend's decode run takes q ``[batch, 1, heads, head_dim]`` natively (its optional
    ``decode_takes_b1hd`` attribute is True); False when the attribute is missing, not a bool, or raises."""
    try:
        return getattr(backend, "decode_takes_b1hd", False) is True
    except Exception as exc:
        if backend.name not in _B1HD_RAISED:  # once per backend: this is read at every decode plan
            _B1HD_RAISED.add(backend.name)
            log.warning("decode_takes_b1hd of %s raised %s: %s", backend.name, type(exc).__name__, exc)
        return False


_B1HD_RAISED: set[str] = set()


def availability_in(backend: Backend, spec: AttentionSpec, phase: Phase, mode: str,
                    device: torch.device | None = None) -> tuple[str | None, dict | None]:
    """``availability`` in a launch mode: under CUDA graphs ("graph") a backend that declares the phase stale on
    replay (``graph_stale_reason``) cannot serve it either."""
    reason, identity = availability(backend, spec, phase, device)
    stale = graph_stale_reason(backend, phase) if mode == "graph" and not reason else None
    return (f"cannot serve CUDA-graph replays: {stale}" if stale else reason), identity


def graph_stale_reason(backend: Backend, phase: str) -> str | None:
    """Why a run of this backend captured in a CUDA graph would replay the metadata its plan copied instead of the
    engine's updated tensors (its optional ``graph_stale`` attribute: {phase: reason}), or None. A plugin without the
    attribute is not trusted on its word: validation in graph mode replays it after in-place updates either way."""
    try:
        stale = getattr(backend, "graph_stale", None) or {}
        reason = stale.get(phase) if isinstance(stale, dict) else None
    except Exception as exc:
        return f"its graph_stale attribute raised {type(exc).__name__}: {exc}"
    return str(reason) if reason else None


def report_extras(backend: Backend) -> dict:
    """The backend's ``report_extras()`` ({} if none); if it raises or returns no dict: {"error": reason}."""
    try:
        extras = getattr(backend, "report_extras", None)
        value = extras() if callable(extras) else {}
    except Exception as exc:
        log.warning("report_extras of %s raised %s: %s", backend.name, type(exc).__name__, exc)
        return {"error": f"report_extras raised {type(exc).__name__}: {exc}"}
    if not isinstance(value, dict):
        return {"error": f"report_extras returned {type(value).__name__}, expected a dict"}
    return value
