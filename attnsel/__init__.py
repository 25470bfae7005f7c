"""attnsel: one attention API over several kernel libraries, with validated automatic backend selection.

Public surface: ``AttentionSpec``, ``select`` (returns a ``Selection`` whose ``plan_prefill``/``plan_decode``/
``plan_extend`` give the per-layer run functions), and the errors a user can see: ``SpecError`` (a bad spec field or
config), ``UnknownBackendError`` (a backend name that is not registered), ``InvalidArgument`` (a ValueError: another
bad argument) and ``SelectionError`` (a phase cannot be served).
``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``: FlashAttention-3-compatible calls over the selection
(``UnsupportedArgument``: a FlashAttention argument attnsel does not serve was given).

The names load on first use (``import attnsel`` imports no torch), so that ``attnsel --version`` and ``--help``
start at once; submodules load the same way (``attnsel.spec``).
"""
import importlib
import importlib.util

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS = {"AttentionSpec": "spec", "SpecError": "spec", "InvalidArgument": "errors", "Selection": "selection",
            "SelectionError": "selection", "select": "selection", "UnknownBackendError": "backends",
            "UnsupportedArgument": "flash_api", "flash_attn_varlen_func": "flash_api",
            "flash_attn_with_kvcache": "flash_api"}

__all__ = ["AttentionSpec", "InvalidArgument", "Selection", "SelectionError", "SpecError", "UnknownBackendError",
           "select", "UnsupportedArgument", "flash_attn_varlen_func", "flash_attn_with_kvcache", "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule not imported yet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
