"""When an async round may close: per shared module a quorum of its own paths, then a grace window.

A shared module m is ready when ceil(rounds.quorum × |P(m)|) of its reporting paths have a result from
the newest version, and then all of them have, or its grace window has passed: after the quorum at
q_m the round waits only for paths whose running task is expected (start + the median measured task
time) by q_m + rounds.grace_seconds. A round closes when every shared module is ready, at once when an
idle island has no task it may take; with no shared module, as soon as any result is in.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

from dipaco.config import RoundsConfig
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask, Result, Running

TASK_TIMES_KEPT = 16  # measured task times the grace window's median is taken over


class QuorumClock:
    """The measured task times and, per shared module, when its quorum was reached."""

    def __init__(self, grid: Grid, config: RoundsConfig):
        self.grid, self.config = grid, config
        self.task_times: deque[float] = deque(maxlen=TASK_TIMES_KEPT)
        self.quorum_since: dict[str, float] = {}

    def measure(self, result: Result) -> None:
        if result.started is not None:
            self.task_times.append(max(0.0, result.arrived - result.started))

    def median_task_seconds(self) -> float | None:
        return statistics.median(self.task_times) if self.task_times else None

    def grace_deadline(self) -> float | None:
        """When a running grace window ends (the round may close then with no other event)."""
        starts = self.quorum_since.values()
        return max(starts) + self.config.grace_seconds if starts else None

    def due(self, now: float, *, committed: int, fresh: set[int], unfinished: set[int], any_pending: bool,
            running: list[Running], idle: Iterable[IdleIsland], open: list[OpenTask]) -> bool:
        """May the round close at `now`? `fresh`: paths with a result from version `committed`;
        `unfinished`: paths that still owe results."""
        shared = self.grid.shared
        if not shared:  # only private modules: nothing to wait for
            return any_pending
        reporting = fresh | unfinished  # a path done with its work no longer counts for the quorum
        quorum_met = True
        for m in shared:
            paths = set(self.grid.modules[m]) & reporting
            if len(fresh & paths) >= math.ceil(self.config.quorum * len(paths)):
                self.quorum_since.setdefault(m, now)
            else:
                self.quorum_since.pop(m, None)
                quorum_met = False
        if not quorum_met:
            return False
        open_paths = {t.path for t in open}
        if any(not any(island.may_take(p) for p in open_paths) and any(island.may_take(p) for p in unfinished)
               for island in idle):
            return True  # an island would idle while a path it may train has work left: no grace
        return all(self._grace_over(m, now, committed, fresh, running, reporting) for m in shared)

    def _grace_over(self, module: str, now: float, committed: int, fresh: set[int], running: list[Running],
                    reporting: set[int]) -> bool:
        paths = set(self.grid.modules[module]) & reporting
        missing = paths - fresh
        if not missing:
            return True
        deadline = self.quorum_since[module] + self.config.grace_seconds
        if now >= deadline:
            return True
        median = self.median_task_seconds()
        for task in running:
            if task.path in missing and task.base == committed:
                if median is None or task.started is None:
                    return False  # nothing measured yet: the whole window
                if task.started + median <= deadline:
                    return False  # expected within the window: wait for it
        return True
