"""The run's length in applied work: it is over when every path has had `run.rounds` results applied.

`outstanding` per path = rounds − its applied results − its pending results the next round applies (a
task in flight covers one). A path that owes nothing gets no task and no longer counts for a quorum.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from dipaco.rounds.inputs import OpenTask, Running
from dipaco.rounds.plan import RoundPlan


class RunLength:
    """Which rounds applied each path's results, against the run's length `rounds` (None = no end)."""

    def __init__(self, n_paths: int, rounds: int | None, *, applied: Iterable[tuple[int, int]] = ()):
        """`applied`: (round, path) of every result applied by committed rounds (from their manifests)."""
        if rounds is not None and rounds < 1:
            raise ValueError(f"a run's length must be >= 1 result per path (run.rounds), got {rounds}")
        self.n_paths, self.rounds = n_paths, rounds
        self.applied_rounds: dict[int, list[int]] = {p: [] for p in range(n_paths)}
        for round, path in applied:
            self.applied_rounds[path].append(round)

    def applied_results(self, path: int) -> int:
        """Results of `path` applied by committed rounds."""
        return len(self.applied_rounds[path])

    def outstanding(self, usable: list[int]) -> list[int | None]:
        """Results each path still owes beyond the committed rounds and its `usable` pending results
        (None: the run has no length)."""
        if self.rounds is None:
            return [None] * self.n_paths
        return [self.rounds - self.applied_results(p) - usable[p] for p in range(self.n_paths)]

    @property
    def done(self) -> bool:
        return self.rounds is not None and all(self.applied_results(p) >= self.rounds for p in range(self.n_paths))

    def finishes(self, plan: RoundPlan) -> bool:
        """Does committing `plan` end the run?"""
        if self.rounds is None:
            return False
        applied = {p: self.applied_results(p) for p in range(self.n_paths)}
        for verdict in plan.applied:
            applied[verdict.path] += 1
        return all(n >= self.rounds for n in applied.values())

    def record(self, plan: RoundPlan) -> None:
        """`plan` was committed: its applied results count."""
        for verdict in plan.applied:
            self.applied_rounds[verdict.path].append(plan.round)

    def finishing(self, outstanding: list[int | None], *, running: list[Running], open: list[OpenTask]) -> bool:
        """Async, the run's end: no task will be handed out any more, because the tasks in flight cover
        every result still outstanding."""
        if self.rounds is None or open:
            return False
        in_flight = Counter(t.path for t in running)
        return all(outstanding[p] <= in_flight[p] for p in range(self.n_paths))


def unfinished(outstanding: list[int | None]) -> set[int]:
    """Paths that still need a result beyond the pending ones (every path when the run has no length)."""
    return {p for p, owed in enumerate(outstanding) if owed is None or owed > 0}
