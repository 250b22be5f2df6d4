"""DiLoCo rounds over `learners` learners, each training its own replica path of one shared model,
decided by the real round policy (`dipaco.rounds`, through the coordinator's bookkeeping in `syncer`).

    ledger = simulate_rounds(settings, failures, mode="async")

Each learner is an island pinned to its path (`pinned`, the default; unpinned, learners take any path as
the policy assigns, so a straggler's path moves: `dipaco.rounds.moves`, and a path that moves costs its
carried state's hand-off, AdamW's two float32 moments, before the task starts): it downloads its task's base version, trains
`inner_steps` steps (its speed drawn per task), uploads the pseudo-gradient, then waits for the policy's
next task (sync: after the round closes; async: as the policy says). A cancelled task stops at once; a
failure rolls the task back to its last checkpoint (`restart`) or costs a step (`keeps_rows`: the failed chip's
share of it) and a pause (`elastic`).
Applied results are useful (their work at nominal speed counts for goodput); dropped, cancelled,
unfinished or unapplied work is lost (docs/simulate.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from dipaco.model.topology import Topology
from dipaco.rounds.inputs import IdleIsland
from dipaco.rounds.plan import RoundPlan
from dipaco.simulate.clock import EventQueue
from dipaco.simulate.failures import FailureModel, schedule_failures
from dipaco.simulate.learner import Learner, Work
from dipaco.simulate.ledger import Ledger
from dipaco.simulate.settings import Settings
from dipaco.simulate.syncer import SimTask, Syncer


def replica_topology(learners: int) -> Topology:
    """One shared model trained by `learners` replica paths (plain Decoupled DiLoCo)."""
    return Topology(levels=(1,), level_blocks=((0,),), private_blocks=frozenset(), private_embeddings=False,
                    replicas=learners)


def island_name(learner: int) -> str:
    return f"learner-{learner:03d}"


@dataclass(frozen=True)
class RoundLog:
    """One round close: when, and the policy's plan (what it applied with which factor, what it dropped)."""

    time: float
    plan: RoundPlan


