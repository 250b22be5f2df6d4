"""When an async round may close: per shared module a quorum of its own paths, then a grace window.

A shared module m is ready when ceil(rounds.quorum × |P(m)|) of its reporting paths have reported since
the last commit (a result the next round can apply), and then all of them have, or its grace window has
passed. With fragments (`outer.fragments`) a result carries only some modules, so for a module only the
paths whose pending result or running task carries it count, and a module that none carries is not
waited for. The window adapts to the
measured task times: it is rounds.grace_fraction × their median (at most rounds.grace_seconds, which is
also its length before any task was measured), and within it the round waits only for the paths whose
running task is expected by then (its start + the median task time). A round closes when every shared
module is ready; with no shared module, as soon as any result is in. Islands are never idle while it
waits: each goes on training its path (`tasks.paths_to_open`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from dipaco.config import RoundsConfig
from dipaco.rounds.inputs import Grid, Result, Running

TASK_TIMES_KEPT = 16  # measured task times the median is taken over


class QuorumClock:
    """The measured task times and, per shared module, when its quorum was reached."""

    def __init__(self, grid: Grid, config: RoundsConfig):
        self.grid, self.config = grid, config
        self.task_times: deque[float] = deque(maxlen=TASK_TIMES_KEPT)
        self.quorum_since: dict[str, float] = {}

    def measure(self, result: Result, *, whole: bool = True) -> None:
        """A result arrived; a whole task's time (not a cut one's) is measured."""
        if result.started is not None and whole:
            self.task_times.append(max(0.0, result.arrived - result.started))

    def median_task_seconds(self) -> float | None:
        return statistics.median(self.task_times) if self.task_times else None

    def window(self) -> float:
        """The grace window's length: grace_fraction × the median task time, at most grace_seconds."""
        median = self.median_task_seconds()
        if median is None:
            return self.config.grace_seconds
        return min(self.config.grace_seconds, self.config.grace_fraction * median)

    def grace_deadline(self) -> float | None:
        """When a running grace window ends (the round may close then with no other event)."""
        starts = self.quorum_since.values()
        return max(starts) + self.window() if starts else None

    def due(self, now: float, *, committed: int, fresh: set[int], unfinished: set[int], any_pending: bool,
            running: list[Running], carried: dict[str, set[int]] | None = None) -> bool:
        """May the round close at `now`? `fresh`: paths that reported since the last commit; `unfinished`:
        paths that still owe work; `carried` (fragments only): per shared module, the fresh paths whose
        results carry it."""
        shared = self.grid.shared
        if not shared:  # only private modules: nothing to wait for
            return any_pending
        reporting = fresh | unfinished  # a path done with its work no longer counts for the quorum
        quorum_met, waited = True, {}
        for m in shared:
            paths, reported = self._counted(m, reporting=reporting, fresh=fresh, running=running, carried=carried)
            if not paths and carried is not None:  # no pending result and no running task carries it
                self.quorum_since.pop(m, None)
                continue
            waited[m] = paths, reported
            if len(reported) >= math.ceil(self.config.quorum * len(paths)):
                self.quorum_since.setdefault(m, now)
            else:
                self.quorum_since.pop(m, None)
                quorum_met = False
        if not quorum_met:
            return False
        if not waited:
            return any_pending
        return all(self._grace_over(m, now, committed, reported, running, paths, fragments=carried is not None)
                   for m, (paths, reported) in waited.items())

    def _counted(self, module: str, *, reporting: set[int], fresh: set[int], running: list[Running],
                 carried: dict[str, set[int]] | None) -> tuple[set[int], set[int]]:
        """(the module's paths its quorum counts, those of them that reported for it)."""
        paths = set(self.grid.modules[module]) & reporting
        if carried is None:
            return paths, fresh & paths
        coming = {t.path for t in running if t.modules is None or module in t.modules}
        paths &= carried[module] | coming
        return paths, carried[module] & paths

    def _grace_over(self, module: str, now: float, committed: int, fresh: set[int], running: list[Running],
                    paths: set[int], *, fragments: bool = False) -> bool:
        missing = paths - fresh
        if not missing:
            return True
        deadline = self.quorum_since[module] + self.window()
        if now >= deadline:
            return True
        median = self.median_task_seconds()
        for task in running:
            if fragments and task.modules is not None and module not in task.modules:
                continue  # its result will not carry this module
            if task.path in missing and committed - task.base <= self.config.max_staleness:  # still applicable
                if median is None or task.started is None:
                    return False  # nothing measured yet: the whole window
                if task.started + median <= deadline:
                    return False  # expected within the window: wait for it
        return True
