"""The round policy: pure decisions on a clock it is given (no torch, no store, no wall clock).

The coordinator (`dipaco.islands.coordinator`) is the I/O around it; `dipaco simulate` drives the very
same object on a virtual clock. Everything it knows comes in as events, everything it decides goes out
as plain dataclasses:

    policy = RoundPolicy(Grid.of(topology), cfg.rounds, rounds=cfg.run.rounds)  # committed=t, applied=... on a restart
    policy.received(Result(key, path=2, base=4, tokens=51200, arrived=t, started=t0))   # a result came in
    policy.close_due(now, running=[Running(...)], idle=[IdleIsland(...)])   # may round committed+1 close?
    plan = policy.plan()                                         # what its outer step applies, per module
    policy.commit(plan)                                          # it was written: version committed+1
    policy.paths_to_open(busy={0, 3})                            # paths that need a task from the newest version
    policy.rebase(open_tasks)                                    # open tasks to move to the newest version
    policy.cancel(running=[Running(...)])                        # running tasks whose result can no longer be applied
    policy.on_lost(task_base)                                    # "retry" (same task, next attempt) | "replace"
    policy.assign(open_tasks, idle_islands)                      # [(task key, island)]
    policy.keep_from(keep_rounds=2, bases=[...])                 # oldest version retention may not delete
    policy.outstanding(path), policy.done                        # the run's length: results still owed; over?

Driving it (the coordinator's `tick`, which a simulator repeats to make the same decisions):
1. `received(...)` for every result that arrived (started = when its attempt was handed out);
2. a task for each of `paths_to_open(busy=paths with a task open or running)`;
3. lost tasks: `on_lost(base, resumable=island back with its checkpoint)`: retry or replace;
4. `close_due(now, running, idle=the idle islands a dry `assign` would leave without work, open)`;
   when due: `plan()`, write it, `commit(plan)`, move `rebase(open)` to the newest version, replace
   each of `cancel(running)` by an open task from the newest version (its island stops it and asks
   for work again), then step 2 again;
5. `assign(open, idle)`: the hand-outs, after any commit.

The rules (`rounds.mode`):

- **sync** (the paper): round t closes once every path has reported from version t − 1; every result
  is applied with weight 1. Nothing else differs from async below (the same code decides).
- **async** (Decoupled DiLoCo), per module. A module m is *ready* when at least
  ceil(rounds.quorum × |P(m)|) of its own paths P(m) have a result based on its current version, and
  then either all of P(m) have reported or its grace window (below) has passed. A round closes when
  every *shared* module (|P(m)| > 1) is ready; a path-private module is never waited for: it advances
  in every round in which its path has a result, so `private_blocks` / `private_embeddings` do not make
  async sync. (Without shared modules, a round closes as soon as any result is in.)
- **Adaptive grace window.** After module m's quorum is reached at time q_m, the round waits only for
  the paths of m whose running task is expected to finish by q_m + rounds.grace_seconds, expecting
  each at its start + the median measured task time (arrival − start of the last 16 results; until
  one is measured, the whole rounds.grace_seconds). So it never waits for a path that is not running,
  nor for one not expected in time, and the window shrinks to nothing when tasks are long. It also
  ends at once when a live island is idle with no task it may take: an island never idles while a
  commit would give its path new work.
- **Staleness, per module.** A result based on version b, applied in round t: for the shared modules
  s = t − 1 − b (every shared module advances in every round); for a private module, s = how many
  results of its path were applied in rounds b+1 … t−1 (normally 0). Weight (`dipaco.optim.weighting`:
  shard size, tokens or 1) × (1 + s) ^ −rounds.staleness_power; a result whose shared staleness exceeds rounds.max_staleness is dropped whole.
  Sync: weight 1 for s = 0, nothing else exists.
- **Cancellation** (async). A running task based on version b can report at the earliest into the
  round after the newest one, committed + 1, where its staleness is committed − b, and staleness only
  grows. So once committed − b ≥ rounds.max_staleness + 1 its result can never be applied: `cancel`
  names it right after the commit that makes it so (the commit of version b + max_staleness + 1), and
  it is replaced by an open task for its path from the newest version (continuing the path's steps
  and inner state); its island stops it and takes new work. With it no result is ever dropped in a
  run (every result that arrives was running, not cancelled, at the last commit, so committed − b ≤
  max_staleness); `plan` still drops one that would be (e.g. a board written before cancellation
  existed). The same test as `on_lost`'s. Sync never cancels (a sync round waits for every path).
- **√ rescale** (`outer.rescale_by_paths`): by √|P(m)|, the number of paths through the module, not the
  number of results applied (a path with a stale and a fresh result counts once; a private module ×1).
- **The run's length** (`rounds`, = `run.rounds`; None = no end): applied work, not versions. The
  run is `done` when every path has had `rounds` results applied (sync: after round `rounds`, as
  before; async: usually more versions, the same work). `outstanding(p)` = rounds − p's applied
  results − its pending results the next round applies. A path that owes nothing gets no task and
  no longer counts for a quorum (nor does an island that may only train such paths end a grace
  window by idling). Async: once the tasks in flight cover everything owed (and nothing is open), the
  round waits for all of them — past the grace window — so the last commit cuts off no finished task.
- **Tasks.** A path gets a new task as soon as it has none in flight, has not yet reported from the
  newest version and owes a result; every open task (no island has it) is moved to the newest version at each commit, so
  an island only ever receives a task based on the newest committed versions, and a running one that
  can no longer be applied is cancelled (above). A lost task in async
  mode is replaced by one from the newest version when its base is older (sync: retried as is), unless
  its island is back with the task's inner checkpoint and its result could still be applied (at most
  rounds.max_staleness versions behind): then it is retried, and resumed there.
  Idle islands take open tasks oldest base first, then the path that has trained fewest steps (no path
  starves when every open task is rebased), then the lowest path: an island pinned to paths only takes
  those; an island prefers the path it trained last (its inner state is local). A fast island simply
  asks again sooner, so it takes more tasks; a slow one never holds a round beyond its grace window.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from dipaco.config import RoundsConfig
from dipaco.model.topology import Topology

TASK_TIMES_KEPT = 16  # measured task times the grace window's median is taken over


@dataclass(frozen=True)
class Grid:
    """The topology as the policy needs it: which paths go through each module."""

    n_paths: int
    modules: dict[str, tuple[int, ...]]  # module -> the paths through it

    @classmethod
    def of(cls, topology: Topology) -> Grid:
        return cls(n_paths=topology.n_paths,
                   modules={m: tuple(topology.paths_of_module(m)) for m in topology.modules})

    @property
    def shared(self) -> list[str]:
        return [m for m, paths in self.modules.items() if len(paths) > 1]


@dataclass(frozen=True)
class Result:
    """A task's result has arrived: path `path` trained from version `base`."""

    key: str  # the task's key (one result per key is used)
    path: int
    base: int
    tokens: int
    arrived: float  # policy clock
    started: float | None = None  # when the task was handed out (policy clock); None = unknown


