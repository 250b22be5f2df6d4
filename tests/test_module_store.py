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


def test_results_and_inner_state(tmp_path):
    store = ModuleStore(str(tmp_path))
    assert not store.has_result(1, 2)
    sent = store.write_result(1, 2, {"m/w": torch.ones(2)}, {"tokens": 10})
    tensors, meta = store.read_result(1, 2)
    assert store.has_result(1, 2) and meta["tokens"] == 10 and meta["bytes"] == sent > 0
    store.write_tensors_with_meta("islands/path-0002/inner.safetensors", {"w.exp_avg": torch.full((2,), 2.0)},
                                  {"round": 2})
    tensors, meta = store.read_tensors_with_meta("islands/path-0002/inner.safetensors")
    assert meta == {"round": 2} and tensors["w.exp_avg"][0] == 2.0
    store.write_tensors("plain.safetensors", {"w": torch.ones(1)})
    with pytest.raises(StoreError, match="plain.safetensors has no valid metadata"):
        store.read_tensors_with_meta("plain.safetensors")


def test_prune_keeps_recent_rounds(tmp_path):
    store = ModuleStore(str(tmp_path))
    for round in range(4):
        store.write_module(round, "m", {"w": torch.ones(1)})
    store.prune(keep_from=2)
    assert sorted(p.name for p in (tmp_path / "modules").iterdir()) == ["round-000002", "round-000003"]
