"""A straggler's path moves (async): at a task boundary, the path an island measured much slower than the
others trained last goes to a faster island once that path is behind, and the slow island takes the
faster island's path, which is ahead: paths rotate through the slow island.

    moves = PathMoves(margin=config.move_margin, enabled=config.mode == "async")
    moves.measure("island-3", steps=10, seconds=61.2)  # each result: its island's steps / seconds in steps
    moves.assign(open_tasks, idle_islands, busy={"island-0": 40, "island-1": 30})  # [(task key, island)]

Speeds are each island's steps per second, a running estimate (`SMOOTHING` on the newest result). An
island is slow when its speed x (1 + `rounds.move_margin`) is below the median speed of the other
measured islands; at least `MIN_OTHERS` of them must be measured (with one other, a slow island is not
told apart from a busy machine). When no idle island is slow, islands take tasks as `tasks.assign` says
(the island that trained a path last keeps it): no move within the margin, and a path never moves
between islands of about the same speed, so it does not go back and forth.

When an idle slow island's path P (the one it trained last) is open, a faster idle island takes P: one
with no open task of its own path first (it is free), else the one whose own path Q is furthest ahead of
P (more steps done); the slow island then takes Q (a swap). When no faster island is idle but one is
training a path ahead of P, the slow island waits: that island will be free first and take P. Otherwise
(no path is ahead of P, or the others have no work left) the slow island keeps P. An island pinned to
paths (`IdleIsland.pinned`) is never moved. The other tasks go as `tasks.assign` says. Sync rounds never
move paths: every path reports each round, so the slow island sets the round's length wherever its
path is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

from dipaco.rounds import tasks
from dipaco.rounds.inputs import IdleIsland, OpenTask

SMOOTHING = 0.5  # weight of the newest result in an island's running speed
MIN_OTHERS = 2  # measured islands besides one that it must be compared with


class PathMoves:
    """The islands' running speeds and the assignment that moves a straggler's path."""

    def __init__(self, *, margin: float, enabled: bool = True):
        """`margin` (rounds.move_margin): how much slower than the others' median an island must be, as a
        fraction (1.0: half their speed); 0 = paths never move. `enabled`: False in sync mode."""
        if margin < 0:
            raise ValueError(f"rounds.move_margin must be >= 0 (0 = off), got {margin}")
        self.margin, self.enabled = margin, enabled and margin > 0
        self.speeds: dict[str, float] = {}  # island -> steps per second (running estimate)

    def measure(self, island: str | None, *, steps: int, seconds: float | None) -> None:
        """`island` trained `steps` inner steps in `seconds` (its time in inner steps: not waiting for a
        hand-off or a download, which would make the island a path moves to look slow)."""
        if island is None or seconds is None or not math.isfinite(seconds) or seconds <= 0 or steps <= 0:
            return  # nothing measured (an island reports its seconds: untrusted)
        speed = steps / seconds
        old = self.speeds.get(island)
        self.speeds[island] = speed if old is None else SMOOTHING * speed + (1 - SMOOTHING) * old

    def slow(self, island: str) -> bool:
        """Is `island` slower than the median of the other measured islands by more than the margin?"""
        speed = self.speeds.get(island)
        others = [s for name, s in self.speeds.items() if name != island]
        if not self.enabled or speed is None or len(others) < MIN_OTHERS:
            return False
        return speed * (1 + self.margin) < statistics.median(others)

    def assign(self, open: Iterable[OpenTask], idle: Iterable[IdleIsland], *,
               busy: Mapping[str, int] | None = None) -> list[tuple[str, str]]:
        """(task key, island) for the open tasks idle islands take now; `busy`: island -> the steps its path
        had done when the task it trains started (`OpenTask.steps_done` of that task)."""
        open, idle, busy = list(open), sorted(idle, key=lambda i: i.name), busy or {}
        slow = [i for i in idle if self.slow(i.name) and not i.pinned]
        if not slow:
            return tasks.assign(open, idle)
        decisions: dict[str, str] = {}  # task key -> island
        waiting: set[str] = set()  # slow islands that take nothing now: a faster island will take their path
        for island in slow:
            left = [t for t in open if t.key not in decisions]
            mine = next((t for t in left if t.path == island.last_path), None)
            if mine is None or island.name in decisions.values():
                continue
            taker = self._taker(mine, left, [i for i in idle if i.name not in decisions.values()])
            if taker is None:
                if any(steps > mine.steps_done for name, steps in busy.items() if not self.slow(name)):
                    waiting.add(island.name)  # a path ahead of its path is training: that island takes this one
                continue
            decisions[mine.key] = taker.name
            theirs = next((t for t in left if t.path == taker.last_path and t.steps_done > mine.steps_done), None)
            if theirs is not None and island.may_take(theirs.path):
                decisions[theirs.key] = island.name  # a swap: the slow island takes the path ahead
        rest = tasks.assign([t for t in open if t.key not in decisions],
                            [i for i in idle if i.name not in decisions.values() and i.name not in waiting])
        return list(decisions.items()) + rest

    def _taker(self, mine: OpenTask, open: list[OpenTask], idle: list[IdleIsland]) -> IdleIsland | None:
        """The idle island, not slow, that takes a slow island's path `mine`: one with no open task of the
        path it trained last (it is free) first, else the one whose path is furthest ahead of `mine`; None
        when none is free or ahead (the path stays where it is)."""
        ahead = {t.path: t.steps_done for t in open}
        candidates = [i for i in idle if not self.slow(i.name) and i.may_take(mine.path)
                      and ahead.get(i.last_path, math.inf) > mine.steps_done]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (-ahead.get(i.last_path, math.inf), i.was_cut, i.name))