@dataclass(frozen=True)
class Running:
    """A task some island is training."""

    key: str
    path: int
    base: int
    started: float | None  # when it was handed out; None = unknown (e.g. before a coordinator restart)


@dataclass(frozen=True)
class OpenTask:
    """A task no island has yet."""

    key: str
    path: int
    base: int
    steps_done: int = 0  # inner steps its path has trained so far: the path furthest behind goes first


@dataclass(frozen=True)
class IdleIsland:
    """A live island waiting for work."""

    name: str
    pinned: tuple[int, ...] = ()  # the only paths it takes; () = any
    last_path: int | None = None  # the path it trained last

    def may_take(self, path: int) -> bool:
        return not self.pinned or path in self.pinned


@dataclass(frozen=True)
class Verdict:
    """What a round does with one result: applied (factor = its shared modules' staleness weight) or
    dropped (factor None)."""

    key: str
    path: int
    base: int
    staleness: int  # of its shared modules (its private ones: `Contribution.staleness`)
    factor: float | None


@dataclass(frozen=True)
class Contribution:
    """One result's part in one module's outer step: its weight (`dipaco.optim.weighting`) × factor."""

    key: str
    path: int
    tokens: int
    staleness: int
    factor: float


@dataclass(frozen=True)
class RoundPlan:
    """Round `round`'s outer step: per module the results it averages (none: the module is carried over
    unchanged) and the √ rescale's path count."""

    round: int
    verdicts: tuple[Verdict, ...]  # every pending result, by (path, base)
    modules: dict[str, tuple[Contribution, ...]]  # every module, in grid order
    paths_through: dict[str, int]  # |P(m)|

    @property
    def applied(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.factor is not None]

    @property
    def dropped(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.factor is None]


