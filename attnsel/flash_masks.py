"""FlashAttention 3's ``causal`` / ``window_size`` / ``softcap`` arguments as AttentionSpec fields.

FA3 (hopper/flash_api.cpp, mask.h): query i of a sequence with Sq queries and Sk keys attends to keys
``[i + Sk - Sq - left, i + Sk - Sq + right]`` (bottom-right aligned); a negative bound is unbounded; ``causal=True``
sets ``right = 0``. attnsel serves the bottom-right causal mask with or without a window of ``left + 1`` keys, so:

- ``causal=True``: any ``(left, right)``: a window of ``left + 1`` keys for ``left >= 0``, none for ``left < 0``.
- ``causal=False``: ``(-1, -1)`` (both bounds negative) is no mask; ``(left, 0)`` is the causal mask above
  (``(-1, 0)``: plain causal); a right bound past the diagonal (``right > 0``, or ``right < 0`` with a left bound)
  lets queries see later keys: refused.
- one query per sequence, the last key its own position (``flash_attn_with_kvcache``: Sq = 1, i = 0): keys
  ``[Sk - 1 - left, Sk - 1]`` whatever ``right`` and ``causal`` are (no key lies past the query), so every pair is
  served.
"""
from __future__ import annotations

import math
import operator

from .errors import AttnselError

ALLOWED = ("allowed: (-1, -1) (no window), or (left, 0) with causal=False (the bottom-right causal mask, a window of "
           "left + 1 keys; (-1, 0): plain causal), or with causal=True any (left, right) (FA3 closes the right side: "
           "a window of left + 1 keys, none for left < 0)")


class UnsupportedArgument(AttnselError, ValueError):
    """A FlashAttention argument attnsel does not serve was given a value other than its default."""


def spec_masks(func: str, causal, window_size, softcap, one_query: bool) -> tuple[bool, int | None, float | None]:
    """(causal, sliding_window, softcap) of the spec for FA3's arguments; one_query: one query per sequence at the
    position of its last key (every window is then causal). Raises ValueError for a window that is not a pair of
    ints or a bad softcap, UnsupportedArgument for a window attnsel does not serve."""
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise ValueError(f"attnsel.{func}: window_size must be a pair of ints (left, right), got {window_size!r}; "
                         f"{ALLOWED}") from None
    causal = bool(causal) or one_query  # one query: causal or not is the same attention
    if left < 0 and right < 0:  # both sides unbounded: no window
        window = None
    elif causal or right == 0:  # right = 0 closes the mask on the diagonal: causal
        causal, window = True, (left + 1 if left >= 0 else None)
    else:
        raise UnsupportedArgument(f"attnsel.{func}: window_size={window_size!r} with causal=False: not supported by "
                                  f"attnsel; {ALLOWED}")
    try:  # a number or a 0-dim tensor; text is refused (float("5") would read it)
        if isinstance(softcap, (str, bytes)):
            raise TypeError
        cap = float(softcap)
    except (TypeError, ValueError, RuntimeError):
        cap = math.nan
    if not math.isfinite(cap) or cap < 0:  # NaN compared false everywhere: it meant no cap
        raise ValueError(f"attnsel.{func}: softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    return causal, window, (cap if cap > 0 else None)
