"""Error feedback: what a path's upload did not carry is added to its next pseudo-gradient (`compression.error_feedback`).

    sent = with_residual(delta, residual)                  # Δ_t + e_t
    data, stats, residual = encode_with_feedback(sent, codec=Codec.of("topk", ...))
    # residual = e_{t+1} = (Δ_t + e_t) − decode(encode(Δ_t + e_t)), exactly what the coordinator will not apply

(EF21 / SparseLoCo.) Over rounds nothing is lost: Σ_t decode(encode(Δ_t + e_t)) + e_T = Σ_t Δ_t.

SparseLoCo's accumulator decays (`compression.ef_decay` β < 1): e_t = β·e_{t−1} + Δ_t, the codec sends
top-k(e_t), and e_t − decode(sent) is carried: `with_residual(delta, residual, decay=β)` then
`encode_with_feedback`. The accumulator then acts as a local outer momentum, and the outer step drops its
own (`Config.outer_step`, unless `compression.ef_with_momentum`). This
module is the math only; the residual belongs to the *path*, like its inner AdamW moments, and is stored
and checked with them (`dipaco.optim.error_feedback`).
"""

from __future__ import annotations

import torch

from dipaco.codec.codec import Codec


def with_residual(delta: dict[str, torch.Tensor], residual: dict[str, torch.Tensor], *,
                  decay: float = 1.0) -> dict[str, torch.Tensor]:
    """Δ + β·e, name by name (`residual` empty: Δ itself; `decay` β = 1: Δ + e, the residual carried whole)."""
    if decay == 1.0:
        return {name: tensor + residual[name] if name in residual else tensor for name, tensor in delta.items()}
    return {name: tensor + decay * residual[name] if name in residual else tensor for name, tensor in delta.items()}


def encode_with_feedback(sent: dict[str, torch.Tensor], *, codec: Codec) -> tuple[bytes, dict, dict[str, torch.Tensor]]:
    """Encode `sent` (Δ + e) → (the bytes, their stats, the new residual `sent` − what the bytes decode to)."""
    data, stats = codec.encode(sent)
    decoded = codec.decode(data)
    return data, stats, {name: tensor - decoded[name] for name, tensor in sent.items()}