def staleness_weight(staleness: int, *, config: RoundsConfig) -> float | None:
    """Multiplier for a result `staleness` versions old; None when it is to be dropped."""
    if staleness < 0:
        raise ValueError(f"a result cannot start from a version newer than the one it is applied to (staleness {staleness})")
    if config.mode == "sync":
        return 1.0 if staleness == 0 else None
    if staleness > config.max_staleness:
        return None
    return (1.0 + staleness) ** -config.staleness_power


class RoundPolicy:
    """The round policy's state: the committed version, the results not yet used, which rounds applied
    each path's results (private modules' versions), the measured task times and the quorum clocks."""

    def __init__(self, grid: Grid, config: RoundsConfig, *, rounds: int | None = None, committed: int = 0,
                 applied: Iterable[tuple[int, int]] = ()):
        """`rounds`: the run's length, in results applied per path (`run.rounds`; None = no end, e.g.
        a simulation to a horizon). `applied`: (round, path) of every result applied by committed rounds
        (from their manifests)."""
        if rounds is not None and rounds < 1:
            raise ValueError(f"a run's length must be >= 1 result per path (run.rounds), got {rounds}")
        self.grid, self.config, self.committed, self.rounds = grid, config, committed, rounds
        self.pending: dict[str, Result] = {}
        self.applied_rounds: dict[int, list[int]] = {p: [] for p in range(grid.n_paths)}
        for round, path in applied:
            self.applied_rounds[path].append(round)
        self.task_times: deque[float] = deque(maxlen=TASK_TIMES_KEPT)
        self.quorum_since: dict[str, float] = {}

    # --- events --------------------------------------------------------------------------------------
    def received(self, result: Result) -> None:
        """A result arrived (at most one per task key; a second one for the same key is ignored)."""
        if result.key in self.pending:
            return
        self.pending[result.key] = result
        if result.started is not None:
            self.task_times.append(max(0.0, result.arrived - result.started))

    # --- the run's length ----------------------------------------------------------------------------
    def applied_results(self, path: int) -> int:
        """Results of `path` applied by committed rounds."""
        return len(self.applied_rounds[path])

    def outstanding(self, path: int) -> int | None:
        """Results `path` still has to have applied beyond the committed rounds and the pending results
        the next round applies (None: the run has no length). A task in flight covers one of them."""
        if self.rounds is None:
            return None
        usable = sum(1 for r in self.pending.values()
                     if r.path == path and staleness_weight(self.committed - r.base, config=self.config) is not None)
        return self.rounds - self.applied_results(path) - usable

    def _outstanding_all(self) -> list[int | None]:
        """`outstanding(p)` of every path, from one pass over the pending results (not one per path: the
        coordinator asks every tick, and paths × pending results is 65k at 16x16)."""
        if self.rounds is None:
            return [None] * self.grid.n_paths
        usable = [0] * self.grid.n_paths
        for r in self.pending.values():
            if staleness_weight(self.committed - r.base, config=self.config) is not None:
                usable[r.path] += 1
        return [self.rounds - self.applied_results(p) - usable[p] for p in range(self.grid.n_paths)]

    @property
    def done(self) -> bool:
        """Every path has had `rounds` results applied: the run is over."""
        return self.rounds is not None and all(self.applied_results(p) >= self.rounds for p in range(self.grid.n_paths))

    def finishes(self, plan: RoundPlan) -> bool:
        """Does committing `plan` end the run?"""
        if self.rounds is None:
            return False
        applied = {p: self.applied_results(p) for p in range(self.grid.n_paths)}
        for verdict in plan.applied:
            applied[verdict.path] += 1
        return all(n >= self.rounds for n in applied.values())

    def _unfinished(self) -> set[int]:
        """Paths that still need a result beyond the pending ones (every path when the run has no length)."""
        outstanding = self._outstanding_all()
        return {p for p in range(self.grid.n_paths) if (outstanding[p] or 0) > 0 or self.rounds is None}

    def _finishing(self, running: list[Running], open: list[OpenTask]) -> bool:
        """Async, the run's end: no task will be handed out any more, because the tasks in flight cover
        every result still outstanding."""
        if self.rounds is None or open:
            return False
        in_flight = Counter(t.path for t in running)
        outstanding = self._outstanding_all()
        return all(outstanding[p] <= in_flight[p] for p in range(self.grid.n_paths))

    # --- closing a round -----------------------------------------------------------------------------
    def fresh_paths(self, module: str | None = None) -> set[int]:
        """Paths with a result based on the newest version (through `module`, when given)."""
        paths = {r.path for r in self.pending.values() if r.base == self.committed}
        return paths if module is None else paths & set(self.grid.modules[module])

    def median_task_seconds(self) -> float | None:
        return statistics.median(self.task_times) if self.task_times else None

    def close_due(self, now: float, *, running: Iterable[Running] = (), idle: Iterable[IdleIsland] = (),
                  open: Iterable[OpenTask] = ()) -> bool:
        """May round committed + 1 close at `now`? `running`: the tasks being trained, `idle`: the live
        islands without a task, `open`: the tasks not yet taken (an idle island with one it may take is
        not waiting for the round)."""
        fresh = self.fresh_paths()
        if self.config.mode == "sync":
            return fresh >= set(range(self.grid.n_paths))
        running, open = list(running), list(open)
        if self._finishing(running, open):  # the last results: wait for every one of them
            return bool(self.pending) and not running
        shared = self.grid.shared
        if not shared:  # only private modules: nothing to wait for
            return bool(self.pending)
        reporting = fresh | self._unfinished()  # a path done with its work no longer counts for the quorum
        quorum_met = True
        for m in shared:
            paths = set(self.grid.modules[m]) & reporting
            if len(fresh & paths) >= math.ceil(self.config.quorum * len(paths)):
                self.quorum_since.setdefault(m, now)
            else:
                self.quorum_since.pop(m, None)
                quorum_met = False
        if not quorum_met:
            return False
        open_paths, unfinished = {t.path for t in open}, self._unfinished()
        if any(not any(island.may_take(p) for p in open_paths) and any(island.may_take(p) for p in unfinished)
               for island in idle):
            return True  # an island would idle while a path it may train has work left: no grace
        return all(self._grace_over(m, now, fresh, running, reporting) for m in shared)

    def _grace_over(self, module: str, now: float, fresh: set[int], running: list[Running], reporting: set[int]) -> bool:
        paths = set(self.grid.modules[module]) & reporting
        missing = paths - fresh
        if not missing:
            return True
        deadline = self.quorum_since[module] + self.config.grace_seconds
        if now >= deadline:
            return True
        median = self.median_task_seconds()
        for task in running:
            if task.path in missing and task.base == self.committed:
                if median is None or task.started is None:
                    return False  # nothing measured yet: the whole window
                if task.started + median <= deadline:
                    return False  # expected within the window: wait for it
        return True

    # --- the outer step ------------------------------------------------------------------------------
    def plan(self) -> RoundPlan:
        """The outer step of round committed + 1 from every pending result."""
        round = self.committed + 1
        verdicts, by_key = [], {}
        for result in sorted(self.pending.values(), key=lambda r: (r.path, r.base)):
            staleness = round - 1 - result.base
            factor = staleness_weight(staleness, config=self.config)
            verdicts.append(Verdict(key=result.key, path=result.path, base=result.base, staleness=staleness, factor=factor))
            by_key[result.key] = result
        modules: dict[str, tuple[Contribution, ...]] = {}
        for m, paths in self.grid.modules.items():
            contributions = []
            for verdict in verdicts:
                if verdict.factor is None or verdict.path not in paths:
                    continue
                staleness, factor = verdict.staleness, verdict.factor
                if len(paths) == 1:  # private: stale only by its own path's results applied since
                    staleness = sum(1 for r in self.applied_rounds[verdict.path] if r > verdict.base)
                    factor = staleness_weight(staleness, config=self.config)
                    if factor is None:  # sync cannot get here; async: newer own results already applied
                        continue
                contributions.append(Contribution(key=verdict.key, path=verdict.path,
                                                  tokens=by_key[verdict.key].tokens, staleness=staleness, factor=factor))
            modules[m] = tuple(contributions)
        return RoundPlan(round=round, verdicts=tuple(verdicts), modules=modules,
                         paths_through={m: len(paths) for m, paths in self.grid.modules.items()})

    def commit(self, plan: RoundPlan) -> None:
        """Round `plan.round` is written: its results are used, its version is the newest."""
        if plan.round != self.committed + 1:
            raise ValueError(f"round {plan.round} committed after round {self.committed}")
        for verdict in plan.verdicts:
            self.pending.pop(verdict.key, None)
            if verdict.factor is not None:
                self.applied_rounds[verdict.path].append(plan.round)
        self.committed = plan.round
        self.quorum_since.clear()

    # --- tasks ---------------------------------------------------------------------------------------
    def paths_to_open(self, *, busy: set[int]) -> list[int]:
        """Paths that need a new task from the newest version: none in flight (`busy`), no result yet
        from the newest version, and results still outstanding (the run's length is not yet covered)."""
        fresh, outstanding = self.fresh_paths(), self._outstanding_all()
        return [p for p in range(self.grid.n_paths)
                if p not in busy and p not in fresh and (outstanding[p] is None or outstanding[p] > 0)]

    def rebase(self, open: Iterable[OpenTask]) -> list[OpenTask]:
        """The open tasks to move to the newest version (nobody has started them)."""
        return [t for t in open if t.base < self.committed]

    def cancel(self, running: Iterable[Running]) -> list[str]:
        """The keys of the running tasks to cancel now (after a commit): async, those whose result could
        no longer be applied when it arrives, committed − base > rounds.max_staleness (module docstring,
        Cancellation); sync never cancels."""
        if self.config.mode != "async":
            return []
        return [t.key for t in running if staleness_weight(self.committed - t.base, config=self.config) is None]

    def on_lost(self, base: int, *, resumable: bool = False) -> str:
        """A task's island was lost: "retry" it (next attempt, same base) or "replace" it by a task from
        the newest version. `resumable`: the island is back and holds the task's inner checkpoint, so the
        task is still its own (its result, if stale, is weighted like any other) — unless its result
        could no longer be applied (more than rounds.max_staleness versions since its base): resuming
        it would only train a result that is dropped."""
        if self.config.mode != "async" or base == self.committed:
            return "retry"
        if resumable and staleness_weight(self.committed - base, config=self.config) is not None:
            return "retry"
        return "replace"

    def assign(self, open: Iterable[OpenTask], idle: Iterable[IdleIsland]) -> list[tuple[str, str]]:
        """(task key, island) for the open tasks idle islands take now."""
        waiting = sorted(idle, key=lambda i: i.name)
        decisions = []
        for task in sorted(open, key=lambda t: (t.base, t.steps_done, t.path)):
            candidates = [i for i in waiting if i.may_take(task.path)]
            if not candidates:
                continue
            island = min(candidates, key=lambda i: (0 if task.path in i.pinned else 1,
                                                    0 if i.last_path == task.path else 1, i.name))
            waiting.remove(island)
            decisions.append((task.key, island.name))
        return decisions

    def keep_from(self, *, keep_rounds: int, bases: Iterable[int] = ()) -> int | None:
        """The oldest version retention must keep after a commit (None: keep everything): the last
        `keep_rounds`, in async mode every version a result may still be applied from, and every base
        of a task open or running (`bases`; not of a cancelled one, whose island has its modules already
        and whose result nobody reads).

        Async: a result that may still be applied is based on b ≥ committed − max_staleness (older
        running tasks were cancelled by this commit), so the last max_staleness + 1 versions stay, and
        the results folders from round committed − max_staleness on (a result based on b is in round
        b + 1's). Before cancellation one version more was kept, for tasks that ran on past that point
        only to have their results dropped."""
        if not keep_rounds:
            return None
        at_least = self.config.max_staleness + 1 if self.config.mode == "async" else 0
        keep = self.committed - max(keep_rounds, at_least) + 1
        return min([keep, *bases])
