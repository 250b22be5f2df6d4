"""The poison bound: how far an island's result may move a module, set by the honest results of its role.

    bound = UpdateBound(topology, scale=cfg.resilience.max_update_scale, hold_seconds=cfg.resilience.hold_seconds,
                        clock=clock, inner=InnerRun.of(cfg))
    verdict = bound.judge(task, attempt, moved={"embeddings": (norm of its Δ, norm of the module at its base)},
                          steps=meta.steps, hold=True)   # None | HELD | the reason it is refused
    bound.accept(task, attempt)                          # its scales join the reference (after every other check)

A module's *update scale* in a result is ‖Δ_m‖ / (‖θ_m‖ · Λ): how far it moved, relative to the module's norm
at the task's base, per unit of inner learning rate (Λ = Σ lr over the steps it trained / inner.lr, so results
from the warmup, the decay, a straggler's older steps, a cut task compare alike: AdamW moves each weight by
about lr per step). A result also carries what its path's inner state held at its start for that module, its
error-feedback residual and its fragment's drift (c_m = ‖e_m‖ + ‖d_m‖, training of earlier tasks, which does
not shrink with this task's lr): ‖Δ_m‖ ≤ ‖this task's training‖ + c_m, so c_m is added to the bound, and only
modules with c_m = 0 give scales to the reference (a path keeps its last such scale of each module), and only
they wait for one: a module that carries a drift in every result (`outer.fragments`, a fragment not synced in
the first round) has no reference, and only `resilience.max_update_ratio` bounds it. Honest
results of one *role* (the same shared module, or the module at the same place of another path: every
path's private embedding, `level0.module*` of every choice) have similar scales; a result is refused, by
module, norm and bound, when a module moves more than `resilience.max_update_scale` × the median scale of
its role's honest results × its norm × Λ, plus c_m.

The honest results are every path's last accepted result (`PathState.update_scales`, in the board the
coordinator commits, so the reference survives its restart), without the one judged. A result with a
role nobody has an accepted result for yet (a run's first results) is *held*: not received, not refused,
until another path's result gives that role a reference, either accepted or itself held (results of the
first round judge each other: each against the others' median), or `resilience.hold_seconds` pass (then
only `resilience.max_update_ratio` bounds it, as it does when no other path has that role, a 1-path run).
Holding costs nothing in sync mode (the round waits for every path anyway) and at most the hold in async.
It assumes most results of a role are honest: a result is judged against the median of the others, so two
colluding first results that arrive before any honest one of their role can vouch for each other.
"""

from __future__ import annotations

import logging
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from dipaco.config import Config, InnerConfig
from dipaco.model.topology import Topology
from dipaco.optim.inner import lr_at, phase_steps
from dipaco.store.board import inner_ref
from dipaco.store.records import PathState, Task

log = logging.getLogger(__name__)


class Held(str):
    """The verdict on a result that waits for a reference (not a reason to refuse it)."""


HELD = Held("held: no honest result of its modules' roles to compare with yet")


@dataclass(frozen=True)
class InnerRun:
    """What the coordinator knows of the islands' inner loop: the AdamW settings and the lr schedule."""

    config: InnerConfig  # inner.*: lr schedule, betas
    total_steps: int  # a path's inner steps over the run (run.rounds x inner.steps)
    warm_start_steps: int = 0  # steps the paths' schedule continues from (Config.warm_start_steps)
    optimizer_steps: int = 0  # AdamW steps a path's moments hold before its first task (a continued warm start's)

    @classmethod
    def of(cls, config: Config) -> InnerRun:
        continued = config.warm_start_steps if config.warm_start.continue_optimizer else 0
        return cls(config=config.inner, total_steps=config.run.rounds * config.inner.steps,
                   warm_start_steps=config.warm_start_steps, optimizer_steps=continued)

    @property
    def betas(self) -> tuple[float, float]:
        return self.config.beta1, self.config.beta2

    def lr_units(self, *, step_offset: int, steps: int) -> float:
        """Λ: Σ lr over a task's `steps` from path step `step_offset`, in units of the peak inner.lr."""
        first, total = phase_steps(self.config, steps=self.total_steps, after=self.warm_start_steps)
        return sum(lr_at(first + step_offset + i, config=self.config, total_steps=total) for i in range(steps)) / self.config.lr


def module_role(module: str) -> str:
    """`path003.embeddings` → `path*.embeddings`, `level1.module2` → `level1.module*`, `embeddings` itself."""
    return re.sub(r"\.module\d+$", ".module*", re.sub(r"^path\d+\.", "path*.", module))