class RoundsSimulation:
    def __init__(self, settings: Settings, failures: FailureModel, *, mode: str,
                 topology: Topology | None = None, on_round: Callable[[RoundLog], None] | None = None,
                 rounds: int | None = None, pinned: bool = True, keeps_rows: bool = False,
                 batch_rows: int = 0, keeps_batch: bool = False) -> None:
        """`rounds`: stop handing out work once every path has had this many results applied (the real
        run's `run.rounds`, decided by the same policy); None: train to the horizon. `pinned`: learner i
        trains path i only; False: any path, as the policy assigns (the real islands), learner i first
        taking path i. `keeps_rows`: an elastic learner loses only the failed chip's share of the step in
        progress (dipaco's elastic islands), not the whole step; `batch_rows`: a shrunk learner splits a step's
        whole rows over its chips up (`Learner.working_chips`); `keeps_batch`: ... and trains the whole batch on
        them, its steps taking longer (`Learner.speed`)."""
        self.settings, self.failures = settings, failures
        self.closing = dataclasses.replace(settings.rounds, mode=mode)
        self.queue = EventQueue()
        self.ledger = Ledger(chips=settings.total_chips, horizon=settings.horizon)
        self.syncer = Syncer(topology or replica_topology(settings.sim.learners), self.closing,
                             inner_steps=settings.inner_steps, rounds=rounds)
        self.chip_seconds: dict[str, tuple[float, float]] = {}  # received results not yet decided: key -> (chip-seconds, work)
        self.uploading: set[int] = set()
        self.wake_scheduled: set[float] = set()
        self.on_round = on_round
        self.rounds: list[RoundLog] = []
        self.handed: list[tuple[float, SimTask, str]] = []  # every task handed out: (time, task, island)
        self.cancelled: list[tuple[float, SimTask, str]] = []  # every running task cancelled: (time, task, island)
        # the event trace, in order: ("result", time, task, tokens) when a result arrives, ("tick", time)
        # when the coordinator runs, ("stopped", time, task) when a learner stops a cancelled task it was
        # training (tests replay it through the real coordinator)
        self.trace: list[tuple] = []
        self.bytes_moved = 0.0
        self.pinned = pinned
        self.last_path: dict[str, int] = {}  # island -> the path it trained last (unpinned)
        self.trained_by: dict[int, str] = {}  # path -> the island that trained it last (holds its carried state)
        self.handoffs: list[tuple[float, int, str, str]] = []  # (time, path, from island, to island): paths moved
        sim = settings.sim
        self.learners = [
            Learner(i, sim.chips_per_learner, response=sim.learner_failure, restart_seconds=sim.restart_seconds,
                    reconfigure_seconds=sim.reconfigure_seconds, checkpoint_steps=sim.checkpoint_interval,
                    queue=self.queue, on_done=self._task_done, on_lost=self._lost, keeps_rows=keeps_rows,
                    batch_rows=batch_rows, keeps_batch=keeps_batch)
            for i in range(sim.learners)]

    def run(self) -> Ledger:
        settings = self.settings
        for learner in self.learners:
            for times in self._failure_streams(learner):
                schedule_failures(self.queue, times, lambda learner=learner: self._fail(learner),
                                  until=settings.horizon)
        self.queue.at(0.0, self._tick)
        self.queue.run(settings.horizon)
        for learner in self.learners:
            work = learner.finish_horizon()
            if work is not None:
                self.ledger.lost += work.chip_seconds  # unfinished at the horizon
        self.ledger.lost += sum(seconds for seconds, _ in self.chip_seconds.values())  # received, never applied
        self.ledger.bytes_per_link = self.bytes_moved / len(self.learners)
        return self.ledger

    # --- learners ------------------------------------------------------------------------------------------
    def _failure_streams(self, learner: Learner) -> list:
        """The learner's failure times: its group's, or with `keeps_batch` (an elastic island's workers) each chip's,
        failing again only once it is back (`Learner.restart_seconds` later); a trace's as they are."""
        if not learner.keeps_batch or self.failures.trace is not None:
            return [self.failures.failure_times(learner.ident, learner.chips)]
        return [self.failures.chip_failure_times(learner.ident, chip, down_seconds=learner.restart_seconds)
                for chip in range(learner.chips)]

    def _idle(self) -> list[IdleIsland]:
        now = self.queue.now
        return [IdleIsland(name=island_name(x.ident), pinned=(x.ident,) if self.pinned else (),
                           last_path=self.last_path.get(island_name(x.ident), x.ident))
                for x in self.learners
                if x.work is None and x.ident not in self.uploading
                and (x.response == "elastic" or now >= x.blocked_until)]  # a restarting learner is not alive

    def _holders(self) -> dict[int, str]:
        """Path -> the learner holding its carried state in memory, as the coordinator's board says
        (`TaskBoard.keeps_inner`): unpinned learners, at least one per path (fewer: they hand it off)."""
        if self.pinned or len(self.learners) < self.syncer.policy.grid.n_paths:
            return {}
        return self.trained_by

    def _away(self) -> set[str]:
        """The learners down (restarting; the simulator knows at once): a path they trained last does not
        wait for them."""
        now = self.queue.now
        return {island_name(x.ident) for x in self.learners if x.response == "restart" and now < x.blocked_until}

    def _fail(self, learner: Learner) -> None:
        learner.fail()
        if learner.work is None and learner.response == "restart":
            self.queue.at(learner.blocked_until, self._tick)  # it asks for work when it is back

    def _lost(self, chip_seconds: float) -> None:
        self.ledger.lost += chip_seconds

    def _task_done(self, learner: Learner, work: Work) -> None:
        self.uploading.add(learner.ident)
        self.bytes_moved += self.settings.upload_bytes
        upload = self.settings.transfer_seconds(self.settings.upload_bytes)
        self.queue.at(self.queue.now + upload, self._receive, learner, work)

    def _receive(self, learner: Learner, work: Work) -> None:
        self.uploading.discard(learner.ident)
        task: SimTask = work.tag
        tokens = max(1, round(work.chip_seconds))  # a shrunk (elastic) learner trains a smaller batch
        steps = max(1, round(work.seconds / work.step))  # fewer than asked when it was cut
        self.trace.append(("result", self.queue.now, task, tokens, steps))
        if self.syncer.received(task.key, tokens=tokens, steps=steps, now=self.queue.now, seconds=work.seconds):
            nominal = self.settings.sim.step_seconds / work.step  # < 1 on a slow learner
            self.chip_seconds[task.key] = (work.chip_seconds, work.chip_seconds * nominal)
        else:  # cancelled while it was uploading: ignored
            self.ledger.lost += work.chip_seconds
        self._tick()

    def _stop(self, task: SimTask, island: str) -> None:
        """A running task was cancelled: its learner stops it now (one uploading it finishes the upload)."""
        now = self.queue.now
        self.cancelled.append((now, task, island))
        learner = self.learner(island)
        if learner.work is None or learner.work.tag is not task:
            return  # trained already, uploading: `_receive` books it
        work = learner.cancel()
        self.ledger.lost += work.chip_seconds
        self.trace.append(("stopped", now, task))
        if now < learner.blocked_until and learner.response == "restart":
            self.queue.at(learner.blocked_until, self._tick)  # it asks for work when it is back

    # --- the coordinator ----------------------------------------------------------------------------------
    def _tick(self) -> None:
        """Coordinator passes at this instant until nothing changes (a real one polls again right away)."""
        now = self.queue.now
        self.trace.append(("tick", now))
        while True:
            decided = self.syncer.tick(now, self._idle(), holders=self._holders(), away=self._away())
            if decided.plan is not None:
                self._account(decided.plan, now)
            for task, island in decided.cancelled:
                self._stop(task, island)
            for task, island in decided.cut:
                self._cut(task, island)
            for task, island in decided.handed:
                self._start(task, island, now)
            if not decided.handed and decided.plan is None and not decided.cut:
                break
        for deadline in (self.syncer.grace_deadline(), self.syncer.next_cut(), self.syncer.next_release()):
            if deadline is not None and deadline > now and deadline not in self.wake_scheduled:
                self.wake_scheduled.add(deadline)
                self.queue.at(deadline, self._tick)

    def learner(self, island: str) -> Learner:
        return self.learners[int(island.removeprefix("learner-"))]

    def _start(self, task: SimTask, island: str, now: float) -> None:
        learner = self.learner(island)
        if self.pinned and learner.ident != task.path:
            raise AssertionError(f"task {task.key} went to {island}, not to the learner pinned to its path")
        self.handed.append((now, task, island))
        sim = self.settings.sim
        before = self.trained_by.get(task.path)  # its carried state is there
        moving = before is not None and before != island
        nbytes = self.settings.download_bytes + (self.settings.handoff_bytes if moving else 0.0)
        if moving:
            self.handoffs.append((now, task.path, before, island))
        self.last_path[island], self.trained_by[task.path] = task.path, island
        self.bytes_moved += nbytes
        step = sim.step_seconds * self.failures.speed_factor(learner.ident)
        download = self.settings.transfer_seconds(nbytes)
        learner.give(Work(seconds=task.steps * step, step=step, not_before=now + download, tag=task))

    def _cut(self, task: SimTask, island: str) -> None:
        """A running task was cut: its learner finishes the step in progress (one at least) and reports the
        steps trained (one uploading it already reports the whole task)."""
        now = self.queue.now
        learner = self.learner(island)
        self.trace.append(("cut", now, task))
        if learner.work is not None and learner.work.tag is task:
            learner.shorten()

    def _account(self, plan: RoundPlan, now: float) -> None:
        for verdict in plan.verdicts:
            chip_seconds, work = self.chip_seconds.pop(verdict.key)
            if verdict.factor is None:
                self.ledger.lost += chip_seconds
            else:
                self.ledger.useful += chip_seconds
                self.ledger.useful_work += work
        log = RoundLog(time=now, plan=plan)
        self.rounds.append(log)
        if self.on_round:
            self.on_round(log)


def simulate_rounds(settings: Settings, failures: FailureModel, *, mode: str) -> Ledger:
    return RoundsSimulation(settings, failures, mode=mode).run()
