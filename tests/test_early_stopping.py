"""Per-path early stopping: the best version is the lowest validation loss, and pruning keeps it."""

import math

import torch

from dipaco.config import TopologyConfig
from dipaco.eval.early_stopping import best_rounds, read_history, record_val_losses
from dipaco.model.topology import Topology
from dipaco.store.module_store import ModuleStore


def test_best_round_is_the_lowest_validation_loss_earliest_on_ties():
    history = {0: {0: 9.0, 1: 7.0, 2: 7.5, 3: 8.0}, 1: {0: 9.0, 1: 6.0, 2: 5.0, 3: 4.0},
               2: {0: 5.0, 1: 5.0, 2: 6.0}, 3: {0: math.nan, 1: 8.0}}
    assert best_rounds(history) == {0: 1, 1: 3, 2: 0, 3: 1}


def test_pruning_keeps_exactly_the_modules_of_each_paths_best_version(tmp_path):
    topology = Topology.from_config(TopologyConfig(levels=[2, 2]), n_layers=2)
    store = ModuleStore(str(tmp_path / "store"))
    tensor = {"w": torch.ones(10)}
    # versions 0..5 of every module; path 0 is best at version 1, the others keep improving
    losses = {0: [9, 5, 6, 7, 8, 8], 1: [9, 8, 7, 6, 5, 4], 2: [9, 8, 7, 6, 5, 4], 3: [9, 8, 7, 6, 5, 4]}
    for version in range(6):
        for name in topology.modules:
            store.write_module(version, name, tensor)
        if version >= 1:  # the islands of round `version` report the losses of version - 1
            state = record_val_losses(store, topology, version=version - 1, keep_from=version - 1,
                                      losses={p: losses[p][version - 1] for p in losses})
    state = record_val_losses(store, topology, version=5, keep_from=4, losses={p: losses[p][5] for p in losses})
    assert {int(p): b["round"] for p, b in state["best"].items()} == {0: 1, 1: 5, 2: 5, 3: 5}
    assert read_history(store)[0] == {v: float(x) for v, x in enumerate(losses[0])}
    kept = {v: {name for name in topology.modules if store.exists(f"modules/round-{v:06d}/{name}.safetensors")}
            for v in range(6)}
    assert kept[1] == set(topology.modules_of_path(0))  # path 0's modules only
    assert kept[0] == kept[2] == kept[3] == set()
    assert kept[4] == kept[5] == set(topology.modules)  # the keep_rounds window
    one_file = len(store.read_bytes(f"modules/round-000001/{topology.modules_of_path(0)[0]}.safetensors"))
    assert state["kept_bytes"] == one_file * len(topology.modules_of_path(0))
