"""Pacing an island's inner steps: pad each step to a fixed wall time by sleeping, then slow it down.

    pacer = Pacer(step_seconds=2.0, slowdown=3.0)       # faults.step_seconds, faults.slowdown
    pacer.pad(0.12, check=check)   # after a step that computed 0.12 s: sleeps 3 x 2.0 - 0.12 s (calling
                                   # check() every 50 ms), returns the seconds slept
    pacer.summary()        # steps, compute, padding, the slowest step, steps over the pace

A paced step takes max(compute, `step_seconds`) × `slowdown`: `step_seconds` stands in for a bigger model
on a machine of its own (bench/bench_islands.py paces 8 one-thread islands on 2 cores so they never
compete for them and wall-clock means what it would on separate machines); `slowdown` F > 1 makes an
injected straggler take F times a step's time. With neither (0 and 1) nothing sleeps. The compute and the
padding are recorded, so a benchmark can show the pace held (every step's compute under the pace).
The padding stands for compute, so what may interrupt a step interrupts it too: `check` (the island's
injected failures and cancellation) is called every `SLICE` seconds of it, and what it raises ends the
step there, lost like a step cut by a failure; a cut (`stop`) ends only the padding: the step was trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dipaco.islands.island.timing import stopped_by

SLICE = 0.05  # seconds of padding between two calls of `check`


@dataclass
class Pacer:
    step_seconds: float = 0.0  # pad every step to this wall time (0: no padding)
    slowdown: float = 1.0  # then stretch it this many times (an injected straggler)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.perf_counter
    steps: int = 0
    compute: float = 0.0  # seconds the steps computed
    padding: float = 0.0  # seconds slept after them
    slowest: float = 0.0  # the longest step's compute
    over_pace: int = 0  # steps whose compute alone exceeded step_seconds

    def __post_init__(self) -> None:
        if self.step_seconds < 0 or self.slowdown < 1:
            raise ValueError(f"a pace needs step_seconds >= 0 and slowdown >= 1, got {self.step_seconds} and "
                             f"{self.slowdown}")

    @property
    def active(self) -> bool:
        return self.step_seconds > 0 or self.slowdown > 1

    def pad(self, compute: float, *, check: Callable[[], None] | None = None,
            stop: type[Exception] | None = None, scale: float = 1.0) -> float:
        """After a step that computed `compute` seconds: sleep until it has taken its paced time
        (max(compute, step_seconds × scale) × slowdown; `scale`: this step's work in full steps, e.g. an elastic
        island's worker that computes twice its share of a batch), calling `check` every `SLICE` seconds; returns the
        seconds actually slept. A `stop` exception from `check` ends the padding there (the step is
        done: a cut task reports it); anything else `check` raises propagates, the padding so far recorded."""
        self.steps += 1
        self.compute += compute
        self.slowest = max(self.slowest, compute)
        pace = self.step_seconds * scale
        self.over_pace += pace > 0 and compute > pace
        started = self.clock()
        end = started + self.slowdown * max(compute, pace) - compute
        try:
            while (left := end - self.clock()) > 0:
                if check is not None and stopped_by(check, stop):
                    break
                self.sleep(min(left, SLICE))
        finally:
            slept = self.clock() - started
            self.padding += slept
        return slept

    def summary(self) -> str:
        """One log line (bench/bench_islands.py reads it back: `PACED` matches it)."""
        return (f"paced {self.steps} steps to {self.step_seconds:g}s x {self.slowdown:g}: compute {self.compute:.3f}s "
                f"(slowest {self.slowest:.3f}s, {self.over_pace} over the pace), padding {self.padding:.3f}s")


PACED = (r"paced (?P<steps>\d+) steps to (?P<pace>[\d.e+-]+)s x (?P<slowdown>[\d.e+-]+): compute (?P<compute>[\d.]+)s "
         r"\(slowest (?P<slowest>[\d.]+)s, (?P<over>\d+) over the pace\), padding (?P<padding>[\d.]+)s")
