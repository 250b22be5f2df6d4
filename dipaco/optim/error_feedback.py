"""The error-feedback residual in a path's inner state (`compression.error_feedback`; its math, what is sent
and what remains, is `dipaco.codec.feedback`).

    adam, residual = split_inner(tensors)
    check_residual(residual, shapes, where=file)
    tensors = join_inner(adam, residual)

The residual belongs to the *path*, like its inner AdamW moments, so it lives where they do: in the path's
inner state file in the store (`islands/path-P/inner-round-t...safetensors`, entries
`residual/<module>/<param>`), which the next task of the path reads on whichever island it runs, and in
the island's inner checkpoint (the residual the task started from) so a restarted island resumes with it.
An inner state is written by an island, so `check_residual` validates what is read back (names, shapes,
float32, finite) and refuses it naming the file and the tensor.
"""

from __future__ import annotations

import torch

from dipaco.optim.inner_entries import check_entries, join_entries, split_entries
from dipaco.store.module_store import StoreError

RESIDUAL = "residual/"  # prefix of the residual's entries in an inner state's tensors


def split_inner(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An inner state's tensors → (its AdamW entries, its residual `{"module/param": tensor}`, empty when none)."""
    return split_entries(tensors, RESIDUAL)


def join_inner(adam: dict[str, torch.Tensor], residual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inner state's tensors holding both (the inverse of `split_inner`)."""
    return join_entries(adam, RESIDUAL, residual)


def residual_bytes(residual: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in residual.values())


def check_residual(residual: dict[str, torch.Tensor], shapes: dict[str, list[int]], *, where: str) -> None:
    """Refuse (StoreError naming `where` and the tensor) a residual that is not exactly `shapes`' tensors
    (`{"module/param": shape}`, the path's parameters) in float32 with finite values. Empty is allowed
    (a path's first task, or a path that ran without error feedback): it stands for zeros."""
    if not residual:
        return
    missing, unexpected = sorted(set(shapes) - set(residual)), sorted(set(residual) - set(shapes))
    if missing or unexpected:
        raise StoreError(f"{where}: error-feedback residual does not match the path's parameters "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    check_entries(residual, shapes, label="error-feedback residual", where=where)
