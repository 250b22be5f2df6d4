"""Error feedback: what a path's upload did not carry is added to its next pseudo-gradient (`compression.error_feedback`).

    sent = with_residual(delta, residual)                  # Δ_t + e_t
    data, residual = encode_with_feedback(sent, method="topk", level=1, topk=spec)
    # residual = e_{t+1} = (Δ_t + e_t) − decode(encode(Δ_t + e_t)), exactly what the coordinator will not apply

(EF21 / SparseLoCo.) Over rounds nothing is lost: Σ_t decode(encode(Δ_t + e_t)) + e_T = Σ_t Δ_t. The
residual belongs to the *path*, like its inner AdamW moments, so it is carried where they are: in the
path's carried state (`dipaco.carried.state`, which stores and checks it), and in the island's inner
checkpoint (the residual the task started from) so a restarted island resumes with it.
"""

from __future__ import annotations

import torch

from dipaco.store.compress import compress, decompress
from dipaco.store.sparse import TopK


def with_residual(delta: dict[str, torch.Tensor], residual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ + e, name by name (`residual` empty: Δ itself)."""
    return {name: tensor + residual[name] if name in residual else tensor for name, tensor in delta.items()}


def encode_with_feedback(sent: dict[str, torch.Tensor], *, method: str, level: int,
                         topk: TopK | None) -> tuple[bytes, dict, dict[str, torch.Tensor]]:
    """Compress `sent` (Δ + e) → (the bytes, compression stats, the new residual `sent` − what the bytes decode to)."""
    data, stats = compress(sent, method=method, level=level, topk=topk)
    decoded, _ = decompress(data, method=method)
    return data, stats, {name: tensor - decoded[name] for name, tensor in sent.items()}


def residual_bytes(residual: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in residual.values())
