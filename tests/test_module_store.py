"""The module store: atomic writes, safetensors round trips, commits, pruning, clear errors."""

import pytest
import torch

from dipaco.store.module_store import ModuleStore, StoreError


def test_module_round_trip_and_commit(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    assert store.state() is None
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.float32)}
    store.write_module(0, "level0.module1", tensors)
    store.commit(round=0, levels=[2, 2])
    back = store.read_module(0, "level0.module1")
    for k in tensors:
        assert torch.equal(back[k], tensors[k])
    assert store.current_round() == 0 and store.state()["levels"] == [2, 2]
    assert not list((tmp_path / "store").rglob("*.tmp-*")), "temporary files must be renamed away"


def test_file_url_works(tmp_path):
    store = ModuleStore(f"file://{tmp_path}/s")
    store.write_json("x.json", {"k": 1})
    assert store.read_json("x.json") == {"k": 1}


def test_missing_and_corrupt_files_name_the_file(tmp_path):
    store = ModuleStore(str(tmp_path))
    with pytest.raises(StoreError, match="modules/round-000003/m.safetensors"):
        store.read_module(3, "m")
    (tmp_path / "modules" / "round-000001").mkdir(parents=True)
    (tmp_path / "modules" / "round-000001" / "m.safetensors").write_bytes(b"garbage")
    with pytest.raises(StoreError, match="m.safetensors"):
        store.read_module(1, "m")
    store.write_json("state.json", {"store_version": 99, "round": 0})
    with pytest.raises(StoreError, match="store_version 99"):
        store.state()


def test_tensors_with_metadata_in_one_file(tmp_path):
    store = ModuleStore(str(tmp_path))
    store.write_tensors_with_meta("islands/path-0002/inner.safetensors", {"w.exp_avg": torch.full((2,), 2.0)},
                                  {"round": 2})
    tensors, meta = store.read_tensors_with_meta("islands/path-0002/inner.safetensors")
    assert meta == {"round": 2} and tensors["w.exp_avg"][0] == 2.0
    store.write_tensors("plain.safetensors", {"w": torch.ones(1)})
    with pytest.raises(StoreError, match="plain.safetensors has no valid metadata"):
        store.read_tensors_with_meta("plain.safetensors")


def test_versions_are_listed_and_pruned_by_round(tmp_path):
    store = ModuleStore(str(tmp_path))
    for round in (3, 0, 12):
        store.write_module(round, "a", {"w": torch.ones(4)})
        store.write_module(round, "b", {"w": torch.ones(1)})
    store.write_outer_state(3, "a", {"w": torch.ones(1)})
    assert store.versions("modules") == [0, 3, 12] and store.versions("outer") == [3]
    assert store.has_module(3, "a") and not store.has_module(4, "a")
    kept = store.prune_version("modules", 3, keep={"a"})
    assert kept == (tmp_path / "modules" / "round-000003" / "a.safetensors").stat().st_size
    assert store.has_module(3, "a") and not store.has_module(3, "b")
    assert store.prune_version("modules", 0) == 0 and store.versions("modules") == [3, 12]
    with pytest.raises(ValueError, match="not 'results'"):
        store.versions("results")
