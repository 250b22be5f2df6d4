"""One path trained once for the next round, outside the board's assignment (`dipaco island --path P`).

    dipaco island --config configs/tiny.yaml --run runs/tiny --path 3
"""

from __future__ import annotations

import logging

from dipaco.islands.island.training import IslandSetup, push_result, train_task
from dipaco.store.board import inner_exists, inner_ref, read_board, read_result_meta, result_exists
from dipaco.store.records import PathState, ResultMeta, Task
from dipaco.store.run_state import first_inner, run_finished

log = logging.getLogger(__name__)


def run_pinned_task(setup: IslandSetup, *, path: int, island: str) -> ResultMeta:
    """Train `path` once for the next round, outside the board's assignment (`dipaco island --path P`).

    It runs the task the coordinator opens for that path (attempt 0, continuing the path's data order
    and inner state), so the coordinator picks the result up; a result already there is not redone."""
    store = setup.store
    committed = store.current_round()
    if run_finished(store):
        raise ValueError(f"the run in {store.url} is finished (every path has had run.rounds = "
                         f"{setup.run.rounds} results applied); nothing to train")
    if result_exists(store, round=committed + 1, path=path, attempt=0):
        log.info("round %d path %d already has a result; nothing to do", committed + 1, path)
        return read_result_meta(store, round=committed + 1, path=path, attempt=0)
    board = read_board(store)
    state = board.paths.get(path) if board else None
    if state is None:  # no coordinator has run: the path has trained every committed round
        previous = inner_ref(path=path, round=committed, attempt=0)
        state = PathState(steps_done=committed * setup.inner.steps,
                          inner=previous if inner_exists(store, previous) else
                          first_inner(store) if committed == 0 else None)
    task = Task.open(path=path, base=committed, step_offset=state.steps_done, inner_from=state.inner,
                     inner_checkpoint=state.checkpoint)
    meta, _, _ = push_result(setup, task, train_task(setup, task), island=island, handing_off=True)  # the process ends
    return meta