class UpdateBound:
    def __init__(self, topology: Topology, *, scale: float, hold_seconds: float, clock: Callable[[], float],
                 inner: InnerRun | None = None):
        """`scale`: resilience.max_update_scale (0: off); `inner`: the schedule Λ is taken from (None: Λ = steps)."""
        self.topology, self.scale, self.hold_seconds, self.clock, self.inner = topology, scale, hold_seconds, clock, inner
        self.last: dict[int, tuple[str | None, dict[str, float]]] = {}  # path -> (its last accepted result's inner ref, scales)
        self.held: dict[tuple[str, int], tuple[int, dict[str, float], float]] = {}  # (key, attempt) -> (path, scales, since)
        self.judged: dict[tuple[str, int], dict[str, float]] = {}  # (key, attempt) -> scales, until accepted or forgotten
        self.closest = (0.0, "")  # the largest ‖Δ_m‖ / bound of a module within its bound, and "key module" (the margin)
        self._peers: dict[str, set[int]] = {}  # role -> paths with a module of that role
        for path in range(topology.n_paths):
            for module in topology.modules_of_path(path):
                self._peers.setdefault(module_role(module), set()).add(path)

    def seed(self, paths: dict[int, PathState]) -> None:
        """The reference a (re)started coordinator finds in its board: each path's last accepted scales."""
        for path, state in paths.items():
            if state.update_scales:
                self.last[path] = (state.inner, dict(state.update_scales))

    def judge(self, task: Task, attempt: int, *, moved: dict[str, tuple[float, float, float]], steps: int,
              hold: bool = True) -> str | None:
        """None (within the bound), HELD (`hold` and no reference yet), or why it is refused. `moved`: module ->
        (‖Δ_m‖, ‖θ_m‖ at the task's base, c_m: its residual's and drift's norm at the task's start)."""
        units = self.inner.lr_units(step_offset=task.step_offset, steps=steps) if self.inner else float(steps)
        scales = {m: float(f"{step / (size * units):.9g}") for m, (step, size, carried) in moved.items()  # 9 digits: the
                  if size > 0 and units > 0 and carried == 0}  # same in a restarted coordinator (a sum's last bit may not be)
        key = (task.key, attempt)
        self.judged[key] = scales
        if not self.scale:
            return None
        reference = self._reference(task, attempt)
        since = self.held.get(key, (task.path, scales, self.clock()))[2]
        waiting = [module_role(m) for m in scales if module_role(m) not in reference  # carry-free: can set one
                   and self._peers[module_role(m)] - {task.path}]
        if waiting and hold and self.clock() - since < self.hold_seconds:
            self.held[key] = (task.path, scales, since)
            return HELD
        self.held.pop(key, None)
        if waiting:
            log.warning("%s attempt %d: no honest result of %s to bound it by after %.0fs (resilience.hold_seconds); "
                        "only resilience.max_update_ratio bounds it", task.key, attempt, sorted(set(waiting)), self.clock() - since)
        for module, (step, size, carried) in moved.items():
            values = reference.get(module_role(module))
            if not values or size <= 0:
                continue
            median = statistics.median(values)
            bound = self.scale * median * size * units + carried
            if step <= bound:
                self.closest = max(self.closest, (step / bound, f"{task.key} {module}"))
            else:
                why = (f"{self.scale:g} (resilience.max_update_scale) x the median {median:.3g} of {len(values)} honest "
                       f"updates of {module_role(module)} per unit of lr and module norm x its norm {size:.4g} at version "
                       f"{task.base} x its {units:.3g} lr units")
                return (f"its pseudo-gradient of {module} has norm {step:.4g}, above the bound {bound:.4g}: {why}"
                        + (f" + {carried:.4g} its path carried" if carried else f" ({step / (size * units * median):.1f}x the median)"))
        return None

    def accept(self, task: Task, attempt: int) -> dict[str, float]:
        """The accepted result's scales become its path's reference; returns them (for `PathState.update_scales`)."""
        self.held.pop((task.key, attempt), None)
        scales = self.last.get(task.path, (None, {}))[1] | self.judged.pop((task.key, attempt), {})
        self.last[task.path] = (inner_ref(path=task.path, round=task.round, attempt=attempt, link=task.link), scales)
        return scales

    def forget(self, task: Task, attempt: int) -> None:
        self.held.pop((task.key, attempt), None)
        self.judged.pop((task.key, attempt), None)

    def _reference(self, task: Task, attempt: int) -> dict[str, list[float]]:
        """role -> the honest scales to compare with: every path's last accepted result but this one, and
        the results of other paths held for want of a reference."""
        own = inner_ref(path=task.path, round=task.round, attempt=attempt, link=task.link)
        reference: dict[str, list[float]] = {}
        sources = [scales for ref, scales in self.last.values() if ref != own]
        sources += [scales for (key, _), (path, scales, _) in self.held.items() if path != task.path]
        for scales in sources:
            for module, scale in scales.items():
                reference.setdefault(module_role(module), []).append(scale)
        return reference
