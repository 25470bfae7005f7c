"""attnsel: one attention API over several kernel libraries, with validated automatic backend selection.

Public surface: ``AttentionSpec``, ``select`` (returns a ``Selection`` whose ``plan_prefill``/``plan_decode`` give
the per-layer run functions), and the errors a user can see: ``SpecError`` (a bad spec field or config),
``UnknownBackendError`` (a backend name that is not registered) and ``SelectionError`` (a phase cannot be served).
``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``: FlashAttention-3-compatible calls over the selection
(``UnsupportedArgument``: a FlashAttention argument attnsel does not serve was given).
"""
__version__ = "0.2.0"

from .backends import UnknownBackendError  # noqa: E402
from .flash_api import UnsupportedArgument, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from .selection import Selection, SelectionError, select  # noqa: E402
from .spec import AttentionSpec, SpecError  # noqa: E402

__all__ = ["AttentionSpec", "Selection", "SelectionError", "SpecError", "UnknownBackendError", "select",
           "UnsupportedArgument", "flash_attn_varlen_func", "flash_attn_with_kvcache", "__version__"]
