"""Goodput accounting (docs/islands.md#goodput): goodput by work = the work that survives, in chip-seconds
at nominal speed (a step's `step_seconds` x the chips that computed it, however long it took), over the
allocated chip-seconds; the time-based share (the chip-seconds those steps took) beside it.

Every chip is allocated for the whole horizon. A strategy books chip-seconds of computed steps as
useful (they survive into the model) or lost (rolled back, dropped as stale, cancelled, a task lost or
still running at the end); whatever is neither was spent restarting, re-configuring, waiting or
communicating ("idle"). A step slower than nominal (a straggler) books its longer time as useful but
only its nominal work as `useful_work`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ledger:
    chips: int
    horizon: float  # seconds
    useful: float = 0.0  # chip-seconds of steps that survive (the time they took)
    useful_work: float = 0.0  # the same steps' work: chip-seconds at nominal speed
    lost: float = 0.0  # chip-seconds of steps computed and then thrown away
    bytes_per_link: float = 0.0  # bytes moved over one learner's link during the horizon (mean over learners)

    @property
    def allocated(self) -> float:
        return self.chips * self.horizon

    @property
    def goodput(self) -> float:
        """Goodput by work: surviving work / allocated chip-seconds."""
        return self.useful_work / self.allocated

    @property
    def goodput_by_time(self) -> float:
        """The time-based share: the surviving steps' chip-seconds / allocated chip-seconds."""
        return self.useful / self.allocated

    def summary(self) -> dict[str, float]:
        """Goodput, where the rest went, and the bytes per learner link: per second of the run and per
        second a chip spent computing (what the link must carry while training)."""
        idle = self.allocated - self.useful - self.lost
        computing = (self.useful + self.lost) / self.chips
        return {"goodput": self.goodput, "goodput_by_time": self.goodput_by_time, "useful_work": self.useful_work,
                "useful_chip_seconds": self.useful, "lost_chip_seconds": self.lost,
                "idle_chip_seconds": idle, "allocated_chip_seconds": self.allocated,
                "bytes_per_link_per_second": self.bytes_per_link / self.horizon,
                "bytes_per_link_per_training_second": self.bytes_per_link / computing if computing else 0.0}
