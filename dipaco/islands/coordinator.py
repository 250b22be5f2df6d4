"""The coordinator service: the single writer of the task board, module versions and outer state.

    dipaco coordinator --config configs/tiny.yaml --run runs/tiny      # islands run elsewhere
    dipaco train       --config configs/tiny.yaml --run runs/tiny      # the same, plus local islands

`Coordinator.tick()` does one pass, and everything it decides it reads back from the store:
1. reads the islands' heartbeats (one listing; only the files that changed since the last pass are
   read); an island whose `seq` has not changed for `resilience.heartbeat_timeout` seconds (coordinator
   clock), or that came back as a new incarnation, has lost its task;
2. picks up finished results (one listing per results folder, not a check per task; one attempt per
   task is accepted: the current one when it has reported, else an older one that reported late);
   each result's JSON is read once, by the validator, and handed to the policy and the outer step;
3. opens a task for every path that has none in flight, from the newest module version;
4. hands a lost task to another island as the next attempt (in async mode a lost task from an old
   version is replaced by one from the newest version);
5. closes the round when the round policy says so: applies the outer step it plans, writes
   module version t, the round manifest `rounds/round-t.json` (which results were applied), then
   `state.json`, the commit point, which also holds the board after the round (every task and path
   state) and the round's `RoundStats` (train.json's row); tasks still open move to version t,
   running tasks whose results could no longer be applied are cancelled (async, below), reported
   paths get new ones;
6. assigns open tasks to idle islands (after any commit, so always from the newest version): an
   island pinned with `--path` only takes its paths, and an island prefers the path it trained last
   (its inner optimiser state is then already local).

**Cancellation** (async; the rule is `RoundPolicy.cancel`'s). When a commit leaves a running task
more than `rounds.max_staleness` versions behind, its result could only be dropped, so in the same
settling of the board the task gets status `cancelled` and its path an open task from the newest
version (continuing the path's steps and inner state, as any new task). Why this way: the board is
the one channel the coordinator has to an island, so the cancellation is written there, inside the
commit's board (a restart sees it); the island, which reads the board every
`resilience.heartbeat_seconds` while it trains in async mode, stops at its next look, heart-beats idle and
asks for work. The fresh task is left open rather than handed to that island directly, so `assign`
decides as for any task: an idle island takes it at once, paths further behind go first, and the
island that stopped is preferred for it when it trained that path last (its inner state is local).
A cancelled task's result is never received (only open and assigned tasks are), its base is no
longer kept by retention, and it leaves the board at the next commit, as lost tasks do.

The run ends when the policy says every path has had `run.rounds` results applied (`done`; in sync
mode after round `run.rounds`); that round's `state.json` says `"finished": true` (`run_finished`).

Every decision in 3–6 (and retention's oldest kept version) is `dipaco.rounds.policy.RoundPolicy`'s,
a pure object fed the events this class reads from the store; `dipaco simulate` drives the same one.

Restarting after a crash resumes from the store: rounds up to the committed one are final, the
applied set is rebuilt from their manifests (nothing is applied twice), and a half-written round t is
written again from the same inputs (in sync mode exactly the same modules). The board comes from
`tasks.json` when it is at least as new as the commit, else from `state.json` (a crash between the
commit and the next board write); what follows a commit (best.json, retention) is idempotent and is
done again at start. Killing the coordinator between any two of its writes gives the same modules,
path states and train.json rows as a run that was never killed (tests/test_crash_safety.py).

Only one coordinator writes to a store: it holds the store's lease (`dipaco.store.lease`), renews it
every tick and checks its fencing token before every board write and commit, so one that was
deposed (its lease expired and another coordinator took over) stops without writing.

The coordinator's state is the store's records (`dipaco.store.records`), held frozen: a task that
changes is replaced in `tasks` (`dataclasses.replace`), so what was last written is never aliased.
After each round it records the validation losses the islands reported (`dipaco.eval.early_stopping`)
and applies retention (`dipaco.store.retention`); `finish_run` does the same for the last version.

    store = ModuleStore("runs/tiny/store")
    coordinator = Coordinator(store, topology, settings=CoordinatorSettings.from_config(cfg),
                              sizes=factory.path_sizes)   # shard sizes for outer.weighting: shard
    while not coordinator.tick(): time.sleep(0.1)
"""


