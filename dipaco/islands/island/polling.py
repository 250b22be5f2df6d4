"""A pull-based island: asks for tasks through the store's board, trains them, pushes the results.

    dipaco island --config configs/tiny.yaml --run runs/tiny                 # any path, until the run ends
    dipaco island --config configs/tiny.yaml --run runs/tiny --pull --path 3 # pinned to path 3
    torchrun --nproc-per-node 2 -m dipaco -- island ...                      # DDP inside the island

In Python (the `dipaco island` stage builds the `IslandSetup` from the config):

    IslandWorker(setup, name="island-0").run()

The island writes only its heartbeat (`presence`), its results, its paths' carried states (kept in
memory, `held`: uploaded as a checkpoint every few tasks, on a path's last task, and handed off when it
lets the path go: it takes another path, the board gives the path to another island, or it stops before
the run's end) and its byte counts (`report_traffic`: after each task, every `ledger.IDLE_EVERY` heartbeats
while idle, when it stops); it runs the task
the board assigns to its name and incarnation, stops a task the board no longer wants
(`cancellation`), lives through injected failures (`faults`), and stops when the store has committed
the run's last round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from dipaco.islands.island import ddp as ddp_mod
from dipaco.islands.island.cancellation import BoardWatch, TaskCancelled
from dipaco.islands.island.checkpoint import InnerCheckpoint, task_path_of
from dipaco.islands.island.faults import FaultClock, IslandFailure, check_faults, no_faults
from dipaco.islands.island.held import HeldState, awaiting_handoff
from dipaco.islands.island.held_modules import HeldModules
from dipaco.islands.island.presence import Presence
from dipaco.islands.island.training import IslandSetup, push_result, train_task
from dipaco.store.board import read_board
from dipaco.store.ledger import IDLE_EVERY, publish_counts
from dipaco.store.module_store import StoreError
from dipaco.store.records import ResultMeta, Task
from dipaco.store.run_state import run_finished

log = logging.getLogger(__name__)


class IslandWorker:
    def __init__(self, setup: IslandSetup, *, name: str, pinned: list[int] | None = None,
                 clock: Callable[[], float] = time.monotonic, faults: FaultClock | None = None,
                 ctx: ddp_mod.DDPContext | None = None):
        self.setup, self.store, self.clock, self.ctx = setup, setup.store, clock, ctx
        self.faults = faults or no_faults()
        self.presence = Presence(setup.store, name=name, pinned=sorted(pinned or []), faults=self.faults)
        watching = setup.cancellable and ctx is None  # async only; DDP ranks must not part ways
        self.board = BoardWatch(setup.store, island=name, clock=clock,
                                every=setup.resilience.heartbeat_seconds if watching else None)
        self.held = HeldState(setup.store)  # the carried state of the path it trained last (dipaco.carried.state)
        self.modules = HeldModules()  # its path's modules as it last loaded them, and its last uploads (compression.download)
        self.waiting: dict[str, float] = {}  # "key#attempt" -> since when (island clock) it waits for a hand-off
        self.down_until: float | None = None  # an injected death: back then (island clock)
        self.tasks_done = 0
        self.checkpoint = (setup.checkpoints / f"{name}.safetensors"
                           if setup.checkpoints is not None and setup.resilience.checkpoint_steps else None)
        self.resumed: list[tuple[str, int]] = []  # (task key, steps) of the tasks resumed from the checkpoint
        self.cancelled: list[str] = []  # "key#attempt" of the tasks it stopped because the board no longer wanted them
        self.reported: tuple[float, object] | None = None  # (island clock, counts) of its last traffic report
        self.ask_for_checkpointed_path()

    @property
    def name(self) -> str:
        return self.presence.name

    @property
    def status(self) -> str:
        return self.presence.status

    @property
    def last_path(self) -> int | None:
        return self.presence.last_path

    def heartbeat(self) -> None:
        self.presence.beat()

    def next_task(self) -> Task | None:
        """The task the board assigns to this incarnation that it has not finished yet."""
        board = read_board(self.store)
        if board is None:
            return None
        self._hand_off_if_asked(board.tasks.values())
        me = self.presence
        for task in sorted(board.tasks.values(), key=lambda t: (t.base, t.path)):
            if (task.status in ("assigned", "cut") and task.island == me.name and task.incarnation == me.incarnation
                    and f"{task.key}#{task.attempt}" not in me.finished):
                return task
        return None

    def execute(self, task: Task) -> ResultMeta | None:
        """Train `task` and push its result; None when an injected failure killed it or the board stopped
        wanting its result."""
        self.presence.training(task)
        self.heartbeat()
        if self.ctx is not None:
            ddp_mod.broadcast(self.ctx, task)
        saved = InnerCheckpoint.load(self.checkpoint) if self.checkpoint is not None else None
        if saved is not None and saved.matches(task):
            self.resumed.append((task.key, saved.steps))
        watch = self.board.watch(task)

        def check() -> None:
            check_faults(self.faults, self.presence)
            watch()

        if self.held.path != task.path:
            self.held.hand_off()  # it lets its last path go: another island may take it on
        try:
            out = train_task(self.setup, task, ctx=self.ctx, held=self.held, check=check, checkpoint=self.checkpoint,
                             modules=self.modules)
        except IslandFailure:
            self._go_down()
            return None
        except TaskCancelled as why:
            return self._drop(task, str(why))
        except StoreError as err:  # e.g. its base version pruned: moot when the task was cancelled meanwhile
            if self.board.wanted(task):
                raise
            return self._drop(task, f"{err}; the board no longer wants it")
        # handed off with the result when the path will move (the board says so), or inside a DDP island (its
        # other ranks read it from the store)
        meta, stats, ref = push_result(self.setup, task, out, island=self.name,
                                       handing_off=not task.keep_inner or self.ctx is not None, modules=self.modules)
        self.drop_checkpoint()  # the result is in the store
        self.held.keep(ref, task.path, out.carried, uploaded=bool(meta.inner_upload))
        self.presence.finished_task(task)
        self.tasks_done += 1
        self.heartbeat()
        self.report_traffic()
        log.info("island %s: %s attempt %d done in %.1fs, loss %.3f, %d bytes up (%s)%s", self.name, task.key,
                 task.attempt, meta.seconds, meta.train_loss, meta.bytes, meta.compression,
                 f", error-feedback residual {meta.bytes_residual} bytes in its inner state" if meta.bytes_residual else "")
        return meta

    def poll(self) -> bool:
        """One look at the board (running the assigned task, if any); True when a task ran."""
        if self.down_until is not None:
            if self.clock() < self.down_until:
                return False
            self.down_until, self.presence.silent = None, False
            self.ask_for_checkpointed_path()
            log.warning("island %s is back as incarnation %s", self.name, self.presence.incarnation)
        if self.faults.due():
            self.faults.fail()
            if self.faults.mode == "die":
                self._go_down()
                return False
        self.heartbeat()
        task = self.next_task()
        if task is None:
            if self.reported is None or self.clock() - self.reported[0] >= IDLE_EVERY * self.setup.resilience.heartbeat_seconds:
                self.report_traffic(only_if_changed=True)
            return False
        if self._awaiting_handoff(task):
            return False
        return self.execute(task) is not None

    def report_traffic(self, *, only_if_changed: bool = False) -> None:
        """Publish this island's byte counts so far (`dipaco.store.ledger`); with `only_if_changed`, not when
        its store client moved nothing since the last report. A store error is logged, not raised."""
        if only_if_changed and self.reported is not None and self.store.traffic.counts() == self.reported[1]:
            return
        try:
            publish_counts(self.store, owner=self.name, role="island")
        except StoreError as err:
            log.warning("island %s: could not publish its byte counts: %s", self.name, err)
            return
        self.reported = (self.clock(), self.store.traffic.counts())

    def run(self, *, poll_seconds: float = 0.1, max_tasks: int | None = None) -> int:
        """Work until the run's last round is committed (or `max_tasks` are done); returns tasks done."""
        stopped = False
        try:
            with self.presence.beating(self.setup.resilience.heartbeat_seconds):
                while not run_finished(self.store):
                    if max_tasks is not None and self.tasks_done >= max_tasks:
                        break
                    if not self.poll():
                        time.sleep(poll_seconds)
            stopped = True
        finally:
            self._hand_off_on_stop()
            if stopped:
                self.report_traffic()  # after the last heartbeat ("done") and the hand-off's upload
            if self.ctx is not None:
                ddp_mod.broadcast(self.ctx, None)
        return self.tasks_done

    def _drop(self, task: Task, why: str) -> None:
        """Stop `task` without a result: its inner checkpoint goes (it can never be resumed), then idle."""
        self.drop_checkpoint()
        self.setup.models.release_gradients()
        self.cancelled.append(f"{task.key}#{task.attempt}")
        self.presence.idle()
        self.heartbeat()
        log.warning("island %s: stopped %s (%s); asking for work", self.name, task.key, why)

    def drop_checkpoint(self) -> None:
        """Remove the island's inner checkpoint: its task's result is in the store, or the task is dropped."""
        if self.checkpoint is not None:
            self.checkpoint.unlink(missing_ok=True)

    def ask_for_checkpointed_path(self) -> None:
        """A (re)started island with an inner checkpoint reports its path as the one it trained last, so
        the coordinator hands it that path's task first (it resumes when the task is the same)."""
        if self.checkpoint is not None:
            path = task_path_of(self.checkpoint)
            if path is not None:
                self.presence.last_path = path

    def _go_down(self) -> None:
        """An injected death: silent for `return_after`, then a new incarnation with nothing cached."""
        self.presence.silent = True
        self.down_until = self.clock() + self.faults.return_after
        self.presence.reincarnate()
        self.held.forget()
        self.modules.forget()

    def _hand_off_on_stop(self) -> None:
        """Stopping before the run's end (`max_tasks`, SIGTERM, SIGINT): hand the held state off, so its path
        moves on exactly (a failing store is logged: the path then resumes from its last checkpoint)."""
        try:
            if not run_finished(self.store):
                self.held.hand_off()
        except (StoreError, OSError) as err:
            log.warning("island %s: could not hand path %s's carried state off (%s)", self.name, self.held.path, err)

    def _awaiting_handoff(self, task: Task) -> bool:
        """Whether `task` waits for the live island holding its carried state to hand it off (at most
        `resilience.heartbeat_timeout` on this island's clock; then it resumes from the path's checkpoint)."""
        key = f"{task.key}#{task.attempt}"
        if not awaiting_handoff(self.store, task, held=self.held):
            self.waiting.pop(key, None)
            return False
        since = self.waiting.setdefault(key, self.clock())
        if self.clock() - since < self.setup.resilience.heartbeat_timeout:
            return True
        del self.waiting[key]
        log.warning("island %s: %s's carried state was not handed off by island %s within %.1fs; it resumes from "
                    "the path's checkpoint", self.name, task.key, task.handoff_from, self.clock() - since)
        return False

    def _hand_off_if_asked(self, tasks: Iterable[Task]) -> None:
        """Upload the held carried state when the board gives its path's next task to another island."""
        if any(t.handoff_from == self.name and t.inner_from == self.held.ref and t.status in ("assigned", "cut")
               for t in tasks):
            self.held.hand_off()


def follow_leader(setup: IslandSetup, ctx: ddp_mod.DDPContext) -> int:
    """A non-zero DDP rank: train whatever task rank 0 broadcasts, until it broadcasts None."""
    done, modules = 0, HeldModules()  # each rank holds its own copy of the path's modules
    while (task := ddp_mod.broadcast(ctx, None)) is not None:
        train_task(setup, task, ctx=ctx, modules=modules)
        done += 1
    return done
