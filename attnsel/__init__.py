"""attnsel: one attention API over several kernel libraries, with validated automatic backend selection.

Public surface: ``AttentionSpec``, ``select`` (returns a ``Selection`` whose ``plan_prefill``/``plan_decode``
give the per-layer run functions), and ``SelectionError``.
"""
__version__ = "0.1.0"

from .select import Selection, SelectionError, select  # noqa: E402
from .spec import AttentionSpec  # noqa: E402

__all__ = ["AttentionSpec", "Selection", "SelectionError", "select", "__version__"]