from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dipaco.config import Config, OuterConfig, ResilienceConfig, RoundsConfig
from dipaco.eval.early_stopping import (
    ValidationData,
    best_rounds,
    final_val_losses,
    needed_modules,
    read_history,
    record_kept_bytes,
    record_val_losses,
    unscored_paths,
)
from dipaco.islands.rounds import apply_round
from dipaco.islands.validation import ResultValidator
from dipaco.model.path_model import PathSpec
from dipaco.model.topology import Topology
from dipaco.optim.outer import path_decay_from, round_outer_step
from dipaco.optim.weighting import PathSizes, needs_sizes
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask, Result, Running
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import (
    HeartbeatCache,
    inner_ref,
    read_board,
    read_heartbeats,
    read_manifest,
    read_result_meta,
    reported_results,
    write_board,
    write_manifest,
)
from dipaco.store.lease import Lease
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import (
    Board,
    Heartbeat,
    ManifestEntry,
    PathState,
    ResultMeta,
    RoundStats,
    Task,
    task_key,
)
from dipaco.store.retention import keep_from, prune_inner_states, prune_versions
from dipaco.store.run_state import commit_round, committed_record, first_inner, run_finished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Seen:
    """An island's heartbeat as the coordinator last saw it change, and when (coordinator clock)."""

    beat: Heartbeat
    changed_at: float


@dataclass(frozen=True)
class CoordinatorSettings:
    """What a coordinator reads from the config, unpacked once (`from_config`)."""

    outer: OuterConfig  # the outer step
    rounds: RoundsConfig  # when a round closes (sync / async)
    resilience: ResilienceConfig  # heartbeat timeout, lease timeout, result checks
    run_rounds: int  # the run's length: results applied per path (run.rounds)
    inner_steps: int  # steps per task
    keep_versions: int = 2  # module versions retention keeps (store.keep_versions)
    decay_from: int | None = None  # the path step where the inner lr starts to decay (outer.decay); None = never

    @classmethod
    def from_config(cls, config: Config) -> CoordinatorSettings:
        return cls(outer=config.outer, rounds=config.rounds, resilience=config.resilience,
                   run_rounds=config.run.rounds, inner_steps=config.inner.steps,
                   keep_versions=config.store.keep_versions,
                   decay_from=path_decay_from(config.inner, rounds=config.run.rounds,
                                              warm_start_steps=config.warm_start_steps))


