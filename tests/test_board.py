"""The task board's files: results (uploaded, then committed by their metadata), heartbeats, manifests,
inner states — written and read back as typed records."""

import json
from dataclasses import replace

import pytest
import torch

from dipaco.store.board import (
    HeartbeatCache,
    all_inner_states,
    inner_ref,
    inner_states,
    read_heartbeats,
    read_manifest,
    read_result,
    read_result_meta,
    reported_results,
    result_exists,
    result_rounds,
    write_heartbeat,
    write_inner,
    write_manifest,
    write_result,
)
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Heartbeat, ManifestEntry, ResultMeta, RoundManifest, Task


def result_meta(task: Task, **fields) -> ResultMeta:
    values = dict(path=task.path, round=task.round, base=task.base, attempt=task.attempt, tokens=10, train_loss=2.5,
                  losses=(3.0, 2.0), val_loss_start=3.5, seconds=1.5, bytes_down_modules=100, bytes_down_inner=0,
                  inner_state_local=False, data_parallel_ranks=1)
    return ResultMeta(**{**values, **fields})


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_result_round_trips_with_its_metadata(tmp_path, compression):
    store = ModuleStore(str(tmp_path))
    task = replace(Task.open(path=2, base=0, step_offset=0, inner_from=None), attempt=1)
    delta = {"m/w": torch.linspace(-1, 1, 8).reshape(2, 4)}
    assert not result_exists(store, round=1, path=2, attempt=1)
    written, stats = write_result(store, task, delta, result_meta(task, island="x"), compression=compression, level=1)
    assert result_exists(store, round=1, path=2, attempt=1) and not result_exists(store, round=1, path=2, attempt=0)
    assert written.bytes == stats["bytes"] > 0 and written.compression == compression and written.island == "x"
    tensors, meta = read_result(store, round=1, path=2, attempt=1)
    assert meta == written == read_result_meta(store, round=1, path=2, attempt=1)
    atol = 0 if compression == "none" else 1 / 127
    torch.testing.assert_close(tensors["m/w"], delta["m/w"], rtol=0, atol=atol)
    assert result_rounds(store) == [1]


def test_a_result_with_bad_metadata_is_refused_naming_the_file(tmp_path):
    store = ModuleStore(str(tmp_path))
    task = Task.open(path=0, base=2, step_offset=0, inner_from=None)
    write_result(store, task, {"m/w": torch.ones(2)}, result_meta(task), compression="none", level=1)
    meta_file = tmp_path / "results" / "round-000003" / "path-0000.json"
    obj = json.loads(meta_file.read_text())
    del obj["tokens"]
    meta_file.write_text(json.dumps(obj))
    with pytest.raises(StoreError, match=r"path-0000\.json: missing field 'tokens'"):
        read_result(store, round=3, path=0, attempt=0)


def test_heartbeats_and_manifests_round_trip(tmp_path):
    store = ModuleStore(str(tmp_path))
    beat = Heartbeat(island="a", incarnation="x1", seq=3, status="idle", task=None, pinned=(1, 2), last_path=None,
                     finished=("path-0001-round-000001#0",), time=1.0, failures=0)
    write_heartbeat(store, beat)
    (tmp_path / "heartbeats" / "b.json.tmp-1234").write_text("{")  # a write in progress is not a heartbeat
    assert read_heartbeats(store) == {"a": beat}
    entry = ManifestEntry(key="path-0001-round-000001", path=1, base=0, attempt=0, staleness=0, tokens=5,
                          seconds=1.0, bytes=9, train_loss=1.0, val_loss_start=float("nan"), factor=1.0)
    manifest = RoundManifest(round=1, applied=(entry,), dropped=(replace(entry, factor=None),))
    write_manifest(store, manifest)
    back = read_manifest(store, 1)
    assert back.applied[0].factor == 1.0 and back.dropped[0].factor is None and back.keys == {entry.key}
    assert read_manifest(store, 2) is None


