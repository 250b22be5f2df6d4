"""DiLoCo rounds over `learners` learners, each training its own replica path of one shared model
(topology levels [1], replicas L: every module is shared by every path), decided by the real round
policy through `PolicyPort`.

A learner trains a task of `inner_steps` steps (its speed drawn per task) from the version the policy
gives it, uploads the pseudo-gradient (the syncer receives it `upload seconds` later) and then
- sync (`outer.mode: sync`): waits for the round to close, downloads the new version (`download
  seconds`) and starts the next task: transfers and stragglers block every learner;
- async (`outer.mode: async`): starts its next task at once from the newest version it can read
  (transfers overlap training, as in Decoupled DiLoCo); the policy closes rounds on its quorum and
  grace window and weights or drops stale results.
A failure rolls the learner's task back to its last inner checkpoint (`restart`) or costs it a step and
a pause (`elastic`); the task stays its own. Results applied by a committed round are useful; dropped
ones, and tasks unfinished or unapplied at the horizon, are lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from dipaco.model.topology import Topology
from dipaco.simulate.clock import EventQueue
from dipaco.simulate.failures import FailureModel, schedule_failures
from dipaco.simulate.learner import Learner, Work
from dipaco.simulate.ledger import Ledger
from dipaco.simulate.policy_port import Decision, PolicyPort
from dipaco.simulate.settings import Settings


def replica_topology(learners: int) -> Topology:
    """One shared model trained by `learners` replica paths (plain Decoupled DiLoCo)."""
    return Topology(levels=(1,), level_blocks=((0,),), private_blocks=frozenset(), private_embeddings=False,
                    replicas=learners)


@dataclass(frozen=True)
class Task:
    path: int
    base: int


@dataclass(frozen=True)
class RoundLog:
    """One round close: when, and what the policy decided for each received result."""

    time: float
    round: int
    decisions: tuple[Decision, ...]


class RoundsSimulation:
    def __init__(self, settings: Settings, failures: FailureModel, *, mode: str,
                 on_round: Callable[[RoundLog], None] | None = None) -> None:
        self.settings, self.failures = settings, failures
        self.outer = dataclasses.replace(settings.outer, mode=mode)
        self.queue = EventQueue()
        self.ledger = Ledger(chips=settings.total_chips, horizon=settings.horizon)
        self.policy = PolicyPort(replica_topology(settings.sim.learners), self.outer)
        self.received: list[tuple[Task, float]] = []  # results at the syncer, not yet decided: (task, chip-seconds)
        self.waiting: list[Learner] = []  # sync: learners that reported and wait for the round
        self.wake_scheduled: float | None = None
        self.on_round = on_round
        self.rounds: list[RoundLog] = []
        self.bytes_moved = 0.0
        sim = settings.sim
        self.learners = [
            Learner(i, sim.chips_per_learner, response=sim.learner_failure, restart_seconds=sim.restart_seconds,
                    reconfigure_seconds=sim.reconfigure_seconds, checkpoint_steps=sim.checkpoint_steps,
                    queue=self.queue, on_done=self._task_done, on_lost=self._lost)
            for i in range(sim.learners)]

    def run(self) -> Ledger:
        settings = self.settings
        for learner in self.learners:
            self._start_task(learner, not_before=0.0)
            times = self.failures.failure_times(learner.ident, learner.chips)
            schedule_failures(self.queue, times, learner.fail, until=settings.horizon)
        self.queue.run(settings.horizon)
        for learner in self.learners:
            work = learner.finish_horizon()
            if work is not None:
                self.ledger.lost += work.chip_seconds  # unfinished at the horizon
        self.ledger.lost += sum(chip_seconds for _, chip_seconds in self.received)  # received, never applied
        self.ledger.bytes_per_link = self.bytes_moved / len(self.learners)
        return self.ledger

    # --- learners ------------------------------------------------------------------------------------------
    def _start_task(self, learner: Learner, *, not_before: float) -> None:
        sim = self.settings.sim
        task = Task(path=learner.ident, base=self.policy.task_base(learner.ident))
        step = sim.step_seconds * self.failures.speed_factor()
        learner.give(Work(seconds=sim.inner_steps * step, step=step, not_before=not_before, tag=task))

    def _lost(self, chip_seconds: float) -> None:
        self.ledger.lost += chip_seconds

    def _task_done(self, learner: Learner, work: Work) -> None:
        now = self.queue.now
        upload = self.settings.transfer_seconds(self.settings.upload_bytes)
        self.bytes_moved += self.settings.upload_bytes
        self.queue.at(now + upload, self._receive, work.tag, work.chip_seconds)
        if self.outer.mode == "sync":
            self.waiting.append(learner)
        else:
            self.bytes_moved += self.settings.download_bytes  # the newest version, streamed while it trains
            self._start_task(learner, not_before=now)

    # --- the syncer ---------------------------------------------------------------------------------------
    def _receive(self, task: Task, chip_seconds: float) -> None:
        self.received.append((task, chip_seconds))
        self.policy.receive(task.path, task.base, self.queue.now)
        self._check()

    def _check(self) -> None:
        now = self.queue.now
        if self.policy.close_due(now):
            self._close(now)
            return
        wake = self.policy.wake_at()
        if wake is not None and wake > now and wake != self.wake_scheduled:
            self.wake_scheduled = wake
            self.queue.at(wake, self._check)

    def _close(self, now: float) -> None:
        decisions = self.policy.close(now)
        by_key = {}
        for task, chip_seconds in self.received:
            by_key.setdefault((task.path, task.base), []).append(chip_seconds)
        for decision in decisions:
            chip_seconds = by_key[(decision.path, decision.base)].pop()
            if decision.factor is None:
                self.ledger.lost += chip_seconds
            else:
                self.ledger.useful += chip_seconds
        self.received.clear()
        log = RoundLog(time=now, round=self.policy.committed, decisions=tuple(decisions))
        self.rounds.append(log)
        if self.on_round:
            self.on_round(log)
        if self.outer.mode == "sync":
            download = self.settings.transfer_seconds(self.settings.download_bytes)
            for learner in self.waiting:
                self.bytes_moved += self.settings.download_bytes
                self._start_task(learner, not_before=now + download)
            self.waiting.clear()


def simulate_rounds(settings: Settings, failures: FailureModel, *, mode: str) -> Ledger:
    return RoundsSimulation(settings, failures, mode=mode).run()
