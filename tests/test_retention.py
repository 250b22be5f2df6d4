"""Retention: what pruning deletes and what it keeps (recent versions, best versions' modules, inner
states still named by a task or a path)."""

import torch

from dipaco.config import TopologyConfig
from dipaco.eval.early_stopping import read_best, record_val_losses
from dipaco.islands.coordinator.pruning import prune_keeping_best
from dipaco.model.topology import Topology
from dipaco.store.board import (
    inner_ref,
    inner_states,
    result_exists,
    result_rounds,
    write_inner,
    write_result,
)
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ResultMeta, Task
from dipaco.store.retention import keep_from, prune_inner_states, prune_versions


def fill(store: ModuleStore, topology: Topology, rounds: int) -> None:
    """Module and outer versions 0..rounds, and results 1..rounds of every path."""
    for version in range(rounds + 1):
        for name in topology.modules:
            store.write_module(version, name, {"w": torch.ones(10)})
            store.write_outer_state(version, name, {"w": torch.ones(10)})
        for path in range(topology.n_paths) if version else ():
            task = Task.open(path=path, base=version - 1, step_offset=0, inner_from=None)
            meta = ResultMeta(path=path, round=version, base=version - 1, attempt=0, tokens=1, train_loss=1.0,
                              losses=(1.0,), val_loss_start=1.0, seconds=1.0, bytes_down_modules=0,
                              bytes_down_inner=0, inner_state_local=False, data_parallel_ranks=1)
            write_result(store, task, {"m/w": torch.ones(2)}, meta, compression="none", level=1)


def test_keep_from_counts_back_from_the_round():
    assert keep_from(7, keep_rounds=2) == 6
    assert keep_from(7, keep_rounds=2, at_least=4) == 4
    assert keep_from(7, keep_rounds=0, at_least=4) is None  # 0 keeps everything


def test_old_versions_go_except_the_modules_some_path_needs(tmp_path):
    topology = Topology.from_config(TopologyConfig(levels=[2, 2]), n_layers=2)
    store = ModuleStore(str(tmp_path))
    fill(store, topology, rounds=5)
    keep = {1: set(topology.modules_of_path(0))}
    kept = prune_versions(store, keep_from=4, keep_modules=keep)
    assert store.versions("modules") == [1, 4, 5] and store.versions("outer") == [4, 5]
    assert result_rounds(store) == [4, 5] and not result_exists(store, round=3, path=0, attempt=0)
    present = {v: {m for m in topology.modules if store.has_module(v, m)} for v in range(6)}
    assert present[1] == set(topology.modules_of_path(0))
    assert present[0] == present[2] == present[3] == set()
    assert present[4] == present[5] == set(topology.modules)
    one_file = (tmp_path / "modules" / "round-000001" / f"{topology.modules_of_path(0)[0]}.safetensors").stat().st_size
    assert kept == one_file * len(topology.modules_of_path(0))
    assert prune_versions(store, keep_from=4, keep_modules=keep) == kept  # pruning again changes nothing


def test_pruning_keeps_exactly_the_modules_of_each_paths_best_version(tmp_path):
    """The coordinator's round by round: record the losses the islands report, then prune."""
    topology = Topology.from_config(TopologyConfig(levels=[2, 2]), n_layers=2)
    store = ModuleStore(str(tmp_path / "store"))
    # versions 0..5 of every module; path 0 is best at version 1, the others keep improving
    losses = {0: [9, 5, 6, 7, 8, 8], 1: [9, 8, 7, 6, 5, 4], 2: [9, 8, 7, 6, 5, 4], 3: [9, 8, 7, 6, 5, 4]}
    for version in range(6):
        for name in topology.modules:
            store.write_module(version, name, {"w": torch.ones(10)})
        if version >= 1:  # the islands of round `version` report the losses of version - 1
            record_val_losses(store, {version - 1: {p: losses[p][version - 1] for p in losses}})
            prune_keeping_best(store, topology, keep_from=version - 1)
    record_val_losses(store, {5: {p: losses[p][5] for p in losses}})
    prune_keeping_best(store, topology, keep_from=4)
    state = read_best(store)
    assert {int(p): b["round"] for p, b in state["best"].items()} == {0: 1, 1: 5, 2: 5, 3: 5}
    kept = {v: {name for name in topology.modules if store.has_module(v, name)} for v in range(6)}
    assert kept[1] == set(topology.modules_of_path(0))  # path 0's modules only
    assert kept[0] == kept[2] == kept[3] == set()
    assert kept[4] == kept[5] == set(topology.modules)  # the keep_rounds window
    one_file = len(store.read_bytes(f"modules/round-000001/{topology.modules_of_path(0)[0]}.safetensors"))
    assert state["kept_bytes"] == one_file * len(topology.modules_of_path(0))


def test_old_inner_states_go_unless_a_task_or_path_names_them(tmp_path):
    store = ModuleStore(str(tmp_path))
    refs = {(p, r): inner_ref(path=p, round=r, attempt=0) for p in range(2) for r in range(1, 5)}
    for ref in refs.values():
        write_inner(store, ref, {"w": torch.ones(1)}, {})
    old_but_named = refs[(1, 1)]  # e.g. path 1 has not trained since round 1
    prune_inner_states(store, n_paths=2, keep_from=3, referenced={old_but_named, None})
    assert sorted(r for r, _ in inner_states(store, 0)) == [3, 4]
    assert sorted(r for r, _ in inner_states(store, 1)) == [1, 3, 4]
