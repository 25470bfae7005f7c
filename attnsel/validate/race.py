"""The race in an eager bucket (timing's module doc): after ``after`` samples each, a candidate whose every sample is
at least ``factor`` times the leader's median takes no more. The leader is the fastest so far whose output checks:
a candidate that turns out wrong, or raises later, races no one out (the race is then run again without it)."""
from __future__ import annotations

import statistics
from typing import Callable


class Race:
    """One bucket's race. ``leader``: the candidate the others were measured against (None before the race);
    ``out``: the candidates it raced out."""

    def __init__(self, after: int, factor: float):
        self.after, self.factor = after, factor
        self.leader: str | None = None
        self.out: list[str] = []

    def run(self, samples: dict[str, list[float]], names: list[str], dropped: Callable[[str], bool]) -> None:
        """Race ``names`` (the candidates still timed, each with at least ``after`` samples). ``dropped(name)``
        checks the would-be leader's output and says whether it lost its time (then the next fastest leads)."""
        alive = [n for n in names if samples[n]]
        self.leader, self.out = None, []
        while alive:
            leader = min(alive, key=lambda n: statistics.median(samples[n]))
            out = [n for n in alive if min(samples[n]) >= self.factor * statistics.median(samples[leader])]
            if not out or not dropped(leader):  # a leader that races no one out needs no check yet
                self.leader, self.out = leader, out
                return
            alive.remove(leader)

    def seconds(self, name: str, samples: dict[str, list[float]], timed: set[str]) -> float:
        """A candidate's time: the median of its samples. A raced candidate's (sampled in the first ``after``
        repetitions only) is scaled by how much the leader's median moved over all its samples, which the host's
        speed shares (a host slowing after the race must not make it look faster than the leader); unscaled when
        the leader has no time (``timed``: the candidates with one)."""
        own = statistics.median(samples[name])
        if name not in self.out or self.leader not in timed:
            return own
        lead = samples[self.leader]
        return own * statistics.median(lead) / statistics.median(lead[:self.after])
