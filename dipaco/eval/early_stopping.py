"""Per-path early stopping: each path's validation loss per module version, its best version, and
pruning that keeps the modules of every path's best version.

    dipaco eval --config configs/demo.yaml --run runs/demo --best      # each path at its best round

The island of round t scores its path on its validation blocks before training (`val_loss_start`):
that is the loss of module version t − 1. After the last round the coordinator scores version R the
same way (`record_final_val_losses`), so every version 0..R has a loss and the last round can win.
The store's `best.json` (written by the coordinator) holds

    {"history": {"3": {"0": 8.31, "1": 6.90, ...}},   # path → module version → validation loss
     "best": {"3": {"round": 6, "val_loss": 5.41}},    # lowest loss so far (the earliest on ties)
     "kept_bytes": 123456}                             # disk held only for best versions

Pruning (`train.keep_rounds`) deletes old module versions except, in a version that is some path's
best, the modules of that path (a shared module once, however many paths need it).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from dipaco.device import resolve_device
from dipaco.eval.scoring import mean_loss
from dipaco.model.topology import Topology
from dipaco.stages.context import PathFactory
from dipaco.store.module_store import ModuleStore

log = logging.getLogger(__name__)

BEST_FILE = "best.json"


def best_rounds(history: dict[int, dict[int, float]]) -> dict[int, int]:
    """`{path: {version: val_loss}}` → `{path: version with the lowest loss}` (earliest on ties;
    NaN losses never win unless a path has nothing else)."""
    best = {}
    for path, losses in history.items():
        finite = {v: loss for v, loss in losses.items() if not math.isnan(loss)} or losses
        best[path] = min(sorted(finite), key=lambda v: finite[v])
    return best


def read_history(store: ModuleStore) -> dict[int, dict[int, float]]:
    """The recorded validation losses `{path: {version: loss}}` ({} when none are recorded)."""
    if not store.exists(BEST_FILE):
        return {}
    raw = store.read_json(BEST_FILE)["history"]
    return {int(p): {int(v): float(x) for v, x in losses.items()} for p, losses in raw.items()}


def record_val_losses(store: ModuleStore, topology: Topology, *, version: int, losses: dict[int, float],
                      keep_from: int | None) -> dict:
    """Add the validation losses of module `version`, then prune versions older than `keep_from`
    (None = keep all) except what some path's best version needs. Returns what `best.json` holds."""
    history = read_history(store)
    for path, loss in losses.items():
        history.setdefault(int(path), {})[version] = float(loss)
    best = best_rounds(history)
    kept = prune_keeping_best(store, topology, keep_from=keep_from, best=best) if keep_from is not None else 0
    state = {
        "history": {str(p): {str(v): x for v, x in sorted(h.items())} for p, h in sorted(history.items())},
        "best": {str(p): {"round": v, "val_loss": history[p][v]} for p, v in sorted(best.items())},
        "kept_bytes": kept,
    }
    store.write_json(BEST_FILE, state)
    return state


def needed_modules(topology: Topology, best: dict[int, int]) -> dict[int, set[str]]:
    """`{version: module names}` that the paths' best versions need."""
    needed: dict[int, set[str]] = {}
    for path, version in best.items():
        needed.setdefault(version, set()).update(topology.modules_of_path(path))
    return needed


def prune_keeping_best(store: ModuleStore, topology: Topology, *, keep_from: int, best: dict[int, int]) -> int:
    """Delete module, outer-state and result versions older than `keep_from`, but keep the module
    files some path's best version needs. Returns the bytes of the module files kept that way."""
    store.prune(keep_from=keep_from, folders=("outer", "results"))
    needed = needed_modules(topology, best)
    kept = 0
    if not store.exists("modules"):
        return 0
    for entry in store.fs.ls(store._path("modules"), detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not name.startswith("round-") or int(name[6:]) >= keep_from:
            continue
        keep = needed.get(int(name[6:]), set())
        if not keep:
            store.fs.rm(entry, recursive=True)
            continue
        for file in store.fs.ls(entry, detail=True):
            module = file["name"].rstrip("/").rsplit("/", 1)[-1].removesuffix(".safetensors")
            if module in keep:
                kept += int(file["size"])
            else:
                store.fs.rm(file["name"])
    return kept


def path_val_loss(factory: PathFactory, model, *, path: int) -> float:
    """A path model's loss on its validation batches: the same batches and precision an island uses
    for `val_loss_start`."""
    config, reader = factory.config, factory.reader
    n = min(config.inner.val_batches, -(-reader.num_blocks(path, "val") // config.inner.batch_size))
    batches = reader.iter_batches(path, "val", batch_size=config.inner.batch_size, seed=0)
    device = next(model.parameters()).device
    return mean_loss(model, [next(batches) for _ in range(n)], device=device, precision=config.train.precision)


def final_val_losses(factory: PathFactory, *, version: int) -> dict[int, float]:
    """Every path's validation loss at module `version` (one model in memory at a time)."""
    device = resolve_device(factory.config.train.device)
    losses = {}
    for path in range(factory.topology.n_paths):
        model = factory.load_path(path=path, round=version, device=device)
        losses[path] = path_val_loss(factory, model, path=path)
        del model
    return losses


def record_final_val_losses(factory: PathFactory) -> dict:
    """After the last round: score the last module version per path (unless recorded) and prune."""
    store, config = factory.store, factory.config
    version = store.current_round()
    history = read_history(store)
    missing = [p for p in range(factory.topology.n_paths) if version not in history.get(p, {})]
    if not missing:
        return store.read_json(BEST_FILE)
    losses = final_val_losses(factory, version=version)
    log.info("validation loss after the last round (%d): %s", version,
             ", ".join(f"path {p} {x:.3f}" for p, x in losses.items()))
    keep_from = version - config.train.keep_rounds + 1 if config.train.keep_rounds else None
    return record_val_losses(store, factory.topology, version=version, losses=losses, keep_from=keep_from)


def best_of_run(factory: PathFactory) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
    """Each path's best module version and the loss history. The last version is scored here (not
    recorded) if the coordinator has not; a chosen version whose modules were pruned is an error."""
    store = factory.store
    version = store.current_round()
    history = read_history(store)
    missing = [p for p in range(factory.topology.n_paths) if version not in history.get(p, {})]
    if missing:
        log.info("scoring the last module version (%d) on validation data for paths %s", version, missing)
        for path, loss in final_val_losses(factory, version=version).items():
            history.setdefault(path, {})[version] = loss
    best = best_rounds(history)
    for path, v in best.items():
        for module in factory.topology.modules_of_path(path):
            if not store.exists(f"modules/round-{v:06d}/{module}.safetensors"):
                raise ValueError(f"path {path}'s best version {v} lost module {module} to pruning in {store.url}; "
                                 f"this store was pruned before best versions were kept (train.keep_rounds=0 keeps all)")
    return best, history


def history_array(history: dict[int, dict[int, float]], n_paths: int, n_versions: int) -> np.ndarray:
    """`(n_paths, n_versions)` validation losses, NaN where unknown."""
    out = np.full((n_paths, n_versions), np.nan)
    for path, losses in history.items():
        for v, loss in losses.items():
            if path < n_paths and v < n_versions:
                out[path, v] = loss
    return out
