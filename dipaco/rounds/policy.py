"""The round policy: pure decisions on a clock it is given (no torch, no store, no wall clock).

    policy = RoundPolicy(Grid.of(topology), cfg.rounds, rounds=cfg.run.rounds)  # committed=t, applied=... on a restart
    policy.received(Result(key, path=2, base=4, tokens=51200, arrived=t, started=t0))
    if policy.close_due(now, running=[Running(...)], open=[OpenTask(...)]):
        plan = policy.plan(); ...write it...; policy.commit(plan)
    policy.paths_to_open(busy={0, 3}); policy.rebase(open_tasks); policy.cancel(running); policy.cut(running, now)
    policy.on_lost(task_base); policy.assign(open_tasks, idle_islands, busy={island: steps}, now=t, away={...})
    policy.keep_from(keep_rounds=2, bases=[...])

The coordinator's `tick` drives it in this order: `received` for each result; a task for each of
`paths_to_open`; `on_lost` for lost tasks; `close_due`, and when due `plan`, write, `commit`, `rebase`
the open tasks, replace each of `cancel`'s; `cut`; then `assign`. The rules (sync / async, staleness,
grace window, cutting, the run's length) are in docs/islands.md.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from dipaco.config import RoundsConfig
from dipaco.rounds import tasks
from dipaco.rounds.holds import PathHolds
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask, Result, Running
from dipaco.rounds.length import RunLength, unfinished
from dipaco.rounds.moves import PathMoves
from dipaco.rounds.plan import RoundPlan, plan_round
from dipaco.rounds.quorum import QuorumClock
from dipaco.rounds.staleness import staleness_weight


class RoundPolicy:
    """The committed version, the results not yet used, the run's length and the quorum clock."""

    def __init__(self, grid: Grid, config: RoundsConfig, *, rounds: int | None = None, inner_steps: int = 1,
                 committed: int = 0, applied: Iterable[tuple] = (), fragments: int = 1, beat_seconds: float = 0.0):
        """`rounds` × `inner_steps`: the run's length, in steps applied per path (`run.rounds`; None = no
        end). `applied`: (round, path[, steps]) of every result applied by committed rounds (manifests).
        `fragments` (outer.fragments) > 1: results and running tasks carry only some modules
        (`Result.modules`, `Running.modules`), and an async quorum counts for a module only those that carry it.
        `beat_seconds` (resilience.heartbeat_seconds): an open task waits for its path's holder at least a
        few of them (`holds.PathHolds`)."""
        self.grid, self.config, self.committed, self.rounds = grid, config, committed, rounds
        self.fragments = fragments
        self.length = RunLength(grid.n_paths, rounds, inner_steps=inner_steps, applied=applied)
        self.clock = QuorumClock(grid, config)
        self.moves = PathMoves(margin=config.move_margin, enabled=config.mode == "async")
        self.holds = PathHolds(beat_seconds=beat_seconds)
        self.pending: dict[str, Result] = {}

    def received(self, result: Result) -> None:
        """A result arrived (at most one per task key; a second one for the same key is ignored)."""
        if result.key in self.pending:
            return
        self.pending[result.key] = result
        self.clock.measure(result, whole=result.steps is None or result.steps >= self.length.inner_steps)

    def chain(self, path: int) -> frozenset[str]:
        """The keys of `path`'s results received and not yet applied: a task opened now starts from the
        newest version plus them (`Result.chain`)."""
        return frozenset(k for k, r in self.pending.items() if r.path == path)

    def withdraw(self, key: str) -> None:
        """A received result is not to be applied after all (found bad after its receipt)."""
        self.pending.pop(key, None)

    # --- the run's length ----------------------------------------------------------------------------
    def applied_results(self, path: int) -> int:
        return self.length.applied_results(path)

    def applied_steps(self, path: int) -> int:
        return self.length.applied_steps[path]

    def outstanding(self, path: int) -> int | None:
        """Steps `path` still owes beyond the committed rounds and the pending results the next round
        applies (None: the run has no length)."""
        return self.outstanding_all()[path]

    def outstanding_all(self) -> list[int | None]:
        """`outstanding` of every path, from one pass over the pending results."""
        usable = [0] * self.grid.n_paths
        for r in self.pending.values():
            if staleness_weight(self.committed - r.base, config=self.config) is not None:
                usable[r.path] += self.length.steps(r.steps)
        return self.length.outstanding(usable)

    @property
    def done(self) -> bool:
        """Every path has had `rounds` results applied: the run is over."""
        return self.length.done

    def finishes(self, plan: RoundPlan) -> bool:
        return self.length.finishes(plan)

    # --- closing a round -----------------------------------------------------------------------------
    def fresh_paths(self) -> set[int]:
        """Paths that reported for the next round: sync, a result from the newest version; async, any
        result received since the last commit that the next round can still apply."""
        if self.config.mode == "sync":
            return {r.path for r in self.pending.values() if r.base == self.committed}
        return {r.path for r in self.pending.values()
                if staleness_weight(self.committed - r.base, config=self.config) is not None}

    def close_due(self, now: float, *, running: Iterable[Running] = (), open: Iterable[OpenTask] = ()) -> bool:
        """May round committed + 1 close at `now`? `running`: the tasks being trained, `open`: the tasks
        not yet taken."""
        fresh = self.fresh_paths()
        if self.config.mode == "sync":
            return fresh >= set(range(self.grid.n_paths))
        running, open = list(running), list(open)
        outstanding = self.outstanding_all()
        if self.length.finishing(outstanding, running=running, open=open):
            return bool(self.pending) and not running  # the last results: wait for every one of them
        return self.clock.due(now, committed=self.committed, fresh=fresh, unfinished=unfinished(outstanding),
                              any_pending=bool(self.pending), running=running,
                              carried=self._carried(fresh) if self.fragments > 1 else None)

    def _carried(self, fresh: set[int]) -> dict[str, set[int]]:
        """Per shared module, the `fresh` paths whose pending results carry it."""
        results = [r for r in self.pending.values() if r.path in fresh
                   and staleness_weight(self.committed - r.base, config=self.config) is not None]
        return {m: {r.path for r in results if r.path in self.grid.modules[m] and (r.modules is None or m in r.modules)}
                for m in self.grid.shared}

    def grace_deadline(self) -> float | None:
        return self.clock.grace_deadline()

    def plan(self) -> RoundPlan:
        """The outer step of round committed + 1 from every pending result."""
        return plan_round(self.committed + 1, self.pending.values(), grid=self.grid, config=self.config,
                          applied=self.length.applied)

    def commit(self, plan: RoundPlan) -> None:
        """Round `plan.round` is written: its results are used, its version is the newest."""
        if plan.round != self.committed + 1:
            raise ValueError(f"round {plan.round} committed after round {self.committed}")
        for verdict in plan.verdicts:
            self.pending.pop(verdict.key, None)
        self.length.record(plan)
        self.committed = plan.round
        self.clock.quorum_since.clear()

    # --- tasks ---------------------------------------------------------------------------------------
    def paths_to_open(self, *, busy: set[int]) -> list[int]:
        return tasks.paths_to_open(self.grid.n_paths, busy=busy, fresh=self.fresh_paths(),
                                   outstanding=self.outstanding_all(), config=self.config)

    def rebase(self, open: Iterable[OpenTask]) -> list[OpenTask]:
        return tasks.rebase(open, committed=self.committed)

    def cancel(self, running: Iterable[Running]) -> list[str]:
        return tasks.cancel(running, committed=self.committed, config=self.config)

    def cut(self, running: Iterable[Running], now: float) -> list[str]:
        return tasks.cut(running, committed=self.committed, now=now, median=self.clock.median_task_seconds(),
                         config=self.config)

    def next_cut(self, running: Iterable[Running]) -> float | None:
        return tasks.next_cut(running, median=self.clock.median_task_seconds(), config=self.config)

    def on_lost(self, base: int, *, resumable: bool = False) -> str:
        return tasks.on_lost(base, committed=self.committed, config=self.config, resumable=resumable)

    def assign(self, open: Iterable[OpenTask], idle: Iterable[IdleIsland], *, busy: Mapping[str, int] | None = None,
               now: float | None = None, away: Collection[str] = ()) -> list[tuple[str, str]]:
        """Which idle island takes which open task (`busy`: island -> the steps done of the path it trains,
        at its task's start); a straggler's path moves (`moves.PathMoves`, from the speeds `measured`). With
        `now`, a task whose path's holder is not idle yet is held for it (`holds.PathHolds`) unless the holder
        is `away` (dead, another incarnation, cut), training another task (`busy`: not back soon) or slow (the
        straggler rule moves its path)."""
        open, idle = list(open), list(idle)
        if now is not None:
            slow = {t.holder for t in open if t.holder is not None and self.moves.slow(t.holder)}
            open = self.holds.release(open, idle, now=now, median=self.clock.median_task_seconds(),
                                      away={*away, *(busy or {}), *slow})
        return self.moves.assign(open, idle, busy=busy)

    def next_release(self) -> float | None:
        """When the earliest held task's grace ends (a pass is due then with no other event)."""
        return self.holds.next_release()

    def measured(self, island: str | None, *, steps: int, seconds: float | None) -> None:
        """`island` trained `steps` inner steps in `seconds` (the result's time in inner steps)."""
        self.moves.measure(island, steps=steps, seconds=seconds)

    def keep_from(self, *, keep_rounds: int, bases: Iterable[int] = ()) -> int | None:
        """The oldest version retention must keep after a commit (None: keep everything): the last
        `keep_rounds`, in async mode the last max_staleness + 1 (a result may still be applied from
        them), and every base of an open or running task (`bases`)."""
        if not keep_rounds:
            return None
        at_least = self.config.max_staleness + 1 if self.config.mode == "async" else 0
        keep = self.committed - max(keep_rounds, at_least) + 1
        return min([keep, *bases])