class Coordinator:
    def __init__(self, store: ModuleStore, topology: Topology, *, settings: CoordinatorSettings,
                 sizes: PathSizes | None = None, clock: Callable[[], float] = time.monotonic,
                 validator: ResultValidator | None = None, lease: Lease | None = None, force: bool = False):
        """Resume from the store's committed round (`initialise_store` must have run), holding the
        store's lease (`lease`, else taken here: `LeaseHeld` when another coordinator holds it, unless
        `force`). `sizes` (each path's training-shard tokens, `PathFactory.path_sizes`) is needed by
        `outer.weighting: shard`. Results are checked by `validator` (`dipaco.islands.validation`)
        before they are received."""
        outer, decay_from = settings.outer, settings.decay_from
        if needs_sizes(outer) and (sizes is None or len(sizes.shard_tokens) != topology.n_paths):
            raise ValueError(f"outer.weighting {outer.weighting!r} needs the shard size of each of the "
                             f"{topology.n_paths} paths, got {None if sizes is None else list(sizes.shard_tokens)}")
        if outer.decay != "keep" and decay_from is None:
            raise ValueError(f"outer.decay {outer.decay!r} needs decay_from, the path step where the inner lr "
                             f"starts to decay (dipaco.optim.outer.path_decay_from)")
        self.lease = lease or Lease.acquire(store, timeout=settings.resilience.lease_timeout, force=force)
        self.store, self.topology, self.sizes = store, topology, sizes
        self.validator = validator or ResultValidator(store, topology, resilience=settings.resilience,
                                                      tokens_per_task=None)
        self.settings, self.outer, self.inner_steps, self.decay_from = settings, outer, settings.inner_steps, decay_from
        self.clock = clock
        self.committed = store.current_round()
        board = on_disk = read_board(store)
        committed_board, self.last_stats = committed_record(store)
        if committed_board is not None and (board is None or board.round < committed_board.round):
            board = committed_board  # a crash between the commit and the next board write
        self.tasks: dict[str, Task] = dict(board.tasks) if board else {}
        known = board.paths if board else {}
        first = first_inner(store) if len(known) < topology.n_paths else None  # one look, not one per path
        self.paths: dict[int, PathState] = {p: known.get(p) or PathState(steps_done=0, inner=first)
                                            for p in range(topology.n_paths)}
        self.used: set[str] = set()  # task keys applied or dropped by committed rounds
        applied: list[tuple[int, int]] = []  # (round, path) of the applied results: private modules' versions
        for r in range(1, self.committed + 1):
            manifest = read_manifest(store, r)
            if manifest is not None:
                self.used |= manifest.keys
                applied += [(r, e.path) for e in manifest.applied]
        for key in [k for k in self.tasks if k in self.used]:
            del self.tasks[key]  # applied by a committed round whose board update was lost in a crash
        self.started: dict[str, float] = {}  # task key -> when its current attempt was handed out (clock)
        self.metas: dict[str, ResultMeta] = {}  # task key -> its received result's metadata, until applied
        self.beats = HeartbeatCache()  # heartbeat files unchanged since the last tick are not read again
        self.policy = RoundPolicy(Grid.of(topology), settings.rounds, rounds=settings.run_rounds, committed=self.committed,
                                  applied=applied)
        if self.policy.done and not run_finished(store):  # finished by a coordinator that did not mark it
            state = store.state() or {}
            commit_round(store, topology, self.committed, finished=True, **{k: state[k] for k in ("board", "stats") if k in state})
        for task in self.tasks.values():
            if task.status == "received":
                self._tell_policy(task, arrived=clock())
        self.seen: dict[str, Seen] = {}
        self.first_beat: float | None = None  # when an island was first seen (goodput counts island time from here)
        self.round_started = clock()
        self.last_norms: dict[str, tuple[float, float]] = {}  # of the last round this coordinator closed
        self.last_metas: dict[str, ResultMeta] = {}  # task key -> result metadata, of the last round closed
        self._board_written = on_disk.to_json() if on_disk else None
        self._board_snapshot: tuple | None = None  # (round, tasks, paths) as last written or found unchanged
        if 0 < self.committed:  # what follows the last commit, again: a crash may have cut it short
            manifest = read_manifest(store, self.committed)
            self._retain(self.committed, manifest.applied if manifest else ())

    # --- one pass ----------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One pass of the loop; returns True when the run's last round is committed (`done`)."""
        now = self.clock()
        self.lease.renew()
        for name, beat in read_heartbeats(self.store, cache=self.beats).items():
            if self.first_beat is None:
                self.first_beat = now
            seen = self.seen.get(name)
            if seen is None or (seen.beat.incarnation, seen.beat.seq) != (beat.incarnation, beat.seq):
                self.seen[name] = Seen(beat=beat, changed_at=now)
        self._receive()
        if not self.done:
            self._open_tasks()
            self._reassign_lost(now)
            if self._maybe_close(now) and not self.done:
                self._open_tasks()  # the paths that reported train on from the new version
            if not self.done:
                self._assign(now)  # after any commit: a task is handed out from the newest version
        self._write_board()
        return self.done

    @property
    def done(self) -> bool:
        """The run is over: every path has had run.rounds results applied (the policy's count; in sync
        mode that is round run.rounds)."""
        return self.policy.done

    def run_round(self, round: int, *, poll_seconds: float = 0.1, check: Callable[[], None] | None = None) -> RoundStats:
        """Tick until `round` is committed; returns its stats (the run must not be done before it)."""
        if self.done and self.committed < round:
            raise RuntimeError(f"the run ended with round {self.committed}; there is no round {round}")
        while self.committed < round:
            self.tick()
            if self.committed >= round:
                break
            if check:
                check()
            time.sleep(poll_seconds)
        if self.last_stats is None or self.last_stats.round != round:
            raise RuntimeError(f"round {round} was committed before this coordinator started")
        return self.last_stats

    # --- steps ---------------------------------------------------------------------------------------
    def alive(self, island: str, now: float) -> bool:
        seen = self.seen.get(island)
        return seen is not None and now - seen.changed_at < self.settings.resilience.heartbeat_timeout

    def _receive(self) -> None:
        reported: dict[int, dict[int, set[int]]] = {}  # round -> path -> attempts: one listing per round folder
        for key, task in list(self.tasks.items()):
            if task.status not in ("open", "assigned"):
                continue
            if task.round not in reported:
                reported[task.round] = reported_results(self.store, task.round)
            attempts = reported[task.round].get(task.path, set())
            requeued = False
            for attempt in range(task.attempt, -1, -1):  # the current attempt first, then late older ones
                if attempt in attempts:
                    reason = self.validator.check(task, attempt)
                    if reason is not None:  # rejected: never applied; the current attempt is handed out again
                        if attempt == task.attempt:
                            self.tasks[key] = task = self.validator.requeue(task, reason)
                            requeued = True
                        continue
                    self.tasks[key] = replace(task, status="received", result_attempt=attempt)
                    meta = self.validator.accepted_meta(task, attempt)
                    if meta is not None:  # the JSON the validator read: not read again here nor by the outer step
                        self.metas[key] = meta
                    self._tell_policy(self.tasks[key], arrived=self.clock())
                    self.paths[task.path] = PathState(steps_done=task.step_offset + self.inner_steps,
                                                      inner=inner_ref(path=task.path, round=task.round, attempt=attempt))
                    log.info("received %s (attempt %d)", key, attempt)
                    break
            if requeued and self.tasks[key].status == "open" and self.policy.rebase(_open({key: task})):
                self.validator.moved(task, self._move_to_newest(task))  # versions were committed since its base

    def _result_meta(self, task: Task) -> ResultMeta:
        """A received task's result metadata: as the validator read it, else read (once) from the store."""
        if task.key not in self.metas:
            self.metas[task.key] = read_result_meta(self.store, round=task.round, path=task.path,
                                                    attempt=task.result_attempt)
        return self.metas[task.key]

    def _tell_policy(self, task: Task, *, arrived: float) -> None:
        meta = self._result_meta(task)
        self.policy.received(Result(key=task.key, path=task.path, base=task.base, tokens=meta.tokens,
                                    arrived=arrived, started=self.started.get(task.key)))

    def _in_flight(self, path: int) -> Task | None:
        for task in self.tasks.values():
            if task.path == path and task.status in ("open", "assigned"):
                return task
        return None

    def _new_task(self, path: int) -> Task:
        """A task for `path` from the newest version, continuing the path's steps and inner state."""
        state = self.paths[path]
        return Task.open(path=path, base=self.committed, step_offset=state.steps_done, inner_from=state.inner)

    def _open_tasks(self) -> None:
        busy = {t.path for t in self.tasks.values() if t.status in ("open", "assigned")}
        for path in self.policy.paths_to_open(busy=busy):
            if task_key(path, self.committed) in self.tasks:
                continue  # reported from the newest version (the policy knows), or replaced and lost
            task = self._new_task(path)
            self.tasks[task.key] = task

    def _rebase_open(self) -> None:
        """Open tasks nobody has taken move to the newest version (a returning island never gets an old one)."""
        for stale in self.policy.rebase(_open(self.tasks)):
            self._move_to_newest(self.tasks[stale.key])

    def _move_to_newest(self, stale: Task) -> Task:
        """Replace the open task `stale` on the board by its path's task from the newest version; returns it."""
        del self.tasks[stale.key]
        task = self._new_task(stale.path)
        self.tasks[task.key] = task
        log.info("%s moved to version %d as %s", stale.key, self.committed, task.key)
        return task

    def _cancel_doomed(self) -> int:
        """Cancel the running tasks whose results could no longer be applied (`RoundPolicy.cancel`, after
        a commit): each gets status `cancelled` (its island stops it when it next reads the board) and its
        path an open task from the newest version. Returns how many."""
        running = [Running(key=t.key, path=t.path, base=t.base, started=self.started.get(t.key))
                   for t in self.tasks.values() if t.status == "assigned"]
        doomed = self.policy.cancel(running)
        for key in doomed:
            task = self.tasks[key]
            self.tasks[key] = replace(task, status="cancelled")
            self.started.pop(key, None)
            fresh = self._new_task(task.path)
            self.tasks[fresh.key] = fresh
            log.warning("%s: cancelled on island %s (%d versions behind version %d, rounds.max_staleness %d); "
                        "path %d trains on as %s", key, task.island, self.committed - task.base, self.committed,
                        self.settings.rounds.max_staleness, task.path, fresh.key)
        return len(doomed)

    def _reassign_lost(self, now: float) -> None:
        for key, task in list(self.tasks.items()):
            if task.status != "assigned":
                continue
            alive = self.alive(task.island, now)
            beat = self.seen[task.island].beat if alive else None
            came_back = beat is not None and beat.incarnation != task.incarnation
            if alive and not came_back:
                continue
            resumable = came_back and beat.last_path == task.path  # it reports its checkpointed path
            if self.policy.on_lost(task.base, resumable=resumable) == "replace":
                log.warning("%s: island %s lost it; replaced by a task from version %d", key, task.island, self.committed)
                self.tasks[key] = replace(task, status="lost")
                fresh = self._new_task(task.path)
                self.tasks[fresh.key] = fresh
            else:
                log.warning("%s: island %s lost it; attempt %d is open", key, task.island, task.attempt + 1)
                self.tasks[key] = replace(task, status="open", island=None, incarnation=None, attempt=task.attempt + 1)

    def _idle_islands(self, now: float) -> list[IdleIsland]:
        busy = {t.island for t in self.tasks.values() if t.status == "assigned"}
        return [IdleIsland(name=name, pinned=tuple(seen.beat.pinned), last_path=seen.beat.last_path)
                for name, seen in sorted(self.seen.items())
                if name not in busy and self.alive(name, now) and seen.beat.status == "idle"]

    def _assign(self, now: float) -> None:
        for key, island in self.policy.assign(_open(self.tasks), self._idle_islands(now)):
            task = self.tasks[key]
            self.tasks[key] = replace(task, status="assigned", island=island,
                                      incarnation=self.seen[island].beat.incarnation)
            self.started[key] = now
            log.info("%s attempt %d -> island %s", key, task.attempt, island)

    def _maybe_close(self, now: float) -> bool:
        """Close the round when the policy says so (told which islands would stay idle); True when closed."""
        idle, open_tasks = self._idle_islands(now), _open(self.tasks)
        taken = {island for _, island in self.policy.assign(open_tasks, idle)}
        running = [Running(key=t.key, path=t.path, base=t.base, started=self.started.get(t.key))
                   for t in self.tasks.values() if t.status == "assigned"]
        if not self.policy.close_due(now, running=running, idle=[i for i in idle if i.name not in taken],
                                     open=open_tasks):
            return False
        self._close()
        return True

    def _close(self) -> None:
        """Write version t and its manifest, settle the board in memory, then commit round, board and
        stats in one write (`state.json`): a crash anywhere before it leaves round t to be done again,
        anywhere after it leaves nothing to redo but `_retain`."""
        round = self.committed + 1
        pending = [t for t in self.tasks.values() if t.status == "received" and t.key not in self.used]
        plan = self.policy.plan()
        self.lease.check()
        self.last_norms = {}  # module -> (outer gradient norm, update norm), for the metrics (dipaco.islands.metrics)
        self.last_metas = {t.key: self._result_meta(t) for t in pending}  # read once: the outer step, the metrics
        outer = round_outer_step(self.outer, step_ends=[t.step_offset + self.inner_steps for t in pending],
                                 decay_from=self.decay_from)
        outer_step = "configured" if outer is self.outer else "average"
        if outer_step == "average":
            log.info("round %d: plain averaging (its results reach the inner lr's decay; outer.decay %s)", round,
                     self.outer.decay)
        manifest = apply_round(self.store, self.topology, round=round, pending=pending, config=outer, plan=plan,
                               sizes=self.sizes, norms=self.last_norms, metas=self.last_metas)
        write_manifest(self.store, manifest)
        finished = self.policy.finishes(plan)
        self.committed = round
        self.policy.commit(plan)
        self.used |= manifest.keys
        for key in [k for k, t in self.tasks.items() if k in self.used or t.status in ("lost", "cancelled")]:
            del self.tasks[key]  # finished business: the manifests keep the record
            self.started.pop(key, None)
            self.metas.pop(key, None)
        self._rebase_open()
        cancelled = self._cancel_doomed()
        in_flight = sum(1 for t in self.tasks.values() if t.status == "assigned")
        now = self.clock()
        stats = replace(RoundStats.of(manifest, in_flight=in_flight, cancelled=cancelled,
                                      outer_step=outer_step),
                        seconds=now - self.round_started)
        self.lease.check()  # the fencing check: a deposed coordinator never commits
        commit_round(self.store, self.topology, round, finished=finished, board=self._board().to_json(), stats=stats.to_json())
        self.last_stats, self.round_started = stats, now
        self._retain(round, manifest.applied)
        log.info("round %d committed: %d results applied (%d stale), %d dropped, %d running tasks cancelled", round,
                 len(manifest.applied), self.last_stats.stale, len(manifest.dropped), cancelled)

    def _retain(self, round: int, applied: tuple[ManifestEntry, ...]) -> None:
        """Record each applied result's validation loss for the version it started from, then apply
        retention: versions older than the policy's oldest kept one (`store.keep_versions`, in async mode
        the versions a stale result may still start from, and every open or running task's base; not a
        cancelled task's: its island read its modules when it started, and its result is never read) except
        the modules some path's best version needs, and the inner states no task or path state names."""
        losses: dict[int, dict[int, float]] = {}
        for entry in applied:
            losses.setdefault(entry.base, {})[entry.path] = entry.val_loss_start
        if losses:
            record_val_losses(self.store, losses)
        bases = [t.base for t in self.tasks.values() if t.status in ("open", "assigned")]
        keep = self.policy.keep_from(keep_rounds=self.settings.keep_versions, bases=bases)
        if keep is None:
            return
        prune_keeping_best(self.store, self.topology, keep_from=keep)
        referenced = {s.inner for s in self.paths.values()} | {t.inner_from for t in self.tasks.values()}
        prune_inner_states(self.store, n_paths=self.topology.n_paths, keep_from=keep, referenced=referenced)

    def _board(self) -> Board:
        return Board(round=self.committed, tasks=dict(self.tasks), paths=dict(self.paths))

    def _write_board(self) -> None:
        snapshot = (self.committed, dict(self.tasks), dict(self.paths))  # the records are frozen: compared by identity first
        if snapshot == self._board_snapshot:
            return  # nothing changed since the last pass: not even serialised (256 tasks' JSON every tick at 16x16)
        board = self._board()
        written = board.to_json()
        if written != self._board_written:
            self.lease.check()
            write_board(self.store, board)
            self._board_written = written
        self._board_snapshot = snapshot


