"""The task board in the coordinator's memory: every task and path state, changed only by replacing a
frozen record (`dataclasses.replace`), so what was last written is never aliased.

    board, last_stats, applied = resume_board(store, n_paths=topology.n_paths)
    board.open_paths(policy); board.reassign_lost(policy, liveness, now); board.assign(policy, liveness, now)
    board.write(store, lease)            # tasks.json, only when something changed

A path gets a task from the newest version, continuing its steps and inner state (async: also its
results not yet applied, `Task.chain`, and only the steps it still owes); open tasks move to the newest
version at each commit; a running task is cut when the policy says (async: it reports what it trained),
or cancelled when its result could no longer be applied, and its path gets a fresh task; a lost task
is retried or replaced as the policy says. Idle islands take open tasks as the policy assigns them (a
straggler's path moves to a faster island, `dipaco.rounds.moves`; the island holding its carried state
hands it off, `Task.handoff_from`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from dipaco.islands.coordinator.heartbeats import Liveness
from dipaco.rounds.inputs import IdleIsland, OpenTask, Running
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import read_board, read_manifest, result_ref, write_board
from dipaco.store.lease import Lease
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Board, PathState, RoundStats, Task, task_key
from dipaco.store.run_state import committed_record, first_inner

log = logging.getLogger(__name__)


class TaskBoard:
    def __init__(self, *, committed: int, tasks: dict[str, Task], paths: dict[int, PathState],
                 used: set[str] | None = None, written: str | None = None, inner_steps: int = 1):
        self.committed, self.inner_steps = committed, inner_steps
        self.tasks, self.paths = tasks, paths
        self.used: set[str] = used or set()  # task keys applied or dropped by committed rounds
        self.started: dict[str, float] = {}  # task key -> when its current attempt was handed out (clock)
        self.cut_islands: set[str] = set()  # islands a task of which was cut (stragglers), this coordinator's life
        self.carried: Callable[[Task], list[str] | None] = lambda task: None  # the modules a task's result carries (fragments)
        self.capacity: Callable[[str | None], float] = lambda island: 1.0  # share of an island's workers it has now
        self.expected_islands = 0  # islands the run's launcher starts (`dipaco train`); 0 = not known
        self._written = written  # the board's JSON as last written
        self._snapshot: tuple | None = None  # (round, tasks, paths) as last written or found unchanged

    # --- views ---------------------------------------------------------------------------------------
    def open_tasks(self) -> list[OpenTask]:
        """The open tasks, each with its path's holder when the island that holds the path's carried state in
        memory holds the state the task starts from (`holds.PathHolds` may keep the task for that island)."""
        return [replace(open_view(t), holder=self.holder_of(t)) for t in self.tasks.values() if t.status == "open"]

    def holder_of(self, task: Task) -> str | None:
        state = self.paths.get(task.path)
        return state.holder if state is not None and state.inner == task.inner_from else None

    def away(self, liveness: Liveness, now: float) -> set[str]:
        """The holders an open task does not wait for: dead, back as another incarnation (it holds nothing),
        or cut as stragglers."""
        gone = {s.holder for s in self.paths.values() if s.holder is not None
                and (not liveness.alive(s.holder, now)
                     or liveness.seen[s.holder].beat.incarnation != s.holder_incarnation)}
        return gone | self.cut_islands

    def running(self) -> list[Running]:
        return [Running(key=t.key, path=t.path, base=t.base, started=self.started.get(t.key), cut=t.status == "cut",
                        steps=t.steps or None, modules=_frozen(self.carried(t)), capacity=self.capacity(t.island))
                for t in self.tasks.values() if t.status in RUNNING]

    def in_flight(self) -> list[Task]:
        return [t for t in self.tasks.values() if t.status in ("open", *RUNNING)]

    def idle_islands(self, liveness: Liveness, now: float) -> list[IdleIsland]:
        busy = {t.island for t in self.tasks.values() if t.status in RUNNING}
        return [IdleIsland(name=name, pinned=tuple(seen.beat.pinned), last_path=seen.beat.last_path,
                           was_cut=name in self.cut_islands)
                for name, seen in sorted(liveness.seen.items())
                if name not in busy and liveness.alive(name, now) and seen.beat.status == "idle"]

    # --- changes -------------------------------------------------------------------------------------
    def new_task(self, path: int, policy: RoundPolicy) -> Task:
        """A task for `path` from the newest version, continuing the path's steps, inner state and received
        results not yet applied (`chain`), for the steps it still owes (at most inner.steps); on the board."""
        state = self.paths[path]
        chain = tuple(result_ref(round=t.round, path=path, attempt=t.result_attempt, link=t.link)
                      for t in sorted(self.tasks.values(), key=lambda t: (t.base, t.link))
                      if t.path == path and t.status == "received" and t.key not in self.used)
        link = 0
        while task_key(path, self.committed, link) in self.tasks or task_key(path, self.committed, link) in self.used:
            link += 1
        owed = policy.outstanding(path)
        steps = self.inner_steps if owed is None else max(1, min(self.inner_steps, owed))
        task = Task.open(path=path, base=self.committed, step_offset=state.steps_done, inner_from=state.inner,
                         link=link, chain=chain, steps=0 if steps == self.inner_steps else steps,
                         inner_checkpoint=state.checkpoint)
        self.tasks[task.key] = task
        return task

    def open_paths(self, policy: RoundPolicy) -> None:
        """A task for every path the policy names (none in flight, work still owed)."""
        busy = {t.path for t in self.in_flight()}
        for path in policy.paths_to_open(busy=busy):
            self.new_task(path, policy)

    def move_to_newest(self, stale: Task, policy: RoundPolicy) -> Task:
        """Replace the open task `stale` by its path's task from the newest version; returns it."""
        del self.tasks[stale.key]
        task = self.new_task(stale.path, policy)
        log.info("%s moved to version %d as %s", stale.key, self.committed, task.key)
        return task

    def rebase_open(self, policy: RoundPolicy) -> None:
        """Open tasks nobody has taken move to the newest version (a returning island never gets an old one)."""
        for stale in policy.rebase(self.open_tasks()):
            self.move_to_newest(self.tasks[stale.key], policy)

    def cancel_doomed(self, policy: RoundPolicy, *, max_staleness: int) -> int:
        """Cancel the running tasks whose results could no longer be applied (`RoundPolicy.cancel`, after a
        commit): status `cancelled` (its island stops when it next reads the board), and the path an open
        task from the newest version. Returns how many."""
        doomed = policy.cancel(self.running())
        for key in doomed:
            task = self.tasks[key]
            self.tasks[key] = replace(task, status="cancelled")
            self.started.pop(key, None)
            fresh = self.new_task(task.path, policy)
            log.warning("%s: cancelled on island %s (%d versions behind version %d, rounds.max_staleness %d); "
                        "path %d trains on as %s", key, task.island, self.committed - task.base, self.committed,
                        max_staleness, task.path, fresh.key)
        return len(doomed)

    def cut(self, policy: RoundPolicy, now: float) -> int:
        """Cut the running tasks the policy names (`RoundPolicy.cut`): status `cut`, so their islands stop
        and report the steps they trained. Returns how many."""
        keys = policy.cut(self.running(), now)
        for key in keys:
            task = self.tasks[key]
            self.tasks[key] = replace(task, status="cut")
            if task.island is not None:
                self.cut_islands.add(task.island)
            log.info("%s: cut on island %s (%d versions behind, %.1fs running): it reports what it trained", key,
                     task.island, self.committed - task.base, now - self.started.get(key, now))
        return len(keys)

    def reassign_lost(self, policy: RoundPolicy, liveness: Liveness, now: float) -> None:
        """Tasks whose island stopped heart-beating or came back as a new incarnation: the next attempt
        opens, or (the policy's `on_lost`) the path gets a task from the newest version."""
        for key, task in list(self.tasks.items()):
            if task.status not in RUNNING:
                continue
            alive = liveness.alive(task.island, now)
            beat = liveness.seen[task.island].beat if alive else None
            came_back = beat is not None and beat.incarnation != task.incarnation
            if alive and not came_back:
                continue
            resumable = came_back and beat.last_path == task.path  # it reports its checkpointed path
            if policy.on_lost(task.base, resumable=resumable) == "replace":
                log.warning("%s: island %s lost it; replaced by a task from version %d", key, task.island, self.committed)
                self.tasks[key] = replace(task, status="lost")
                self.new_task(task.path, policy)
            else:
                log.warning("%s: island %s lost it; attempt %d is open", key, task.island, task.attempt + 1)
                self.tasks[key] = replace(task, status="open", island=None, incarnation=None, attempt=task.attempt + 1)

    def assign(self, policy: RoundPolicy, liveness: Liveness, now: float) -> None:
        """Idle islands take open tasks as the policy says (a straggler's path may move to a faster island:
        the island holding its carried state hands it off, `handoff_from`)."""
        busy = {t.island: t.step_offset for t in self.tasks.values() if t.status in RUNNING and t.island is not None}
        for key, island in policy.assign(self.open_tasks(), self.idle_islands(liveness, now), busy=busy, now=now,
                                         away=self.away(liveness, now)):
            task = self.tasks[key]
            self.tasks[key] = replace(task, status="assigned", island=island,
                                      incarnation=liveness.seen[island].beat.incarnation,
                                      handoff_from=self.handoff_from(task, island, liveness, now),
                                      keep_inner=self.keeps_inner(task.path, island, liveness, now))
            self.started[key] = now
            log.info("%s attempt %d -> island %s", key, task.attempt, island)

    def keeps_inner(self, path: int, island: str, liveness: Liveness, now: float) -> bool:
        """Whether `island` keeps `path`'s carried state in memory after its task, the path's next task being
        expected back on it: it is pinned to that path alone, or every path can have a live island of its own.
        Otherwise (fewer islands than paths: they take the paths in turn) it hands the state off with its result.
        While fewer islands have joined than the launcher starts (`expected_islands`), those count as working."""
        if tuple(liveness.seen[island].beat.pinned) == (path,):
            return True
        working = [n for n, seen in liveness.seen.items() if liveness.alive(n, now) and seen.beat.status != "done"]
        joining = len(liveness.seen) < self.expected_islands
        return max(len(working), self.expected_islands if joining else 0) >= len(self.paths)

    def handoff_from(self, task: Task, island: str, liveness: Liveness, now: float) -> str | None:
        """The island that must hand `task`'s carried state over to `island` (`dipaco.carried.state`): the
        one holding it in memory only, when it is another island and still alive as the same incarnation;
        None when the state is in the store, held by `island` itself, or lost with its holder (the task
        then resumes from the path's last checkpoint)."""
        state = self.paths[task.path]
        holder = state.holder
        if holder is None or holder == island or state.inner != task.inner_from or not liveness.alive(holder, now):
            return None
        return holder if liveness.seen[holder].beat.incarnation == state.holder_incarnation else None

    def settle(self, used: set[str]) -> list[str]:
        """After a commit: `used` tasks (applied or dropped) and lost or cancelled ones leave the board (the
        manifests keep the record); returns their keys."""
        self.used |= used
        gone = [k for k, t in self.tasks.items() if k in self.used or t.status in ("lost", "cancelled")]
        for key in gone:
            del self.tasks[key]
            self.started.pop(key, None)
        return gone

    # --- the store's copy ----------------------------------------------------------------------------
    def snapshot(self) -> Board:
        return Board(round=self.committed, tasks=dict(self.tasks), paths=dict(self.paths))

    def write(self, store: ModuleStore, lease: Lease) -> None:
        """tasks.json, when the board changed since it was last written (checked by identity first)."""
        snapshot = (self.committed, dict(self.tasks), dict(self.paths))
        if snapshot == self._snapshot:
            return  # nothing changed since the last pass: not even serialised (256 tasks' JSON every tick at 16x16)
        board = self.snapshot()
        written = board.to_json()
        if written != self._written:
            lease.check()
            write_board(store, board)
            self._written = written
        self._snapshot = snapshot


