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
from dipaco.stages.context import PathFactory
from dipaco.store.board import read_result


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


def apply_round(factory: PathFactory, round: int, pending: list[dict]) -> dict:
    """Outer step for `round` from the received, not yet applied tasks `pending` (each with `base`,
    `path` and `result_attempt`); writes module (and momentum) version `round`, returns what it used."""
    config, store, topology = factory.config, factory.store, factory.topology
    applied, dropped, results = [], [], {}
    for task in sorted(pending, key=lambda t: (t["path"], t["base"])):
        factor = staleness_weight(round - 1 - task["base"], config=config.outer)
        tensors, meta = read_result(store, task["round"], task["path"], task["result_attempt"])
        entry = {"key": task["key"], "path": task["path"], "base": task["base"], "attempt": task["result_attempt"],
                 "staleness": round - 1 - task["base"], "tokens": meta["tokens"], "seconds": meta["seconds"],
                 "bytes": meta["bytes"], "train_loss": meta["train_loss"], "val_loss_start": meta["val_loss_start"]}
        if factor is None:
            dropped.append(entry)
            continue
        entry["factor"] = factor
        applied.append(entry)
        results[task["key"]] = (_unflatten(tensors), meta, factor)
    for name in topology.modules:
        paths = set(topology.paths_of_module(name))
        contributions = []
        for entry in applied:
            if entry["path"] in paths:
                delta, meta, factor = results[entry["key"]]
                base_weight = float(meta["tokens"]) if config.outer.weighting == "tokens" else 1.0
                contributions.append((delta[name], base_weight * factor))
        params = store.read_module(round - 1, name)
        momentum = store.read_outer_state(round - 1, name)
        if contributions:
            outer_grad = combine_pseudo_gradients(contributions, rescale_by_paths=config.outer.rescale_by_paths)
            params, momentum = outer_update(params, momentum, outer_grad, config.outer)
        store.write_module(round, name, params)
        if momentum:
            store.write_outer_state(round, name, momentum)
    return {"applied": applied, "dropped": dropped}


def _unflatten(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, name = key.partition("/")
        modules.setdefault(module, {})[name] = tensor
    return modules
