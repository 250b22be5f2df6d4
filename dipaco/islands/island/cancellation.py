"""A task the board cuts or no longer wants is stopped at once (async mode).

While it trains, an island reads the board at most every `resilience.heartbeat_seconds` (between inner
steps, in the training thread): when the board has cut its task (a straggler, or one about to be too
stale), it raises `TaskCut` and the island reports the steps trained so far; when the board no longer
holds its task open, assigned or cut — cancelled because its result could no longer be applied, lost
and replaced, or received from another attempt — it raises `TaskCancelled`. Sync mode never cancels and never looks; a DDP island does not look either (its
ranks would part ways), it trains a cancelled task to the end and the coordinator ignores the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dipaco.store.board import read_board
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Board, Task

log = logging.getLogger(__name__)


class TaskCancelled(RuntimeError):
    """Raised inside an island's inner loop when the board no longer wants its task's result."""


class TaskCut(RuntimeError):
    """Raised inside an island's inner loop when the board cut its task: report what was trained."""


def result_wanted(board: Board | None, task: Task) -> bool:
    """Could the coordinator still take `task`'s result? Only while its board holds the task open or
    assigned (any attempt: a late result of an older attempt is taken too); not when it is cancelled,
    lost or received from another attempt, nor when it has left a board newer than the task (one
    written at version `task.base` may predate it). No board: yes (nothing to go by)."""
    if board is None:
        return True
    held = board.tasks.get(task.key)
    if held is None:
        return board.round <= task.base
    return held.status in ("open", "assigned", "cut")


class BoardWatch:
    def __init__(self, store: ModuleStore, *, island: str, every: float | None, clock: Callable[[], float]):
        """`every`: seconds between looks at the board (None: never look, sync mode or a DDP island)."""
        self.store, self.island, self.every, self.clock = store, island, every, clock

    def wanted(self, task: Task) -> bool:
        return self._look(task)[0]

    def _look(self, task: Task) -> tuple[bool, bool]:
        """(is its result wanted, is it cut)."""
        try:
            board = read_board(self.store)
        except StoreError as err:  # a transient read error must not stop training
            log.warning("island %s: cannot read the board (%s); %s goes on", self.island, err, task.key)
            return True, False
        held = board.tasks.get(task.key) if board is not None else None
        return result_wanted(board, task), held is not None and held.status == "cut"

    def watch(self, task: Task) -> Callable[[], None]:
        """The check to run before each inner step (and during its pacing): raises `TaskCut` once the board
        cut `task` and at every call after that, `TaskCancelled` once it no longer wants its result (it
        reads the board at most every `every` seconds, island clock)."""
        if self.every is None:
            return lambda: None
        every, last, seen_cut = self.every, self.clock(), False

        def watch() -> None:
            nonlocal last, seen_cut
            if seen_cut:  # a cut stays a cut: the next step's check stops the batches too
                raise TaskCut(f"{task.key} attempt {task.attempt}: cut by the coordinator")
            now = self.clock()
            if now - last < every:
                return
            last = now
            wanted, cut = self._look(task)
            if not wanted:
                raise TaskCancelled(f"{task.key} attempt {task.attempt}: the board no longer wants its result")
            if cut:
                seen_cut = True
                raise TaskCut(f"{task.key} attempt {task.attempt}: cut by the coordinator")

        return watch
