"""Fault injection: islands that die or stall at random, reproducibly (`--fail-mtbf`, `--return-after`).

    dipaco island --config configs/tiny.yaml --run runs/tiny --fail-mtbf 120 --return-after 30

Failure times are drawn from an exponential distribution with mean `faults.mtbf` seconds of the
island's up-time, from a generator seeded by `run.seed` and the island's name, so the same island
fails on the same schedule in every run. What a failure does (`faults.mode`):
- `die`: the island drops its task (no result, no inner state), stops heart-beating, and after
  `faults.return_after` seconds comes back as a new incarnation that asks for work again with nothing
  cached (its old task has by then been handed to another island, or is re-offered to it);
- `stall`: the island stops heart-beating for `faults.return_after` seconds, then finishes its task
  late (its result may arrive after the task was handed to another island: only one is applied; in
  async mode, when the task was replaced meanwhile, it stops at its next look at the board instead:
  `dipaco.islands.island.result_wanted`).
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from collections.abc import Callable

log = logging.getLogger(__name__)


class IslandFailure(RuntimeError):
    """Raised inside an island's inner loop when an injected `die` failure is due."""


class FaultClock:
    def __init__(self, *, mtbf: float, return_after: float, mode: str, seed: int, island: str,
                 clock: Callable[[], float] = time.monotonic):
        self.mtbf, self.return_after, self.mode, self.clock = mtbf, return_after, mode, clock
        self.rng = random.Random(seed * 1_000_003 + zlib.crc32(island.encode()))
        self.failures = 0
        self.next_at = self._draw(clock()) if mtbf > 0 else float("inf")

    def _draw(self, start: float) -> float:
        return start + self.rng.expovariate(1.0 / self.mtbf)

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def fail(self) -> float:
        """Record a failure that happens now; returns how long the island stays away."""
        self.failures += 1
        self.next_at = self._draw(self.clock() + self.return_after)
        log.warning("injected failure %d (%s): away for %.1fs", self.failures, self.mode, self.return_after)
        return self.return_after


def no_faults() -> FaultClock:
    return FaultClock(mtbf=0.0, return_after=0.0, mode="die", seed=0, island="")