def test_inner_states_are_listed_by_round(tmp_path):
    store = ModuleStore(str(tmp_path))
    refs = [inner_ref(path=1, round=r, attempt=a) for r, a in ((2, 0), (3, 1), (10, 0))]
    for ref in refs:
        write_inner(store, ref, {"w.exp_avg": torch.ones(1)}, {"step": 1})
    assert sorted(inner_states(store, 1)) == [(2, refs[0]), (3, refs[1]), (10, refs[2])]
    assert inner_states(store, 0) == []


def test_one_listing_says_which_results_are_in_as_result_exists_does(tmp_path):
    store = ModuleStore(str(tmp_path))
    folder = tmp_path / "results" / "round-000002"
    folder.mkdir(parents=True)
    for name in ("path-0003.json", "path-0003.a2.json", "path-0010.a1.json", "path-0004.safetensors",
                 "path-0003.l1.json", "path-0003.l2.a1.json", "path-0004.a1.l1.json", "path-0007.l.json",
                 "path-0005.json.tmp-1a2b3c4d", "path-3.json", "path-0006.ax.json", "notes.json"):
        (folder / name).write_text("{}")
    reported = reported_results(store, 2)
    assert reported == {(3, 0): {0, 2}, (10, 0): {1}, (3, 1): {0}, (3, 2): {1}}  # links come before attempts
    for path in range(12):
        for link in range(3):
            for attempt in range(3):
                assert (attempt in reported.get((path, link), set())) == result_exists(
                    store, round=2, path=path, attempt=attempt, link=link)
    assert reported_results(store, 7) == {}  # no folder yet


def test_a_heartbeat_unchanged_since_the_last_poll_is_not_read_again(tmp_path):
    store = ModuleStore(str(tmp_path))
    beat = Heartbeat(island="a", incarnation="x1", seq=1, status="idle", task=None, pinned=(), last_path=None,
                     finished=(), time=1.0, failures=0)
    write_heartbeat(store, beat)
    write_heartbeat(store, replace(beat, island="b"))
    cache = HeartbeatCache()
    assert read_heartbeats(store, cache=cache) == {"a": beat, "b": replace(beat, island="b")} and cache.reads == 2
    assert read_heartbeats(store, cache=cache) == read_heartbeats(store) and cache.reads == 2  # nothing re-read
    newer = replace(beat, seq=2)  # the same size: the stamp's mtime / inode still change
    write_heartbeat(store, newer)
    assert read_heartbeats(store, cache=cache)["a"] == newer and cache.reads == 3
    (tmp_path / "heartbeats" / "b.json").unlink()
    assert read_heartbeats(store, cache=cache) == {"a": newer} and set(cache.beats) == {"a.json"}


def test_a_memory_store_heartbeat_rewritten_is_read_again():
    store = ModuleStore("memory://bench-beats")
    beat = Heartbeat(island="a", incarnation="x1", seq=1, status="idle", task=None, pinned=(), last_path=None,
                     finished=(), time=1.0, failures=0)
    write_heartbeat(store, beat)
    cache = HeartbeatCache()
    read_heartbeats(store, cache=cache)
    write_heartbeat(store, replace(beat, seq=2))
    assert read_heartbeats(store, cache=cache)["a"].seq == 2
    store.remove("heartbeats")


def test_every_paths_inner_states_come_from_one_listing(tmp_path):
    store = ModuleStore(str(tmp_path))
    refs = [inner_ref(path=p, round=r, attempt=a) for p, r, a in ((1, 2, 0), (1, 3, 1), (12, 10, 0))]
    for ref in refs:
        write_inner(store, ref, {"w.exp_avg": torch.ones(1)}, {"step": 1})
    (tmp_path / "islands" / "path-0001" / "notes.txt").write_text("x")
    states = all_inner_states(store)
    assert {p: sorted(s) for p, s in states.items()} == {p: sorted(inner_states(store, p)) for p in (1, 12)}
    assert all_inner_states(ModuleStore(str(tmp_path / "empty"))) == {}
