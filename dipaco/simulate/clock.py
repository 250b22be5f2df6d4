"""A virtual clock: events in time order (heapq), ties broken by the order they were scheduled."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    """`at(t, fn, *args)` schedules `fn(*args)` at virtual time t; `run(until)` calls them in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()

    def at(self, time: float, fn: Callable, *args) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule an event at {time} before the clock's time {self.now}")
        heapq.heappush(self._heap, (time, next(self._order), fn, args))

    def run(self, until: float) -> None:
        """Call every event due up to `until` (events at exactly `until` included), then stop the clock there."""
        while self._heap and self._heap[0][0] <= until:
            time, _, fn, args = heapq.heappop(self._heap)
            self.now = time
            fn(*args)
        self.now = until
