"""The coordinator's bookkeeping around the real round policy (`dipaco.rounds.policy.RoundPolicy`), on
the simulator's clock: the tasks (open, running, received) and one `tick` in the coordinator's order
(`Coordinator.tick`): open the tasks the policy names; ask whether the round closes, and on a close plan,
commit, move open tasks to the newest version, cancel the running tasks the policy names (each replaced
by an open task from the newest version) and open tasks for the paths that reported; cut the running
tasks the policy names; then hand open tasks to idle learners. Every decision is the policy's; this file only keeps the state the
coordinator keeps in its task board.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from dipaco.config import RoundsConfig
from dipaco.model.topology import Topology
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask, Result, Running
from dipaco.rounds.plan import RoundPlan
from dipaco.rounds.policy import RoundPolicy


@dataclass(frozen=True)
class SimTask:
    key: str
    path: int
    base: int
    steps_done: int  # inner steps its path had trained when it was opened (the coordinator's step_offset)
    steps: int  # inner steps it asks for
    chain: frozenset[str] = frozenset()  # its path's received results not yet applied when it was opened (it starts from them)


@dataclass(frozen=True)
class Pass:
    """What one coordinator pass decided."""

    handed: list[tuple[SimTask, str]]  # (task, island) handed out
    plan: RoundPlan | None  # the round it closed, if any
    cancelled: list[tuple[SimTask, str]]  # (task, island) of the running tasks it cancelled (their islands stop them)
    cut: list[tuple[SimTask, str]]  # (task, island) of the running tasks it cut (they report what they trained)


class Syncer:
    def __init__(self, topology: Topology, closing: RoundsConfig, *, inner_steps: int, rounds: int | None = None) -> None:
        """`rounds`: the run's length in results applied per path, as `run.rounds` (None: to the horizon)."""
        self.policy = RoundPolicy(Grid.of(topology), closing, rounds=rounds, inner_steps=inner_steps)
        self.inner_steps = inner_steps
        self.steps_done = {p: 0 for p in range(topology.n_paths)}  # per path, from the results received
        self.open: dict[str, SimTask] = {}
        self.running: dict[str, tuple[SimTask, str, float]] = {}  # key -> (task, island, handed out at)
        self.cut_keys: set[str] = set()  # running tasks already cut
        self._serial = itertools.count()

    @property
    def committed(self) -> int:
        return self.policy.committed

    def _new_task(self, path: int) -> SimTask:
        base = self.policy.committed
        owed = self.policy.outstanding(path)
        steps = self.inner_steps if owed is None else max(1, min(self.inner_steps, owed))
        return SimTask(key=f"path-{path:04d}-v{base:06d}-{next(self._serial)}", path=path, base=base,
                       steps_done=self.steps_done[path], steps=steps, chain=self.policy.chain(path))

    def received(self, key: str, *, tokens: int, steps: int, now: float, seconds: float | None = None) -> bool:
        """The result of running task `key` (`steps` trained in `seconds`, its island's speed) arrived; False
        (ignored, as the coordinator ignores it) when the task was cancelled meanwhile."""
        if key not in self.running:
            return False
        task, island, started = self.running.pop(key)
        self.policy.measured(island, steps=steps, seconds=seconds)
        self.cut_keys.discard(key)
        self.steps_done[task.path] = task.steps_done + steps
        self.policy.received(Result(key=key, path=task.path, base=task.base, tokens=tokens, arrived=now,
                                    started=started, steps=steps, chain=task.chain))
        return True

    def tick(self, now: float, idle: list[IdleIsland], *, holders: dict[int, str] | None = None,
             away: set[str] | None = None) -> Pass:
        """One coordinator pass, in its order: open the tasks the policy names; cut the running tasks it
        names; close the round if the policy says so, then cancel and cut the running tasks the policy
        names and open tasks from the new version; hand open tasks to idle islands. Once the run's length
        is applied (`policy.done`) it decides nothing, as the coordinator. `holders`: path -> the island
        holding its carried state (an open task waits for it, `holds.PathHolds`); `away`: islands not alive."""
        if self.policy.done:
            return Pass(handed=[], plan=None, cancelled=[], cut=[])
        self._open_tasks()
        plan, cancelled, cut = None, [], []
        if self.policy.close_due(now, running=self._running_view(), open=self._open_view()):
            plan = self.policy.plan()
            self.policy.commit(plan)
            for stale in self.policy.rebase(self._open_view()):
                del self.open[stale.key]
                task = self._new_task(stale.path)
                self.open[task.key] = task
            for key in self.policy.cancel(self._running_view()):
                task, island, _ = self.running.pop(key)
                self.cut_keys.discard(key)
                fresh = self._new_task(task.path)
                self.open[fresh.key] = fresh
                cancelled.append((task, island))
            self._open_tasks()  # the paths that reported train on from the new version
        cut += self._cut(now)
        handed = []
        busy = {island: task.steps_done for task, island, _ in self.running.values()}
        open = [replace(t, holder=(holders or {}).get(t.path)) for t in self._open_view()]
        for key, island in self.policy.assign(open, idle, busy=busy, now=now, away=away or set()):
            task = self.open.pop(key)
            self.running[key] = (task, island, now)
            handed.append((task, island))
        return Pass(handed=handed, plan=plan, cancelled=cancelled, cut=cut)

    def _cut(self, now: float) -> list[tuple[SimTask, str]]:
        keys = self.policy.cut(self._running_view(), now)
        self.cut_keys |= set(keys)
        return [self.running[k][:2] for k in keys]

    def _open_tasks(self) -> None:
        busy = {t.path for t in self.open.values()} | {t.path for t, _, _ in self.running.values()}
        for path in self.policy.paths_to_open(busy=busy):
            task = self._new_task(path)
            self.open[task.key] = task

    def grace_deadline(self) -> float | None:
        """When a running grace window ends (the round may close then with no other event)."""
        return self.policy.grace_deadline()

    def next_release(self) -> float | None:
        """When an open task held for its path's holder is released (a pass is due then with no other event)."""
        return self.policy.next_release()

    def next_cut(self) -> float | None:
        """When a running task becomes late enough to be cut (a pass is due then with no other event)."""
        return self.policy.next_cut(self._running_view())

    def _running_view(self) -> list[Running]:
        return [Running(key=k, path=t.path, base=t.base, started=s, cut=k in self.cut_keys,
                        steps=None if t.steps == self.inner_steps else t.steps)
                for k, (t, _, s) in self.running.items()]

    def _open_view(self) -> list[OpenTask]:
        return [OpenTask(key=t.key, path=t.path, base=t.base, steps_done=t.steps_done) for t in self.open.values()]
