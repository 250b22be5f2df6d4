"""Finished results picked up from the store: checked, told to the round policy, kept until applied.

One listing per results folder, not a check per task. One attempt per task is accepted: the current
one when it has reported, else an older one that reported late. A rejected current attempt opens the
next attempt (`acceptance.ResultChecks.requeue`), from the newest version when versions were committed
since its base. Each result's JSON is read once, by the checks, and handed to the policy and the outer
step, with the sha256 of the bytes checked (the outer step applies exactly those). A coordinator that
starts checks the results its board holds as received again (`recheck`); a received result found bad
later (`redo`) is withdrawn, and its path goes back to where it stood before it. A result the poison bound
holds (no honest result of its modules' roles to compare with yet, `acceptance`) is received, but no
round closes while it is held: it is judged again, within the same pass when another path's result gives
it a reference (`judge_held`), and redone when refused then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.islands.coordinator.task_board import RUNNING, TaskBoard, open_view
from dipaco.islands.coordinator.update_bound import HELD
from dipaco.rounds.fragments import FragmentSchedule
from dipaco.rounds.inputs import Result
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import inner_ref, read_result_meta, reported_results, result_ref_key
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import PathState, ResultMeta, Task

log = logging.getLogger(__name__)


class ResultIntake:
    def __init__(self, store: ModuleStore, checks: ResultChecks, *, inner_steps: int, clock: Callable[[], float],
                 fragments: FragmentSchedule | None = None):
        """`fragments`: which modules each task's result carries (`outer.fragments`; None: all of its path's)."""
        self.store, self.checks, self.inner_steps, self.clock = store, checks, inner_steps, clock
        self.fragments = fragments or FragmentSchedule.every_round()
        self.metas: dict[str, ResultMeta] = {}  # task key -> its received result's metadata, until applied
        self.digests: dict[str, dict[str, str]] = {}  # task key -> the sha256 of the bytes its checks read
        self.held: dict[str, float] = {}  # task key -> when its result arrived, received but held (`judge_held`)

    def receive(self, board: TaskBoard, policy: RoundPolicy) -> None:
        """Every open or assigned task's result that has arrived: received, or its attempt handed out again.
        A result the poison bound holds for want of a reference (`acceptance`) is received too (its island is
        free, the policy counts it) but no round closes while it is held (`judge_held`)."""
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
                    reason = self.checks.check(task, attempt, modules=self.carried(task))
                    if reason is not None and reason is not HELD:  # rejected: never applied; the current attempt is handed out again
                        if attempt == task.attempt:
                            board.tasks[key] = task = self.checks.requeue(task, reason)
                            requeued = True
                        continue
                    self._receive(board, policy, task, attempt, held=reason is HELD)
                    break
            if requeued and board.tasks[key].status == "open" and policy.rebase([open_view(task)]):
                self.checks.moved(task, board.move_to_newest(task, policy))  # versions were committed since its base
        self.judge_held(board, policy)

    def _receive(self, board: TaskBoard, policy: RoundPolicy, task: Task, attempt: int, *, held: bool) -> None:
        """Attempt `attempt` of `task` received: on the board and told to the policy (`held`: judged later)."""
        key = task.key
        board.tasks[key] = replace(task, status="received", result_attempt=attempt)
        meta = self.checks.accepted_meta(task, attempt)
        if meta is not None:  # the JSON the checks read: not read again here nor by the outer step
            self.metas[key] = meta
        if held:
            self.held[key] = self.clock()
        else:
            self.digests[key] = self.checks.accepted_digests(task, attempt)
        self.tell(policy, board.tasks[key], started=board.started.get(key), arrived=self.clock())
        board.paths[task.path] = replace(path_after(board.paths[task.path], task, self.meta(board.tasks[key])),
                                         update_scales=self.checks.accepted_scales(task, attempt))
        log.info("received %s (attempt %d)%s", key, attempt, " held for the poison bound's reference" if held else "")

    def judge_held(self, board: TaskBoard, policy: RoundPolicy) -> None:
        """Judge again each held result: within the bound, its digests kept for the outer step (and its scales
        in its path's state); refused, redone (`redo`); still without a reference, held on."""
        for key in list(self.held):
            task = board.tasks.get(key)
            if task is None or task.status != "received":
                del self.held[key]
                continue
            reason = self.checks.check(task, task.result_attempt, modules=self.carried(task))
            if reason is HELD:
                continue
            del self.held[key]
            if reason is not None:
                self.redo(board, policy, task, reason)
                continue
            self.metas[key] = self.checks.accepted_meta(task, task.result_attempt) or self.meta(task)
            self.digests[key] = self.checks.accepted_digests(task, task.result_attempt)
            scales = self.checks.accepted_scales(task, task.result_attempt)
            state = board.paths[task.path]
            if state.inner == inner_ref(path=task.path, round=task.round, attempt=task.result_attempt, link=task.link):
                board.paths[task.path] = replace(state, update_scales=scales)

    def meta(self, task: Task) -> ResultMeta:
        """A received task's result metadata: as the checks read it, else read (once) from the store."""
        if task.key not in self.metas:
            self.metas[task.key] = read_result_meta(self.store, round=task.round, path=task.path,
                                                    attempt=task.result_attempt, link=task.link)
        return self.metas[task.key]

    def tell(self, policy: RoundPolicy, task: Task, *, started: float | None, arrived: float) -> None:
        """Tell the policy that `task`'s result arrived at `arrived` (its attempt handed out at `started`)."""
        meta = self.meta(task)
        carried = self.carried(task)
        policy.received(Result(key=task.key, path=task.path, base=task.base, tokens=meta.tokens,
                               arrived=arrived, started=started, steps=meta.steps,
                               modules=None if carried is None else frozenset(carried),
                               chain=frozenset(map(result_ref_key, task.chain))))
        policy.measured(task.island, steps=meta.steps, seconds=meta.seconds)  # its island's speed (path moves)

    def carried(self, task: Task) -> list[str] | None:
        """The modules `task`'s result carries: those its round syncs (`outer.fragments`, `outer.private_modules`);
        None: all of its path's."""
        if self.fragments.sends_all:
            return None
        return self.fragments.synced(self.checks.topology.modules_of_path(task.path), round=task.round,
                                     step_offset=task.step_offset, steps=task.steps)

    def recheck(self, board: TaskBoard, policy: RoundPolicy) -> None:
        """A starting coordinator checks again every result its board holds as received and not yet applied
        (nothing in the store is trusted across a restart): a good one is told to the policy, a bad one redone."""
        for key, task in list(board.tasks.items()):
            if task.status != "received" or key in board.used:
                continue
            reason = self.checks.check(task, task.result_attempt, modules=self.carried(task), hold=False)
            if reason is None:
                self.metas[key] = self.checks.accepted_meta(task, task.result_attempt) or self.meta(task)
                self.digests[key] = self.checks.accepted_digests(task, task.result_attempt)
                self.tell(policy, task, started=None, arrived=self.clock())
            else:
                self.redo(board, policy, task, reason)

    def redo(self, board: TaskBoard, policy: RoundPolicy, task: Task, reason: str) -> None:
        """Withdraw the received result of `task` (bad: `reason`): the path's later tasks, which continue from
        it, are lost, the path's state goes back to before it, and `task` opens as its next attempt."""
        log.warning("%s: its received result is refused (%s); the path redoes it", task.key, reason)
        policy.withdraw(task.key)
        self.checks.forget(task, task.result_attempt)
        self.forget([task.key])
        later = [t for t in board.tasks.values() if t.path == task.path and t.key != task.key
                 and (t.base, t.link) > (task.base, task.link) and t.status not in ("lost", "cancelled")]
        for t in later:
            if t.status == "received":
                policy.withdraw(t.key)
                self.forget([t.key])
            board.tasks[t.key] = replace(t, status="lost")
        board.paths[task.path] = PathState(steps_done=task.step_offset, inner=task.inner_from,
                                           checkpoint=task.inner_checkpoint)
        board.tasks[task.key] = redone = self.checks.requeue(replace(task, status="assigned"), reason)
        if policy.rebase([open_view(redone)]):
            self.checks.moved(redone, board.move_to_newest(redone, policy))

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.held.pop(key, None)
            self.metas.pop(key, None)
            self.digests.pop(key, None)


def path_after(state: PathState, task: Task, meta: ResultMeta) -> PathState:
    """A path's state once `task`'s result (`meta`) is received: its steps on, its carried state the one the
    task left, in the store when the island uploaded it (`meta.inner_upload`), else held by that island."""
    ref = inner_ref(path=task.path, round=task.round, attempt=meta.attempt, link=task.link)
    if meta.inner_upload:
        return PathState(steps_done=task.step_offset + meta.steps, inner=ref, checkpoint=ref)
    held = meta.island == task.island  # the incarnation the board gave it to (a late older attempt: unknown)
    return PathState(steps_done=task.step_offset + meta.steps, inner=ref, checkpoint=state.checkpoint,
                     holder=meta.island, holder_incarnation=task.incarnation if held else None)
