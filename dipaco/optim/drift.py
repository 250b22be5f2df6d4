"""A path's drift: the training of the modules its tasks did not send yet (`outer.fragments`).

    sent, drift = split_sent(delta, synced)   # Δ = θ_base − θ_end of the synced modules; the others': the new drift

With fragments (`dipaco.rounds.fragments`) a task sends only its round's modules; the path keeps training
the others. For such a module m the task leaves d_m = θ_base_m − θ_end_m (θ_base: the version it started
from, rebased on its chain as every task is), and the path's next task starts m from its own base − d_m, so
the path's trajectory is continuous. When a task sends m it sends Δ_m = θ_base_m − θ_end_m, which holds the
drift, and m's drift is gone. Like the error-feedback residual (`dipaco.optim.error_feedback`) the drift is
the path's, so it is carried with its moments (`dipaco.carried.state`, which stores and checks it); an
island's inner checkpoint holds the path's parameters, which include it.
"""

from __future__ import annotations

import torch


def split_sent(delta: dict[str, torch.Tensor], synced: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """θ_base − θ_end `{"module/param": tensor}` → (the tensors of the `synced` modules: what is sent, the others:
    the new drift)."""
    sent = {name: t for name, t in delta.items() if name.partition("/")[0] in synced}
    return sent, {name: t for name, t in delta.items() if name.partition("/")[0] not in synced}
