"""Where a task's carried state comes from, and the one path's state an island holds in memory.

    held = HeldState(store)                        # the island's memory: the path it trained last
    if not awaiting_handoff(store, task, held=held):
        state, where, local, refused = fetch_carried(store, task, held=held, shapes=shapes, max_step=n, betas=betas)
    held.keep(ref, task.path, state, uploaded=False)
    held.hand_off()                                # the path moves on: upload what only memory holds

A path's carried state (`dipaco.carried.state`) lives on the island that trained the path last. A task
continues it from memory when this island holds it; from the store when it was uploaded there (a
checkpoint, the last task, a hand-off; when the board names a live island that holds it,
`Task.handoff_from`, the island does not start the task until that island's hand-off is there, or
`resilience.heartbeat_timeout` has passed); else from the path's last checkpoint (moments only: the
path moved after its island died), or fresh moments when it has none.

A state read from the store is checked (`CarriedState.check`, the one validator
`dipaco.carried.validate.check_inner_state`). The coordinator checks each uploaded one when it receives the
result beside it, so a bad one is rare here (a file changed or truncated in the store after its receipt);
an island that still finds one bad logs why, naming the file and the tensor, and the path resumes from
fresh moments (no residual, no drift): it loses only what the state held, and the result says so
(`ResultMeta.inner_refused`), where an island that exited would leave the coordinator waiting for ever.
"""

from __future__ import annotations

import logging

from dipaco.carried.state import CarriedState
from dipaco.store.board import inner_exists, read_inner, write_inner
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Task

log = logging.getLogger(__name__)

class HeldState:
    """The carried state of the one path this island trained last, with its reference."""

    def __init__(self, store: ModuleStore):
        self.store = store
        self.ref: str | None = None  # its reference (`dipaco.store.board.inner_ref`)
        self.path: int | None = None
        self.state: CarriedState | None = None
        self.uploaded = True  # the store holds it too
        self.handed_off = 0  # bytes uploaded by hand-offs

    def keep(self, ref: str, path: int, state: CarriedState, *, uploaded: bool) -> None:
        self.ref, self.path, self.state, self.uploaded = ref, path, state, uploaded

    def get(self, ref: str | None) -> CarriedState | None:
        return self.state if ref is not None and ref == self.ref else None

    def forget(self) -> None:
        """Memory lost (an injected death): nothing is held any more."""
        self.ref = self.path = self.state = None
        self.uploaded = True

    def hand_off(self) -> int:
        """Upload the held state when only memory holds it (float32: the path continues exactly on
        another island); returns the bytes written (0: nothing to hand off)."""
        if self.state is None or self.uploaded or self.ref is None:
            return 0
        written = write_inner(self.store, self.ref, *self.state.to_tensors(moments="float32"))
        self.uploaded = True
        self.handed_off += written
        log.info("handed path %s's carried state off to the store: %s (%d bytes)", self.path, self.ref, written)
        return written


def awaiting_handoff(store: ModuleStore, task: Task, *, held: HeldState | None) -> bool:
    """Whether `task`'s carried state is still to come from the live island holding it (`Task.handoff_from`)."""
    if task.handoff_from is None or task.inner_from is None:
        return False
    return (held is None or held.get(task.inner_from) is None) and not inner_exists(store, task.inner_from)


def fetch_carried(store: ModuleStore, task: Task, *, held: HeldState | None, shapes: dict[str, list[int]],
                  max_step: int, betas: tuple[float, float]) -> tuple[CarriedState, str, bool, str]:
    """The carried state `task` continues → (the state, where it came from ("" for fresh), from memory, why
    the stored one was refused ("": it was not)). One read from the store is checked (`CarriedState.check`
    against the path's `shapes`, at most `max_step` AdamW steps with `betas`); a bad one is logged and the
    path starts from fresh moments, no residual and no drift."""
    ref = task.inner_from
    if ref is None:
        return CarriedState(), "", False, ""
    local = held.get(ref) if held is not None else None
    if local is not None:
        return local, "memory", True, ""
    if inner_exists(store, ref):
        source, stale = ref, False
    elif task.inner_checkpoint is not None:
        log.warning("%s: its carried state %s was lost with its island; resuming from the checkpoint %s "
                    "(moments only)", task.key, ref, task.inner_checkpoint)
        source, stale = task.inner_checkpoint, True
    else:
        log.warning("%s: its carried state %s was lost with its island and it has no checkpoint; fresh moments",
                    task.key, ref)
        return CarriedState(), "", False, ""
    where = store.location(source)
    try:
        state = CarriedState.from_tensors(*read_inner(store, source), where=where)
        state.check(shapes, where=where, max_step=max_step, betas=betas)
    except StoreError as err:
        log.warning("%s: its carried state is refused (%s); the path resumes from fresh moments", task.key, err)
        return CarriedState(), "", False, str(err)
    return (state.stale() if stale else state), where, False, ""
