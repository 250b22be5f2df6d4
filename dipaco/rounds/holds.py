"""A path's next task waits for the island that holds its carried state: a path goes back to the island
that trained it last, and moves only when it must.

    holds = PathHolds(beat_seconds=1.0)
    free = holds.release(open_tasks, idle_islands, now=t, median=12.0, away={"island-3"})  # the tasks others may take
    holds.next_release()  # when the earliest hold ends (None: nothing held)

An open task whose path's holder (`OpenTask.holder`: the island that trained the path last and keeps its
carried state in memory) is not idle yet, typically because its result has just arrived and its
heartbeat says so a moment later, is held for it: no other island takes it. The hold ends when the
holder is idle (it takes the task: `tasks.assign` gives a path to the island that trained it last), when
the holder is `away` (dead, back as another incarnation, cut as a straggler, training another task, or
slow, so that the straggler rule moves its path: `dipaco.rounds.moves`), or after the grace: `HOLD_FRACTION` of the median
task time, at least `HOLD_BEATS` heartbeat intervals (a holder that is alive but does not ask for work is
not waited for longer). A path whose state is in the store (`holder` None: the first task, a hand-off, fewer
islands than paths) is never held.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from dipaco.rounds.inputs import IdleIsland, OpenTask

HOLD_FRACTION = 0.5  # an open task waits for its path's holder at most this fraction of the median task time ...
HOLD_BEATS = 3.0  # ... and at least this many heartbeat intervals (the holder's next beat says it is idle)


def hold_grace(*, median: float | None, beat_seconds: float) -> float:
    """How long an open task waits for its path's holder (seconds): `HOLD_FRACTION` of the median task time
    (`median`, None before any task is timed), at least `HOLD_BEATS` × `beat_seconds`."""
    return max(HOLD_BEATS * beat_seconds, HOLD_FRACTION * median if median is not None else 0.0)


def held(open: Iterable[OpenTask], idle: Iterable[IdleIsland], *, now: float, since: dict[str, float],
         grace: float, away: Collection[str] = ()) -> set[str]:
    """The keys of the open tasks held for their path's holder at `now`: it is neither idle nor `away`, and
    the task has waited less than `grace` since its hold began (`since`: task key -> then; a task not
    in it begins now)."""
    idle_names = {i.name for i in idle}
    return {t.key for t in open
            if t.holder is not None and t.holder not in idle_names and t.holder not in away
            and now - since.get(t.key, now) < grace}


class PathHolds:
    """When each held task's hold began, across the coordinator's passes."""

    def __init__(self, *, beat_seconds: float = 0.0):
        """`beat_seconds` (resilience.heartbeat_seconds): the grace is at least `HOLD_BEATS` of them."""
        if beat_seconds < 0:
            raise ValueError(f"resilience.heartbeat_seconds must be >= 0, got {beat_seconds}")
        self.beat_seconds = beat_seconds
        self.since: dict[str, float] = {}  # held task key -> when its hold began (policy clock)
        self.grace = 0.0  # the grace of the last pass

    def release(self, open: Iterable[OpenTask], idle: Iterable[IdleIsland], *, now: float, median: float | None,
                away: Collection[str] = ()) -> list[OpenTask]:
        """The open tasks idle islands may take at `now` (those not held for their path's holder)."""
        open, idle = list(open), list(idle)
        self.grace = hold_grace(median=median, beat_seconds=self.beat_seconds)
        keys = held(open, idle, now=now, since=self.since, grace=self.grace, away=away)
        self.since = {k: self.since.get(k, now) for k in keys}
        return [t for t in open if t.key not in keys]

    def next_release(self) -> float | None:
        """When the earliest hold's grace ends (None: nothing is held)."""
        return min(self.since.values()) + self.grace if self.since else None
