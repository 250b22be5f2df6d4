"""Where failures come from: a per-chip mean time between interruptions, or a fixed list of times.

A group of C chips whose chips fail independently at rate 1 / MTBI fails as a Poisson process of rate
C / MTBI (which chip does not matter), or, chip by chip, each failing again only after it is back. Speeds:
each learner's step time is multiplied, per task, by a log-normal factor exp(N(0, sigma²)) (the straggler
model); sigma 0 gives identical learners.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

HOUR = 3600.0


class FailureModel:
    """Chip failures of every group and the speed factors of every task, from one numpy seed."""

    def __init__(self, *, chip_mtbi_hours: float, speed_sigma: float, seed: int,
                 trace: dict[int, list[float]] | None = None) -> None:
        """`trace`, when given, replaces the random failures: group id -> its failure times (seconds)."""
        self.chip_mtbi = chip_mtbi_hours * HOUR
        self.speed_sigma = speed_sigma
        self.trace = trace
        self.rng = np.random.default_rng(seed)

    def failure_times(self, group: int, chips: int) -> Iterator[float]:
        """The times at which some chip of `group` (of `chips` chips) fails, in increasing order."""
        if self.trace is not None:
            yield from sorted(self.trace.get(group, []))
            return
        rng = np.random.default_rng([int(self.rng.integers(2**31)), group])  # one stream per group
        mean_gap = self.chip_mtbi / chips
        t = 0.0
        while True:
            t += float(rng.exponential(mean_gap))
            yield t

    def chip_failure_times(self, group: int, chip: int, *, down_seconds: float) -> Iterator[float]:
        """The failures of one chip of `group` that is down `down_seconds` after each: its up times are exponential
        of mean the chip MTBI, drawn from its return (no failure while it is down), as an elastic island's worker's."""
        rng = np.random.default_rng([int(self.rng.integers(2**31)), group, chip])  # one stream per chip
        t = 0.0
        while True:
            t += float(rng.exponential(self.chip_mtbi))
            yield t
            t += down_seconds

    def speed_factor(self, learner: int | None = None) -> float:
        """How much slower than nominal `learner` runs its next task (1.0 with sigma 0; a subclass may
        slow one learner down: bench/islands_prediction.py's straggler)."""
        if self.speed_sigma == 0:
            return 1.0
        return float(np.exp(self.rng.normal(0.0, self.speed_sigma)))


def schedule_failures(queue, times: Iterator[float], fail, *, until: float) -> None:
    """Call `fail()` at each of `times` up to `until` on `queue` (an `EventQueue`), one event at a time."""

    def next_failure() -> None:
        t = next(times, None)
        if t is not None and t <= until:
            queue.at(t, fire)

    def fire() -> None:
        fail()
        next_failure()

    next_failure()
