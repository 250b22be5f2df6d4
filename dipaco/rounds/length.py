"""The run's length in applied work: it is over when every path has had `run.rounds` × `inner.steps`
inner steps applied (a result cut short counts the steps it trained).

`outstanding` per path = planned steps − its applied steps − the steps of its pending results the next
round applies; a task in flight covers its own steps. A path that owes nothing gets no task and no
longer counts for a quorum.
"""

from __future__ import annotations

from collections.abc import Iterable

from dipaco.rounds.inputs import OpenTask, Running
from dipaco.rounds.plan import RoundPlan


class RunLength:
    """Which rounds applied each path's results and how many steps, against the run's length."""

    def __init__(self, n_paths: int, rounds: int | None, *, inner_steps: int = 1,
                 applied: Iterable[tuple] = ()):
        """`rounds` × `inner_steps`: each path's planned steps (`rounds` None = no end). `applied`:
        (round, path[, steps[, key]]) of every result applied by committed rounds (from their manifests;
        steps None or absent = a whole task; key absent = "": a result no task's chain names)."""
        if rounds is not None and rounds < 1:
            raise ValueError(f"a run's length must be >= 1 result per path (run.rounds), got {rounds}")
        self.n_paths, self.rounds, self.inner_steps = n_paths, rounds, inner_steps
        self.planned = None if rounds is None else rounds * inner_steps
        self.applied: dict[int, list[tuple[int, str]]] = {p: [] for p in range(n_paths)}  # path -> (round, key)
        self.applied_steps = [0] * n_paths
        for round, path, *rest in applied:
            steps, key = (rest[0] if rest else None), (rest[1] if len(rest) > 1 else "")
            self.applied[path].append((round, key))
            self.applied_steps[path] += self.steps(steps)

    def steps(self, steps: int | None) -> int:
        """A result's steps (None: a whole task)."""
        return self.inner_steps if steps is None else steps

    def applied_results(self, path: int) -> int:
        """Results of `path` applied by committed rounds."""
        return len(self.applied[path])

    def outstanding(self, usable: list[int]) -> list[int | None]:
        """Steps each path still owes beyond the committed rounds and the steps of its `usable` pending
        results (None: the run has no length)."""
        if self.planned is None:
            return [None] * self.n_paths
        return [self.planned - self.applied_steps[p] - usable[p] for p in range(self.n_paths)]

    @property
    def done(self) -> bool:
        return self.planned is not None and all(s >= self.planned for s in self.applied_steps)

    def finishes(self, plan: RoundPlan) -> bool:
        """Does committing `plan` end the run?"""
        if self.planned is None:
            return False
        applied = list(self.applied_steps)
        for verdict in plan.applied:
            applied[verdict.path] += self.steps(verdict.steps)
        return all(s >= self.planned for s in applied)

    def record(self, plan: RoundPlan) -> None:
        """`plan` was committed: its applied results count."""
        for verdict in plan.applied:
            self.applied[verdict.path].append((plan.round, verdict.key))
            self.applied_steps[verdict.path] += self.steps(verdict.steps)

    def finishing(self, outstanding: list[int | None], *, running: list[Running], open: list[OpenTask]) -> bool:
        """Async, the run's end: no task will be handed out any more, because the tasks in flight cover
        every step still outstanding."""
        if self.planned is None or open:
            return False
        in_flight = [0] * self.n_paths
        for t in running:
            in_flight[t.path] += self.steps(t.steps)
        return all(outstanding[p] <= in_flight[p] for p in range(self.n_paths))


def unfinished(outstanding: list[int | None]) -> set[int]:
    """Paths that still need work beyond the pending results (every path when the run has no length)."""
    return {p for p, owed in enumerate(outstanding) if owed is None or owed > 0}
