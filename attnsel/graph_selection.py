"""Which selection a call of the FA-compatible functions (``attnsel.flash_api``) plans on under CUDA-graph capture.

The rule: a call made while a CUDA graph is being captured plans on a selection made in mode "graph" (every candidate
was captured and replayed after in-place metadata updates; a backend that declares itself stale under replay,
``graph_stale``, is not a candidate). Where the functions are configured with ``mode="graph"`` that is the one
selection every call uses. Otherwise (mode "eager", the default) the first captured call of a spec makes a second
selection, in mode "graph" with the same options, and every captured call of that spec plans on it; calls outside
capture keep the configured one. So an eager selection is never captured: a captured FlashInfer plan would sync,
torch's prefill plan would read the lengths on the host.

Why at the captured call: attnsel cannot know beforehand whether a call will be captured. transformers'
continuous batching (>= 5.18) captures by default for flash-named attention (``attnsel_flash``,
``attnsel/flash-attn``): each new batch shape is run once eagerly, then captured and replayed; the eager run comes
first, so a spec's first call is never a captured one there. The selection made during capture is host work in the
capturing process (the cache, the device's properties, the backends' availability); validation and timing run in
the worker process. The first call of a spec must still come outside capture (it makes the configured selection),
and with several torch.distributed ranks no selection can be made during capture (the ranks agree through a
broadcast, which would be captured): there the captured call raises and names the fix, ``mode="graph"``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .spec import AttentionSpec

GRAPH = "graph"


def capturing_now() -> bool:
    """Whether a CUDA graph is being captured on the current stream (a module attribute: tests stand in for one)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_may_select(spec: AttentionSpec, mode: str | None) -> None:
    """Raise where the selection for ``spec`` in ``mode`` (None: the configured mode, a spec's first call) cannot be
    made now: during capture, a spec's first call, and any selection with several torch.distributed ranks."""
    if not capturing_now():
        return
    if mode is None:
        raise RuntimeError(f"attnsel: the first call for {spec.describe()} happened during CUDA graph capture; "
                           "call once outside capture first (selection runs a validation worker)")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(f"attnsel: a call for {spec.describe()} is being captured into a CUDA graph and needs a "
                           f"selection made in mode {GRAPH!r}, but its selection was made in another mode and "
                           f"{dist.get_world_size()} torch.distributed ranks cannot agree on a new one inside a "
                           f"capture (a broadcast); select in mode {GRAPH!r} from the start: "
                           f"attnsel.flash_api.configure(mode={GRAPH!r}) (transformers: "
                           f"attnsel.integrations.hf.register(mode={GRAPH!r}))")
