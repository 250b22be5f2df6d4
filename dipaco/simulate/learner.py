"""One group of chips (a learner, or the whole data-parallel job) on the virtual clock.

It trains one piece of `Work` at a time and reacts to each chip failure in one of two ways:
- `restart`: it stops; it is back `restart_seconds` after its last failure (a failure during a restart
  starts it again) and resumes from its last checkpoint (every `checkpoint_steps` steps): the steps
  since are lost.
- `elastic`: the step in progress is lost (with `keeps_rows`, only the failed chip's share of it: the others
  keep the rows they computed, as an elastic island does), every chip pauses `reconfigure_seconds` to re-shard,
  and the group goes on without the failed chip; the chip returns `restart_seconds` later, which costs another
  pause. Fewer chips keep the step time (the batch shrinks), so a task takes as long but holds fewer
  chip-seconds. With `batch_rows` B, a step's whole rows split over the chips up, as an elastic island's tries
  do: c chips do the work of B / ceil(B / c) (8 rows over 3 chips: 3 rows on the busiest, 2.67 chips' worth).
  With `keeps_batch` (dipaco's elastic islands), the chips up train the whole batch instead: a step takes
  longer, by the chips' worth of work lost, and the failed chip's rows of the step in progress are trained again.
Progress is continuous time (`Work.done`: seconds at the whole group's speed); steps only matter for what a
failure throws away.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dipaco.simulate.clock import EventQueue

RESPONSES = ("restart", "elastic")
_EPS = 1e-9


@dataclass
class Work:
    """`seconds` of training (math.inf for a data-parallel job) in steps of `step` seconds."""

    seconds: float
    step: float
    not_before: float = 0.0  # it cannot start earlier (a download in flight)
    done: float = 0.0  # seconds trained
    chip_seconds: float = 0.0  # chip-seconds of those seconds
    tag: object = None  # the strategy's own record (the task)

    def complete_steps(self) -> float:
        """`done` rounded down to whole steps."""
        return math.floor(self.done / self.step + _EPS) * self.step


class Learner:
    def __init__(self, ident: int, chips: int, *, response: str, restart_seconds: float,
                 reconfigure_seconds: float, checkpoint_steps: int, queue: EventQueue,
                 on_done: Callable[[Learner, Work], None], on_lost: Callable[[float], None],
                 keeps_rows: bool = False, batch_rows: int = 0, keeps_batch: bool = False) -> None:
        if response not in RESPONSES:
            raise ValueError(f"learner failure response must be one of {RESPONSES}, got {response!r}")
        self.ident, self.chips, self.response = ident, chips, response
        self.restart_seconds, self.reconfigure_seconds = restart_seconds, reconfigure_seconds
        self.checkpoint_steps, self.keeps_rows, self.batch_rows = checkpoint_steps, keeps_rows, batch_rows
        self.keeps_batch = keeps_batch
        self.queue, self.on_done, self.on_lost = queue, on_done, on_lost
        self.up_chips = chips
        self.blocked_until = 0.0
        self.work: Work | None = None
        self.since = 0.0
        self._generation = 0
        self.failures = 0

    # --- time -------------------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Book the training between the last event and `now` (nothing changed in between)."""
        work = self.work
        if work is not None:
            start = max(self.since, self.blocked_until, work.not_before)
            if now > start:
                work.done += (now - start) * self.speed()
                work.chip_seconds += (now - start) * self.working_chips()
        self.since = now

    def speed(self) -> float:
        """`Work.done` per second: 1, or with `keeps_batch` the share of the group's work its chips up do."""
        if not self.keeps_batch:
            return 1.0
        return max(0.0, self.working_chips()) / self.chips

    def working_chips(self) -> float:
        """The chips' worth of work done per second: the chips up, or with `batch_rows` B, B / ceil(B / up) (a step's
        whole rows over the chips up: the busiest takes the most)."""
        up = self.up_chips
        if not self.batch_rows or up <= 0 or up >= self.chips:
            return float(up)
        return self.batch_rows / math.ceil(self.batch_rows / up)

    def _predict(self) -> None:
        self._generation += 1
        work = self.work
        if work is None or math.isinf(work.seconds):
            return
        start, speed = max(self.queue.now, self.blocked_until, work.not_before), self.speed()
        if speed > 0:  # no chip up: it finishes once one is back (`_chip_back` predicts again)
            self.queue.at(start + max(0.0, work.seconds - work.done) / speed, self._finish, self._generation)

    def _finish(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded by a failure or a pause
        self._advance(self.queue.now)
        work, self.work = self.work, None
        work.done = work.seconds
        self.on_done(self, work)

    # --- what the strategy does ---------------------------------------------------------------------------
    def give(self, work: Work) -> None:
        """Start `work` (the learner must have none)."""
        if self.work is not None:
            raise RuntimeError(f"learner {self.ident} is already training")
        self._advance(self.queue.now)
        self.work = work
        self._predict()

    def cancel(self) -> Work | None:
        """Stop the work now (the strategy no longer wants it): book the training up to now and hand it
        back (None when idle); its finish never comes."""
        self._advance(self.queue.now)
        work, self.work = self.work, None
        self._predict()  # a new generation: the scheduled finish is void
        return work

    def shorten(self) -> None:
        """Cut the work short: it ends with the step in progress (one step at least), then reports."""
        self._advance(self.queue.now)
        work = self.work
        steps = max(1, math.ceil(work.done / work.step - _EPS))
        work.seconds = min(work.seconds, steps * work.step)
        self._predict()

    def finish_horizon(self) -> Work | None:
        """Book the training up to now and hand back the unfinished work (None when idle)."""
        self._advance(self.queue.now)
        self._generation += 1
        return self.work

    # --- failures ----------------------------------------------------------------------------------------
    def fail(self) -> None:
        """A chip of this group fails now."""
        now = self.queue.now
        self._advance(now)
        self.failures += 1
        if self.response == "restart":
            self._throw_away(self.checkpoint_steps)
            self.blocked_until = max(self.blocked_until, now + self.restart_seconds)
        elif self.keeps_rows:
            self._lose_one_chips_step()
            self.blocked_until = max(self.blocked_until, now + self.reconfigure_seconds)
            self.up_chips -= 1
            self.queue.at(now + self.restart_seconds, self._chip_back)
        else:
            self._throw_away(1)
            self.blocked_until = max(self.blocked_until, now + self.reconfigure_seconds)
            self.up_chips -= 1
            self.queue.at(now + self.restart_seconds, self._chip_back)
        self._predict()

    def _chip_back(self) -> None:
        now = self.queue.now
        self._advance(now)
        self.up_chips += 1
        self.blocked_until = max(self.blocked_until, now + self.reconfigure_seconds)
        self._predict()

    def _lose_one_chips_step(self) -> None:
        """The failed chip's share of the step in progress is lost; the other chips' work is kept. With
        `keeps_batch`, its rows (1 / the chips up of the step's progress) are to be trained again."""
        work = self.work
        if work is None:
            return
        partial = work.done - work.complete_steps()
        if partial <= 0:
            return
        if self.keeps_batch:
            share = partial / max(1, self.up_chips)
            work.done -= share
            lost = share * self.chips
        else:
            lost = partial
        work.chip_seconds -= lost
        self.on_lost(lost)

    def _throw_away(self, every_steps: int) -> None:
        """Roll the work back to its last multiple of `every_steps` steps (a checkpoint, or the step start)."""
        work = self.work
        if work is None:
            return
        period = every_steps * work.step
        kept = math.floor(work.done / period + _EPS) * period
        lost = work.done - kept
        if lost <= 0:
            return
        lost_chip_seconds = lost * (self.chips if self.response == "restart" else self.up_chips)
        work.done = kept
        work.chip_seconds -= lost_chip_seconds
        self.on_lost(lost_chip_seconds)
