"""The error-feedback residual a path carries (`compression.error_feedback`; its math, what is sent and what
remains, is `dipaco.codec.feedback`).

(EF21 / SparseLoCo.) Over rounds nothing is lost: Σ_t decode(encode(Δ_t + e_t)) + e_T = Σ_t Δ_t. The
residual belongs to the *path*, like its inner AdamW moments, so it is carried where they are: in the
path's carried state (`dipaco.carried.state`, which stores and checks it), and in the island's inner
checkpoint (the residual the task started from) so a restarted island resumes with it.
"""

from __future__ import annotations

import torch


def residual_bytes(residual: dict[str, torch.Tensor]) -> int:
    """The residual's size in bytes as held (float32), uploaded or not."""
    return sum(t.numel() * t.element_size() for t in residual.values())
