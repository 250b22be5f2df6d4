"""Fault injection: islands that die or stall at random, reproducibly (`--fail-mtbf`, `--return-after`).

    dipaco island --config configs/tiny.yaml --run runs/tiny --fail-mtbf 120 --return-after 30

Failure times are exponential with mean `faults.mtbf` seconds of the island's up-time, seeded by
`run.seed` and the island's name, so an island fails on the same schedule in every run. `die`: the
island drops its task, stops heart-beating and comes back after `faults.return_after` seconds as a new
incarnation with nothing cached; `stall`: it stops heart-beating for `faults.return_after` seconds, then
finishes its task late.
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from collections.abc import Callable

from dipaco.islands.island.presence import Presence

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


def check_faults(faults: FaultClock, presence: Presence) -> None:
    """Before each inner step (training thread): a due `die` raises `IslandFailure`; a due `stall` hangs
    the island, silent, for its time away, then it carries on."""
    if not faults.due():
        return
    away = faults.fail()
    if faults.mode == "die":
        raise IslandFailure(f"island {presence.name}: injected failure")
    presence.silent = True
    time.sleep(away)
    presence.silent = False
