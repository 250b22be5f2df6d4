"""Per-path early stopping: each path's validation loss per module version, and its best version.

    dipaco eval --config configs/demo.yaml --run runs/demo --best      # each path at its best round

The island of round t scores its path on its validation blocks before training (`val_loss_start`,
with `ValidationData.loss`): that is the loss of module version t − 1. After the last round the
coordinator scores version R the same way (`final_val_losses`), so every version 0..R has a loss and
the last round can win. The store's best.json (written by the coordinator) holds

    {"history": {"3": {"0": 8.31, "1": 6.90, ...}},   # path → module version → validation loss
     "best": {"3": {"round": 6, "val_loss": 5.41}},    # lowest loss so far (the earliest on ties)
     "kept_bytes": 123456}                             # disk held only for best versions

Pruning (`dipaco.store.retention`, `store.keep_versions`) keeps the modules `needed_modules` names: in
a version that is some path's best, the modules of that path.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dipaco.model.topology import Topology
from dipaco.store.module_store import ModuleStore
from sharding.reader import ShardReader

if TYPE_CHECKING:  # the model (torch, transformers) loads where a path is scored: `dipaco status` reads best.json only
    import torch

    from dipaco.model.path_model import PathSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationData:
    """Each path's validation blocks, batched as the islands score them for `val_loss_start`."""

    reader: ShardReader
    batch_size: int  # inner.batch_size
    max_batches: int  # inner.val_batches
    precision: str  # hardware.precision
    _read: dict[int, list[np.ndarray]] = field(default_factory=dict, init=False, compare=False, repr=False)

    def batches(self, path: int) -> list[np.ndarray]:
        """The first `max_batches` batches `(batch_size, seq_len)` of the path's validation blocks (fixed
        order), read once per path."""
        if path not in self._read:
            n = min(self.max_batches, -(-self.reader.num_blocks(path, "val") // self.batch_size))
            batches = self.reader.iter_batches(path, "val", batch_size=self.batch_size, seed=0)
            self._read[path] = [next(batches) for _ in range(n)]
        return self._read[path]

    def loss(self, model: torch.nn.Module, *, path: int) -> float:
        """A path model's mean loss on its validation batches, on the device the model is on."""
        from dipaco.eval.scoring import mean_loss

        device = next(model.parameters()).device
        return mean_loss(model, self.batches(path), device=device, precision=self.precision)


def best_rounds(history: dict[int, dict[int, float]]) -> dict[int, int]:
    """`{path: {version: val_loss}}` → `{path: version with the lowest loss}` (earliest on ties;
    NaN losses never win unless a path has nothing else)."""
    best = {}
    for path, losses in history.items():
        finite = {v: loss for v, loss in losses.items() if not math.isnan(loss)} or losses
        best[path] = min(sorted(finite), key=lambda v: finite[v])
    return best


def needed_modules(topology: Topology, best: dict[int, int]) -> dict[int, set[str]]:
    """`{version: module names}` that the paths' best versions `{path: version}` need."""
    needed: dict[int, set[str]] = {}
    for path, version in best.items():
        needed.setdefault(version, set()).update(topology.modules_of_path(path))
    return needed


def read_best(store: ModuleStore) -> dict[str, Any]:
    """What best.json holds ({} when nothing is recorded)."""
    return store.read_best() or {}


def read_history(store: ModuleStore) -> dict[int, dict[int, float]]:
    """The recorded validation losses `{path: {version: loss}}` ({} when none are recorded)."""
    raw = read_best(store).get("history", {})
    return {int(p): {int(v): float(x) for v, x in losses.items()} for p, losses in raw.items()}


def record_val_losses(store: ModuleStore, losses: dict[int, dict[int, float]]) -> dict[str, Any]:
    """Add validation losses `{version: {path: loss}}` to best.json (the bytes kept for best versions
    stay as recorded last). Returns what best.json holds."""
    history = read_history(store)
    for version, by_path in losses.items():
        for path, loss in by_path.items():
            history.setdefault(int(path), {})[int(version)] = float(loss)
    best = best_rounds(history)
    state = {
        "history": {str(p): {str(v): x for v, x in sorted(h.items())} for p, h in sorted(history.items())},
        "best": {str(p): {"round": v, "val_loss": history[p][v]} for p, v in sorted(best.items())},
        "kept_bytes": read_best(store).get("kept_bytes", 0),
    }
    store.write_best(state)
    return state


def record_kept_bytes(store: ModuleStore, kept: int) -> None:
    """Record the bytes of module files pruning kept only because they are some path's best."""
    state = read_best(store)
    store.write_best({"history": {}, "best": {}, **state, "kept_bytes": kept})


def final_val_losses(store: ModuleStore, topology: Topology, spec: PathSpec, validation: ValidationData, *,
                     version: int, device: torch.device, paths: list[int] | None = None) -> dict[int, float]:
    """The validation loss of each of `paths` (default all) at module `version`, one model in memory at a time."""
    from dipaco.model.path_model import assemble_path

    losses = {}
    for path in range(topology.n_paths) if paths is None else paths:
        model = assemble_path(spec, store.read_modules(version, topology.modules_of_path(path)), device=device)
        losses[path] = validation.loss(model, path=path)
        del model
    return losses


def unscored_paths(store: ModuleStore, topology: Topology, *, version: int) -> list[int]:
    """The paths with no recorded validation loss at `version`."""
    history = read_history(store)
    return [p for p in range(topology.n_paths) if version not in history.get(p, {})]


def best_of_run(store: ModuleStore, topology: Topology, spec: PathSpec, validation: ValidationData, *,
                device: torch.device) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
    """Each path's best module version and the loss history. The last version is scored here (not
    recorded) if the coordinator has not; a chosen version whose modules were pruned is an error."""
    version = store.current_round()
    history = read_history(store)
    missing = unscored_paths(store, topology, version=version)
    if missing:
        log.info("scoring the last module version (%d) on validation data for paths %s", version, missing)
        for path, loss in final_val_losses(store, topology, spec, validation, version=version, device=device).items():
            history.setdefault(path, {})[version] = loss
    best = best_rounds(history)
    for path, v in best.items():
        for module in topology.modules_of_path(path):
            if not store.has_module(v, module):
                raise ValueError(f"path {path}'s best version {v} lost module {module} to pruning in {store.url}; "
                                 f"this store was pruned before best versions were kept (store.keep_versions=0 keeps all)")
    return best, history
