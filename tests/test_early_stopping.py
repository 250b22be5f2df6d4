"""Per-path early stopping: the best version is the lowest validation loss, recorded in the store."""

import math

from dipaco.config import TopologyConfig
from dipaco.eval.early_stopping import (
    best_rounds,
    needed_modules,
    read_best,
    read_history,
    record_kept_bytes,
    record_val_losses,
)
from dipaco.model.topology import Topology
from dipaco.store.module_store import ModuleStore


def test_best_round_is_the_lowest_validation_loss_earliest_on_ties():
    history = {0: {0: 9.0, 1: 7.0, 2: 7.5, 3: 8.0}, 1: {0: 9.0, 1: 6.0, 2: 5.0, 3: 4.0},
               2: {0: 5.0, 1: 5.0, 2: 6.0}, 3: {0: math.nan, 1: 8.0}}
    assert best_rounds(history) == {0: 1, 1: 3, 2: 0, 3: 1}


def test_recording_adds_to_the_history_and_keeps_the_kept_bytes(tmp_path):
    store = ModuleStore(str(tmp_path))
    assert read_best(store) == {} and read_history(store) == {}
    record_val_losses(store, {0: {0: 9.0, 1: 8.0}})
    record_kept_bytes(store, 1234)
    state = record_val_losses(store, {1: {0: 7.0, 1: 8.5}, 2: {1: 8.0}})
    assert read_history(store) == {0: {0: 9.0, 1: 7.0}, 1: {0: 8.0, 1: 8.5, 2: 8.0}}
    assert state == read_best(store)
    assert state["best"] == {"0": {"round": 1, "val_loss": 7.0}, "1": {"round": 0, "val_loss": 8.0}}
    assert state["kept_bytes"] == 1234


def test_a_best_version_needs_the_modules_of_its_path_once():
    topology = Topology.from_config(TopologyConfig(levels=[2, 2]), n_layers=2)
    needed = needed_modules(topology, {0: 1, 1: 1, 3: 4})
    assert needed == {1: set(topology.modules_of_path(0)) | set(topology.modules_of_path(1)),
                      4: set(topology.modules_of_path(3))}
