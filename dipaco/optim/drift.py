"""A path's drift: the training of the modules its tasks did not send yet (`outer.fragments`).

    rest, drift = split_drift(inner_tensors)          # drift: {"module/param": θ_base − θ_local}
    ...                                               # the task's model starts from θ_base − d, trains
    sent, drift = split_sent(delta, synced)           # Δ = θ_base − θ_end of the synced modules; the others': the new drift
    inner_tensors = join_drift(rest, drift)

With fragments (`dipaco.rounds.fragments`) a task sends only its round's modules; the path keeps training
the others. For such a module m the task leaves d_m = θ_base_m − θ_end_m (θ_base: the version it started
from, rebased on its chain as every task is), and the path's next task starts m from its own base − d_m, so
the path's trajectory is continuous. When a task sends m it sends Δ_m = θ_base_m − θ_end_m, which holds the
drift, and m's drift is gone. Like the error-feedback residual (`dipaco.optim.error_feedback`) the drift is
the path's, so it lives in the path's inner state in the store (entries `drift/<module>/<param>`), moving
with the path to any island; an island's inner checkpoint holds the path's parameters, which include it.
An inner state is written by an island, so `check_drift` validates what is read back.
"""

from __future__ import annotations

import torch

from dipaco.optim.inner_entries import check_entries, join_entries, split_entries
from dipaco.store.module_store import StoreError

DRIFT = "drift/"  # prefix of the drift's entries in an inner state's tensors


def split_drift(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An inner state's tensors → (the others, the drift `{"module/param": tensor}`, empty when none)."""
    return split_entries(tensors, DRIFT)


def join_drift(tensors: dict[str, torch.Tensor], drift: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inner state's tensors holding the drift too (the inverse of `split_drift`)."""
    return join_entries(tensors, DRIFT, drift)


def split_sent(delta: dict[str, torch.Tensor], synced: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """θ_base − θ_end `{"module/param": tensor}` → (the tensors of the `synced` modules: what is sent, the others:
    the new drift)."""
    sent = {name: t for name, t in delta.items() if name.partition("/")[0] in synced}
    return sent, {name: t for name, t in delta.items() if name.partition("/")[0] not in synced}


def check_drift(drift: dict[str, torch.Tensor], shapes: dict[str, list[int]], *, where: str) -> None:
    """Refuse (StoreError naming `where` and the tensor) a drift that is not some of `shapes`' tensors
    (`{"module/param": shape}`, the path's parameters) in float32 with finite values; one absent is zero."""
    unexpected = sorted(set(drift) - set(shapes))
    if unexpected:
        raise StoreError(f"{where}: drift {unexpected[:3]} is not of the path's parameters")
    check_entries(drift, shapes, label="drift", where=where)