RUNNING = ("assigned", "cut")  # an island has it


def _frozen(modules: list[str] | None) -> frozenset[str] | None:
    return None if modules is None else frozenset(modules)


def open_view(task: Task) -> OpenTask:
    """An open task as the policy sees it."""
    return OpenTask(key=task.key, path=task.path, base=task.base, steps_done=task.step_offset)


def resume_board(store: ModuleStore, *, n_paths: int,
                 inner_steps: int = 1) -> tuple[TaskBoard, RoundStats | None, list[tuple[int, int, int | None, str]]]:
    """The board after the store's last commit: `tasks.json` when it is at least as new as the commit,
    else the commit's own board; with the last round's stats and the (round, path, steps, key) of every
    applied result (the manifests say which tasks are used)."""
    committed = store.current_round()
    board = on_disk = read_board(store)
    committed_board, last_stats = committed_record(store)
    if committed_board is not None and (board is None or board.round < committed_board.round):
        board = committed_board  # a crash between the commit and the next board write
    tasks = dict(board.tasks) if board else {}
    known = board.paths if board else {}
    first = first_inner(store) if len(known) < n_paths else None  # one look, not one per path
    paths = {p: known.get(p) or PathState(steps_done=0, inner=first, checkpoint=first) for p in range(n_paths)}
    used: set[str] = set()
    applied: list[tuple[int, int, int | None]] = []
    for r in range(1, committed + 1):
        manifest = read_manifest(store, r)
        if manifest is not None:
            used |= manifest.keys
            applied += [(r, e.path, e.steps, e.key) for e in manifest.applied]
    for key in [k for k in tasks if k in used]:
        del tasks[key]  # applied by a committed round whose board update was lost in a crash
    written = on_disk.to_json() if on_disk else None
    board = TaskBoard(committed=committed, tasks=tasks, paths=paths, used=used, written=written, inner_steps=inner_steps)
    return board, last_stats, applied
