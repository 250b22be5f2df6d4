"""When a round may close, and which results its outer step applies with what weight (`outer.mode`).

- `sync` (the paper's algorithm): round t closes once every path has reported from version t − 1.
- `async` (Decoupled DiLoCo): round t may close once, for every module, at least
  ceil(outer.quorum × its paths) of its paths have reported from version t − 1; it then waits at
  most `outer.grace_seconds` for the rest. Results that arrive later (their task started from an
  older version b) are applied in a later round t' with weight tokens × (1 + s) ** −staleness_power,
  s = t' − 1 − b, and dropped when s > outer.max_staleness.

The outer step itself is `dipaco.optim.outer` (weighted average per module, then Nesterov SGD); a module
no result touches this round is carried over unchanged.
"""

from __future__ import annotations

import math

import torch

from dipaco.config import OuterConfig
from dipaco.model.topology import Topology
from dipaco.optim.outer import combine_pseudo_gradients, outer_update
from dipaco.store.board import read_result
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry, RoundManifest, Task


def staleness_weight(staleness: int, *, config: OuterConfig) -> float | None:
    """Multiplier for a result `staleness` versions old; None when it is to be dropped."""
    if staleness < 0:
        raise ValueError(f"a result cannot start from a version newer than the one it is applied to (staleness {staleness})")
    if config.mode == "sync":
        return 1.0 if staleness == 0 else None
    if staleness > config.max_staleness:
        return None
    return (1.0 + staleness) ** -config.staleness_power


def round_ready(topology: Topology, fresh_paths: set[int], *, config: OuterConfig) -> tuple[bool, bool]:
    """(every path has reported, every module has its quorum) for the round being built."""
    all_in = fresh_paths >= set(range(topology.n_paths))
    if config.mode == "sync":
        return all_in, all_in
    quorum = all(
        len(fresh_paths & set(paths)) >= math.ceil(config.quorum * len(paths))
        for paths in (topology.paths_of_module(m) for m in topology.modules)
    )
    return all_in, quorum


def apply_round(store: ModuleStore, topology: Topology, *, round: int, pending: list[Task],
                config: OuterConfig) -> RoundManifest:
    """Outer step for `round` from the received, not yet applied tasks `pending`; writes module (and
    momentum) version `round` and returns the manifest of what it applied and dropped (not written)."""
    applied, dropped, results = [], [], {}
    for task in sorted(pending, key=lambda t: (t.path, t.base)):
        staleness = round - 1 - task.base
        factor = staleness_weight(staleness, config=config)
        tensors, meta = read_result(store, round=task.round, path=task.path, attempt=task.result_attempt)
        entry = ManifestEntry(key=task.key, path=task.path, base=task.base, attempt=task.result_attempt,
                              staleness=staleness, tokens=meta.tokens, seconds=meta.seconds, bytes=meta.bytes,
                              train_loss=meta.train_loss, val_loss_start=meta.val_loss_start, factor=factor)
        if factor is None:
            dropped.append(entry)
            continue
        applied.append(entry)
        results[task.key] = _unflatten(tensors)
    for name in topology.modules:
        paths = set(topology.paths_of_module(name))
        contributions = []
        for entry in applied:
            if entry.path in paths:
                base_weight = float(entry.tokens) if config.weighting == "tokens" else 1.0
                contributions.append((results[entry.key][name], base_weight * entry.factor))
        params = store.read_module(round - 1, name)
        momentum = store.read_outer_state(round - 1, name)
        if contributions:
            outer_grad = combine_pseudo_gradients(contributions, rescale_by_paths=config.rescale_by_paths)
            params, momentum = outer_update(params, momentum, outer_grad, config)
        store.write_module(round, name, params)
        if momentum:
            store.write_outer_state(round, name, momentum)
    return RoundManifest(round=round, applied=tuple(applied), dropped=tuple(dropped))


def _unflatten(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, name = key.partition("/")
        modules.setdefault(module, {})[name] = tensor
    return modules
