"""The inner state a task starts from, read from the store and checked; a bad one is reported, not trained on.

    saved, local, refused = starting_inner(setup.store, task, cached=cached_inner, shapes=shapes,
                                           max_step=warm_start_steps + task.step_offset, betas=(0.9, 0.95))
    # saved: (tensors, meta) to start from, None = fresh moments; refused: why the stored one was not used ("")

The coordinator checks each inner state when it receives the result beside it
(`dipaco.carried.validate.check_inner_state`), so a bad one is rare here: a file changed or truncated in the
store after its receipt, or one received before a coordinator that checks them. An island that still finds
it bad (missing, truncated, not AdamW's moments, a tensor of another shape, a NaN) logs why, naming the file
and the tensor, and the path resumes from fresh moments (and no residual or drift): it loses only
what its moments held, and the result says so (`ResultMeta.inner_refused`), where before every island that
took the path exited and the coordinator waited on that task for ever. The state this island wrote itself
(`cached`, its own memory) is used as it is.
"""

from __future__ import annotations

import logging

import torch

from dipaco.carried.validate import check_inner_state
from dipaco.store.board import read_inner
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Task

log = logging.getLogger(__name__)

Saved = tuple[dict[str, torch.Tensor], dict]  # an inner state's tensors and metadata


def starting_inner(store: ModuleStore, task: Task, *, cached: tuple[str, dict, dict] | None,
                   shapes: dict[str, list[int]], max_step: int, betas: tuple[float, float]) -> tuple[Saved | None, bool, str]:
    """(the state `task.inner_from` names: from `cached` when it is that one, else read and checked; None when
    it names none or is bad, whether it came from memory, why it was refused or "")."""
    if not task.inner_from:
        return None, False, ""
    if cached is not None and cached[0] == task.inner_from:
        return (cached[1], cached[2]), True, ""
    try:
        tensors, meta = read_inner(store, task.inner_from)
        check_inner_state(tensors, meta, file=store.location(task.inner_from), expected_shapes=shapes,
                          max_step=max_step, betas=betas)
    except StoreError as err:
        log.warning("%s: its inner state is refused (%s); the path resumes from fresh moments", task.key, err)
        return None, False, str(err)
    return (tensors, meta), False, ""
