"""Goodput accounting (docs/islands.md#goodput): useful chip-seconds / allocated chip-seconds.

Every chip is allocated for the whole horizon. A strategy books chip-seconds of computed steps as
useful (they survive into the model) or lost (rolled back, dropped as stale, cancelled, a task lost or
still running at the end); whatever is neither was spent restarting, re-configuring, waiting or
communicating ("idle").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ledger:
    chips: int
    horizon: float  # seconds
    useful: float = 0.0  # chip-seconds of steps that survive
    lost: float = 0.0  # chip-seconds of steps computed and then thrown away
    bytes_per_link: float = 0.0  # bytes moved over one learner's link during the horizon (mean over learners)

    @property
    def allocated(self) -> float:
        return self.chips * self.horizon

    @property
    def goodput(self) -> float:
        return self.useful / self.allocated

    def summary(self) -> dict[str, float]:
        """Goodput, where the rest went, and the bytes per learner link: per second of the run and per
        second a chip spent computing (what the link must carry while training)."""
        idle = self.allocated - self.useful - self.lost
        computing = (self.useful + self.lost) / self.chips
        return {"goodput": self.goodput, "useful_chip_seconds": self.useful, "lost_chip_seconds": self.lost,
                "idle_chip_seconds": idle, "allocated_chip_seconds": self.allocated,
                "bytes_per_link_per_second": self.bytes_per_link / self.horizon,
                "bytes_per_link_per_training_second": self.bytes_per_link / computing if computing else 0.0}
