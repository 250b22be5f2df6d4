"""What the coordinator keeps after each commit: it records the validation losses the applied results
report (`dipaco.eval.early_stopping`), then deletes what retention allows (`dipaco.store.retention`):
versions older than the policy's oldest kept one, except the modules some path's best version needs,
the inner states no task or path state names, and the staged versions no commit names (a deposed or crashed
coordinator's). `finish_run` scores the last version after the run.
"""

from __future__ import annotations

import logging
import math

import torch

from dipaco.eval.early_stopping import (
    ValidationData,
    best_rounds,
    final_val_losses,
    needed_modules,
    read_history,
    record_kept_bytes,
    record_val_losses,
    unscored_paths,
)
from dipaco.islands.coordinator.task_board import TaskBoard
from dipaco.model.path_model import PathSpec
from dipaco.model.topology import Topology
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import result_ref_base
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry
from dipaco.store.retention import keep_from, prune_inner_states, prune_orphans, prune_versions

log = logging.getLogger(__name__)


def retain(store: ModuleStore, topology: Topology, *, board: TaskBoard, policy: RoundPolicy, keep_versions: int,
           applied: tuple[ManifestEntry, ...]) -> None:
    """Record each applied result's validation loss for the version it started from, then prune: the
    policy's oldest kept version (`store.keep_versions`, the versions a stale result may start from, the
    base of every open or running task; not a cancelled task's)."""
    losses: dict[int, dict[int, float]] = {}
    for entry in applied:
        if math.isfinite(entry.val_loss_start):  # NaN: a chained task (it did not start from a version)
            losses.setdefault(entry.base, {})[entry.path] = entry.val_loss_start
    if losses:
        record_val_losses(store, losses)
    orphans = prune_orphans(store)  # a deposed or crashed coordinator's staged versions
    if orphans:
        log.info("deleted %d staged versions no commit names: %s", len(orphans), ", ".join(orphans[:4]))
    in_flight = board.in_flight()
    bases = [t.base for t in in_flight] + [result_ref_base(r) for t in in_flight for r in t.chain]  # their results too
    keep = policy.keep_from(keep_rounds=keep_versions, bases=bases)
    if keep is None:
        return
    prune_keeping_best(store, topology, keep_from=keep)
    referenced = ({s.inner for s in board.paths.values()} | {s.checkpoint for s in board.paths.values()}
                  | {t.inner_from for t in board.tasks.values()} | {t.inner_checkpoint for t in board.tasks.values()})
    prune_inner_states(store, n_paths=topology.n_paths, keep_from=keep, referenced=referenced)


def prune_keeping_best(store: ModuleStore, topology: Topology, *, keep_from: int) -> None:
    """Delete versions older than `keep_from` except the modules of every path's best version; the
    bytes kept that way go to best.json."""
    best = best_rounds(read_history(store))
    kept = prune_versions(store, keep_from=keep_from, keep_modules=needed_modules(topology, best))
    record_kept_bytes(store, kept)


def finish_run(store: ModuleStore, topology: Topology, spec: PathSpec, validation: ValidationData, *,
               keep_rounds: int, device: torch.device) -> None:
    """After the last round: score the last module version of every path (unless recorded), so it can
    be a path's best (`dipaco eval --best`), then prune to the last `keep_rounds` versions."""
    version = store.current_round()
    if not unscored_paths(store, topology, version=version):
        return
    losses = final_val_losses(store, topology, spec, validation, version=version, device=device)
    log.info("validation loss after the last round (%d): %s", version,
             ", ".join(f"path {p} {x:.3f}" for p, x in losses.items()))
    record_val_losses(store, {version: losses})
    keep = keep_from(version, keep_rounds=keep_rounds)
    if keep is not None:
        prune_keeping_best(store, topology, keep_from=keep)
