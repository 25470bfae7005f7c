"""Backend protocol and registry: built-ins by lazy import path, plus plugins.

Plugins come from the entry-point group ``attnsel.backends`` and from the environment variable
``ATTNSEL_BACKENDS="module:object,..."``; the object is a backend or a list of backends. A plugin that fails to load
is kept as an unavailable backend whose reason is the import error, so reports show it instead of hiding it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
from typing import Callable, Literal, Protocol, runtime_checkable

import torch

from ..spec import AttentionSpec

log = logging.getLogger(__name__)

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")
RunFn = Callable[..., torch.Tensor]

BUILTINS: dict[str, str] = {
    "fa3": "attnsel.backends.fa3:BACKEND",
    "flashinfer": "attnsel.backends.flashinfer:BACKEND",
    "flashinfer_cuda_cores": "attnsel.backends.flashinfer:BACKEND_CUDA_CORES",
    "triton": "attnsel.backends.triton:BACKEND",
    "torch": "attnsel.backends.torch_sdpa:BACKEND",
    # library variants whose speed differs by shape (issue 10 item 3)
    "fa3_packgqa": "attnsel.backends.fa3:BACKEND_PACKGQA",
    "fa3_split": "attnsel.backends.fa3:BACKEND_SPLIT",
    "flashinfer_fa2": "attnsel.backends.flashinfer:BACKEND_FA2",
    "flashinfer_fa3": "attnsel.backends.flashinfer:BACKEND_FA3",
}
ENV_PLUGINS = "ATTNSEL_BACKENDS"
ENTRY_POINT_GROUP = "attnsel.backends"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@runtime_checkable
class Backend(Protocol):
    """What a backend (built-in or plugin) implements (docs/ARCHITECTURE.md, "Backend protocol").

    - ``unsupported(spec, phase)``: cheap check in the parent process; every reason it cannot serve, joined by "; ",
      or None. It must look at every spec field it does not implement (sliding_window, softcap, sinks, kv_dtype,
      causal) and name it: a backend never ignores a feature.
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
    - Run-time feature inputs: ``sinks`` float32 ``[num_q_heads]`` when ``spec.sinks``; ``k_scale``/``v_scale``
      float32 one-element tensors when ``spec.kv_dtype`` is set (real value = stored value * scale).
    Plan runs once per batch (host work allowed); run is what every layer calls: no host sync, inputs unchanged.
    Optional attributes: ``version`` (str or callable; part of the cache key), ``first_use_note`` (str shown while a
    slow first use runs, e.g. a JIT build), ``report_extras()`` (dict of facts for reports, e.g. a JIT cache path).
    """

    name: str

    def unsupported(self, spec: AttentionSpec, phase: Phase) -> str | None: ...

    def plan_prefill(self, spec: AttentionSpec, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int) -> RunFn: ...

    def plan_decode(self, spec: AttentionSpec, page_table: torch.Tensor, seq_lens: torch.Tensor) -> RunFn: ...


class UnknownBackendError(ValueError):
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

    plan_decode = plan_prefill


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


def _plugin_targets() -> list[tuple[str, Callable[[], object]]]:
    targets: list[tuple[str, Callable[[], object]]] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        targets.append((f"entry point {ep.name} ({ep.value})", ep.load))
    for target in filter(None, (t.strip() for t in os.environ.get(ENV_PLUGINS, "").split(","))):
        targets.append((target, lambda t=target: _load_object(t)))
    return targets


_cache: dict[str, dict] = {}


def registry() -> dict[str, Backend]:
    """All backends by name: built-ins first (BUILTINS order), then plugins; re-read when ATTNSEL_BACKENDS changes."""
    key = os.environ.get(ENV_PLUGINS, "")
    if key in _cache:
        return _cache[key]
    backends: dict[str, Backend] = {}
    for name, target in BUILTINS.items():
        backends[name] = _load_object(target)
    for origin, load in _plugin_targets():
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
    _cache[key] = backends
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
    """Version a backend reports (part of the cache key), e.g. its kernel library's version."""
    version = getattr(backend, "version", None)
    return version() if callable(version) else version