def _open(tasks: dict[str, Task]) -> list[OpenTask]:
    return [OpenTask(key=t.key, path=t.path, base=t.base, steps_done=t.step_offset)
            for t in tasks.values() if t.status == "open"]


def prune_keeping_best(store: ModuleStore, topology: Topology, *, keep_from: int) -> None:
    """Delete versions older than `keep_from` except the modules of every path's best version; the
    bytes kept that way go to best.json."""
    best = best_rounds(read_history(store))
    kept = prune_versions(store, keep_from=keep_from, keep_modules=needed_modules(topology, best))
    record_kept_bytes(store, kept)


def finish_run(store: ModuleStore, topology: Topology, spec: PathSpec, validation: ValidationData, *,
               keep_rounds: int, device: torch.device) -> None:
    """After the last round: score the last module version of every path (unless recorded), so it can
    be a path's best (`dipaco eval --best`), then prune to the last `keep_rounds` versions."""
    version = store.current_round()
    if not unscored_paths(store, topology, version=version):
        return
    losses = final_val_losses(store, topology, spec, validation, version=version, device=device)
    log.info("validation loss after the last round (%d): %s", version,
             ", ".join(f"path {p} {x:.3f}" for p, x in losses.items()))
    record_val_losses(store, {version: losses})
    keep = keep_from(version, keep_rounds=keep_rounds)
    if keep is not None:
        prune_keeping_best(store, topology, keep_from=keep)
