"""Error feedback: what a path's upload did not carry is added to its next pseudo-gradient (`compression.error_feedback`).

    sent = with_residual(delta, residual)                  # Δ_t + e_t
    data, residual = encode_with_feedback(sent, method="topk", level=1, topk=spec)
    # residual = e_{t+1} = (Δ_t + e_t) − decode(encode(Δ_t + e_t)), exactly what the coordinator will not apply

(EF21 / SparseLoCo.) Over rounds nothing is lost: Σ_t decode(encode(Δ_t + e_t)) + e_T = Σ_t Δ_t. The
residual belongs to the *path*, like its inner AdamW moments, so it lives where they do: in the path's
inner state file in the store (`islands/path-P/inner-round-t...safetensors`, entries
`residual/<module>/<param>`), which the next task of the path reads on whichever island it runs, and in
the island's inner checkpoint (the residual the task started from) so a restarted island resumes with it.
An inner state is written by an island, so `check_residual` validates what is read back (names, shapes,
float32, finite) and refuses it naming the file and the tensor.
"""

from __future__ import annotations

import torch

from dipaco.optim.inner_entries import check_entries, join_entries, split_entries
from dipaco.store.compress import compress, decompress
from dipaco.store.module_store import StoreError
from dipaco.store.sparse import TopK

RESIDUAL = "residual/"  # prefix of the residual's entries in an inner state's tensors


def with_residual(delta: dict[str, torch.Tensor], residual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ + e, name by name (`residual` empty: Δ itself)."""
    return {name: tensor + residual[name] if name in residual else tensor for name, tensor in delta.items()}


def encode_with_feedback(sent: dict[str, torch.Tensor], *, method: str, level: int,
                         topk: TopK | None) -> tuple[bytes, dict, dict[str, torch.Tensor]]:
    """Compress `sent` (Δ + e) → (the bytes, compression stats, the new residual `sent` − what the bytes decode to)."""
    data, stats = compress(sent, method=method, level=level, topk=topk)
    decoded, _ = decompress(data, method=method)
    return data, stats, {name: tensor - decoded[name] for name, tensor in sent.items()}


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
