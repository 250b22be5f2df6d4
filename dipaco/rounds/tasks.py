"""Task decisions: which paths get a task, which open tasks move to the newest version, which running
ones are cut (async: they report the steps trained so far) or cancelled (their result could no longer be
applied), what happens to a lost one, and which idle island takes which open task.

Sync: a path gets its next task once a round has applied its result (from the newest version). Async:
a path gets its next task as soon as it has none in flight, so its island never waits for a commit;
the task continues from the path's own latest parameters (the newest version plus its results not yet
applied: `Task.chain`), and its result is the progress of its own steps.
"""

from __future__ import annotations

from collections.abc import Iterable

from dipaco.config import RoundsConfig
from dipaco.rounds.inputs import IdleIsland, OpenTask, Running
from dipaco.rounds.staleness import staleness_weight


def paths_to_open(n_paths: int, *, busy: set[int], fresh: set[int], outstanding: list[int | None],
                  config: RoundsConfig) -> list[int]:
    """Paths that need a new task: none in flight (`busy`), work still outstanding, and in sync mode no
    result yet from the newest version (`fresh`)."""
    waiting = fresh if config.mode == "sync" else set()
    return [p for p in range(n_paths)
            if p not in busy and p not in waiting and (outstanding[p] is None or outstanding[p] > 0)]


def rebase(open: Iterable[OpenTask], *, committed: int) -> list[OpenTask]:
    """The open tasks to move to the newest version (nobody has started them)."""
    return [t for t in open if t.base < committed]


def cancel(running: Iterable[Running], *, committed: int, config: RoundsConfig) -> list[str]:
    """The keys of the running tasks whose result could no longer be applied when it arrives
    (async, committed − base > rounds.max_staleness); sync never cancels."""
    if config.mode != "async":
        return []
    return [t.key for t in running if staleness_weight(committed - t.base, config=config) is None]


def cut(running: Iterable[Running], *, committed: int, now: float, median: float | None,
        config: RoundsConfig) -> list[str]:
    """The keys of the running tasks to cut now (async; sync never cuts), stragglers: those running longer
    than `rounds.cut_after` median task times, and those that have run a median task time and are
    `rounds.max_staleness` versions behind (the next round can still apply their result, no later one).
    A cut task's path moves on and what it trained is applied (its Δ holds the steps it trained). An elastic
    island short of workers (`Running.capacity` c < 1) is expected slower: it is late after `cut_after`
    median task times / c."""
    if config.mode != "async" or median is None:
        return []
    keys = []
    for t in running:
        if t.cut or t.started is None:
            continue
        ran = now - t.started
        late = config.cut_after > 0 and ran > config.cut_after * median / t.capacity
        last_chance = 1 <= committed - t.base == config.max_staleness and ran >= median
        if late or last_chance:
            keys.append(t.key)
    return keys


def next_cut(running: Iterable[Running], *, median: float | None, config: RoundsConfig) -> float | None:
    """When the next running task becomes late enough to be cut (None: none will without another event)."""
    if config.mode != "async" or config.cut_after <= 0 or median is None:
        return None
    times = [t.started + config.cut_after * median / t.capacity for t in running
             if not t.cut and t.started is not None]
    return min(times) if times else None


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
    trained it last (unless it was cut: a straggler's path moves to an island that was not), then
    islands whose own path (the one they trained last) has no open task left to take (a path is not
    taken from the island that holds it while another island is free), then islands never cut before
    islands that were."""
    waiting = sorted(idle, key=lambda i: i.name)
    open = sorted(open, key=lambda t: (t.base, t.steps_done, t.path))
    left = {t.path for t in open}  # paths with an open task not yet given
    decisions = []
    for task in open:
        candidates = [i for i in waiting if i.may_take(task.path)]
        if not candidates:
            continue
        island = min(candidates, key=lambda i: (0 if task.path in i.pinned else 1,
                                                0 if i.last_path == task.path and not i.was_cut else 1,
                                                1 if i.last_path in left and not i.was_cut else 0,
                                                1 if i.was_cut else 0, i.name))
        waiting.remove(island)
        left.discard(task.path)
        decisions.append((task.key, island.name))
    return decisions
