"""Task decisions: which paths get a task, which open tasks move to the newest version, which running
ones are cancelled (async: their result could no longer be applied), what happens to a lost one, and
which idle island takes which open task."""

from __future__ import annotations

from collections.abc import Iterable

from dipaco.config import RoundsConfig
from dipaco.rounds.inputs import IdleIsland, OpenTask, Running
from dipaco.rounds.staleness import staleness_weight


def paths_to_open(n_paths: int, *, busy: set[int], fresh: set[int], outstanding: list[int | None]) -> list[int]:
    """Paths that need a new task from the newest version: none in flight (`busy`), no result yet from the
    newest version (`fresh`), and results still outstanding."""
    return [p for p in range(n_paths)
            if p not in busy and p not in fresh and (outstanding[p] is None or outstanding[p] > 0)]


def rebase(open: Iterable[OpenTask], *, committed: int) -> list[OpenTask]:
    """The open tasks to move to the newest version (nobody has started them)."""
    return [t for t in open if t.base < committed]


def cancel(running: Iterable[Running], *, committed: int, config: RoundsConfig) -> list[str]:
    """The keys of the running tasks whose result could no longer be applied when it arrives
    (async, committed − base > rounds.max_staleness); sync never cancels."""
    if config.mode != "async":
        return []
    return [t.key for t in running if staleness_weight(committed - t.base, config=config) is None]


def on_lost(base: int, *, committed: int, config: RoundsConfig, resumable: bool = False) -> str:
    """A task's island was lost: "retry" it (next attempt, same base) or "replace" it by a task from the
    newest version. `resumable`: the island is back with the task's inner checkpoint; it is retried
    unless its result could no longer be applied."""
    if config.mode != "async" or base == committed:
        return "retry"
    if resumable and staleness_weight(committed - base, config=config) is not None:
        return "retry"
    return "replace"


def assign(open: Iterable[OpenTask], idle: Iterable[IdleIsland]) -> list[tuple[str, str]]:
    """(task key, island) for the open tasks idle islands take now: oldest base first, then the path
    furthest behind, then the lowest path; an island pinned to the path first, then the one that
    trained it last."""
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
