"""Finished results picked up from the store: checked, told to the round policy, kept until applied.

One listing per results folder, not a check per task. One attempt per task is accepted: the current
one when it has reported, else an older one that reported late. A rejected current attempt opens the
next attempt (`acceptance.ResultChecks.requeue`), from the newest version when versions were committed
since its base. Each result's JSON is read once, by the checks, and handed to the policy and the outer step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.islands.coordinator.task_board import RUNNING, TaskBoard, open_view
from dipaco.rounds.inputs import Result
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import inner_ref, read_result_meta, reported_results
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import PathState, ResultMeta, Task

log = logging.getLogger(__name__)


class ResultIntake:
    def __init__(self, store: ModuleStore, checks: ResultChecks, *, inner_steps: int, clock: Callable[[], float]):
        self.store, self.checks, self.inner_steps, self.clock = store, checks, inner_steps, clock
        self.metas: dict[str, ResultMeta] = {}  # task key -> its received result's metadata, until applied

    def receive(self, board: TaskBoard, policy: RoundPolicy) -> None:
        """Every open or assigned task's result that has arrived: received, or its attempt handed out again."""
        reported: dict[int, dict[tuple[int, int], set[int]]] = {}  # round -> (path, link) -> attempts: one listing per round
        for key, task in list(board.tasks.items()):
            if task.status not in ("open", *RUNNING):
                continue
            if task.round not in reported:
                reported[task.round] = reported_results(self.store, task.round)
            attempts = reported[task.round].get((task.path, task.link), set())
            requeued = False
            for attempt in range(task.attempt, -1, -1):  # the current attempt first, then late older ones
                if attempt in attempts:
                    reason = self.checks.check(task, attempt)
                    if reason is not None:  # rejected: never applied; the current attempt is handed out again
                        if attempt == task.attempt:
                            board.tasks[key] = task = self.checks.requeue(task, reason)
                            requeued = True
                        continue
                    board.tasks[key] = replace(task, status="received", result_attempt=attempt)
                    meta = self.checks.accepted_meta(task, attempt)
                    if meta is not None:  # the JSON the checks read: not read again here nor by the outer step
                        self.metas[key] = meta
                    self.tell(policy, board.tasks[key], started=board.started.get(key), arrived=self.clock())
                    steps = self.meta(board.tasks[key]).steps
                    board.paths[task.path] = PathState(steps_done=task.step_offset + steps,
                                                       inner=inner_ref(path=task.path, round=task.round, attempt=attempt,
                                                                       link=task.link))
                    log.info("received %s (attempt %d)", key, attempt)
                    break
            if requeued and board.tasks[key].status == "open" and policy.rebase([open_view(task)]):
                self.checks.moved(task, board.move_to_newest(task, policy))  # versions were committed since its base

    def meta(self, task: Task) -> ResultMeta:
        """A received task's result metadata: as the checks read it, else read (once) from the store."""
        if task.key not in self.metas:
            self.metas[task.key] = read_result_meta(self.store, round=task.round, path=task.path,
                                                    attempt=task.result_attempt, link=task.link)
        return self.metas[task.key]

    def tell(self, policy: RoundPolicy, task: Task, *, started: float | None, arrived: float) -> None:
        """Tell the policy that `task`'s result arrived at `arrived` (its attempt handed out at `started`)."""
        meta = self.meta(task)
        policy.received(Result(key=task.key, path=task.path, base=task.base, tokens=meta.tokens,
                               arrived=arrived, started=started, steps=meta.steps))

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.metas.pop(key, None)
