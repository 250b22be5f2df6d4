"""Per-parameter tensors a path carries in its inner state beside its AdamW moments, under a name prefix:
the error-feedback residual (`residual/`, `dipaco.optim.error_feedback`) and the fragments' drift (`drift/`,
`dipaco.optim.drift`), each `{"module/param": tensor}`.

    rest, residual = split_entries(tensors, "residual/")
    tensors = join_entries(rest, "residual/", residual)
    check_entries(residual, shapes, label="error-feedback residual", where=file)
"""

from __future__ import annotations

import torch

from dipaco.store.module_store import StoreError


def split_entries(tensors: dict[str, torch.Tensor], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An inner state's tensors → (the others, the entries under `prefix` without it; empty when none)."""
    rest = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    return rest, {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def join_entries(tensors: dict[str, torch.Tensor], prefix: str, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inner state's tensors holding `entries` under `prefix` too (the inverse of `split_entries`)."""
    return tensors | {prefix + name: tensor.contiguous() for name, tensor in entries.items()}


def check_entries(entries: dict[str, torch.Tensor], shapes: dict[str, list[int]], *, label: str, where: str) -> None:
    """Refuse (StoreError naming `where`, `label` and the tensor) an entry whose shape is not its parameter's in
    `shapes` (`{"module/param": shape}`), that is not float32, or that holds a NaN or infinite value. Which
    names must be there is the caller's to check."""
    for name, tensor in entries.items():
        if list(tensor.shape) != list(shapes[name]):
            raise StoreError(f"{where}: {label} {name} has shape {list(tensor.shape)}, the parameter's is {list(shapes[name])}")
        if tensor.dtype != torch.float32:
            raise StoreError(f"{where}: {label} {name} is {tensor.dtype}, not float32")
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise StoreError(f"{where}: {label} {name} has {bad} NaN or infinite values")
