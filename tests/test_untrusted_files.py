"""Files an island writes never stop the coordinator (issue 36, item 5).

On main a heartbeat file holding `[]`, a heartbeat whose "island" is 5, or bytes that are not UTF-8 made the
coordinator exit (and every restart, until the file was deleted by hand), and `dipaco status` refused the
run; a result truncated after the coordinator had checked it made the round's outer step raise. Here a
heartbeat file that is not its island's valid heartbeat is ignored with one warning per version of the file
and shown by `dipaco status` as malformed; a received result whose bytes are gone is withdrawn and its task
redone, in sync and in async mode, with the real coordinator and islands on a fake clock (tests/tiny_runs.py).
"""

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import dipaco_in_process
from test_crash_safety import ASYNC, Every, assert_every_version_is_the_outer_step_of_its_record
from tiny_runs import Clock, TinyRun, drive, make_run

from dipaco.store.board import (
    HeartbeatCache,
    ResultChanged,
    ResultReader,
    open_result,
    read_heartbeats,
    read_manifest,
    read_result_meta,
    result_file,
    write_heartbeat,
    write_result,
)
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Heartbeat, ResultMeta, Task, task_key

BEAT = Heartbeat(island="a", incarnation="x1", seq=1, status="idle", task=None, pinned=(), last_path=None,
                 finished=(), time=1.0, failures=0)
# file name -> its bytes: each is something an island (or anyone with write access to heartbeats/) can leave
MALFORMED = {
    "list.json": b"[]",
    "number.json": json.dumps({**replace(BEAT, island="number").to_json(), "island": 5}).encode(),
    "garbage.json": b"\x80\xff\x00 not a heartbeat",
    "nested.json": b"[" * 100_000,
    "spoof.json": json.dumps(replace(BEAT, seq=99).to_json()).encode(),  # island "a"'s heartbeat in another file
}


def heartbeat_dir(store: ModuleStore) -> Path:
    return Path(store.root) / "heartbeats"


def write_malformed(store: ModuleStore) -> None:
    heartbeat_dir(store).mkdir(parents=True, exist_ok=True)
    for name, data in MALFORMED.items():
        (heartbeat_dir(store) / name).write_bytes(data)


def test_a_heartbeat_file_that_is_not_its_islands_valid_heartbeat_is_left_out_by_name(tmp_path):
    store = ModuleStore(str(tmp_path))
    write_heartbeat(store, BEAT)
    write_malformed(store)
    malformed: dict[str, str] = {}
    assert read_heartbeats(store, malformed=malformed) == {"a": BEAT}  # the spoof's seq 99 is not a's
    assert sorted(malformed) == sorted(store.location(f"heartbeats/{name}") for name in MALFORMED)
    for file, reason in malformed.items():
        assert file in reason, reason  # each reason names its file
    assert "expected a JSON object" in malformed[store.location("heartbeats/list.json")]
    assert "'island' should be a string, got 5" in malformed[store.location("heartbeats/number.json")]
    assert "not valid JSON" in malformed[store.location("heartbeats/garbage.json")]
    assert "not valid JSON" in malformed[store.location("heartbeats/nested.json")]
    assert "island 'a' in another island's file" in malformed[store.location("heartbeats/spoof.json")]

    cache = HeartbeatCache()  # a poller reads each version of a file once, a malformed one too
    assert read_heartbeats(store, cache=cache) == {"a": BEAT} and cache.reads == 1 + len(MALFORMED)
    again: dict[str, str] = {}
    assert read_heartbeats(store, cache=cache, malformed=again) == {"a": BEAT} and cache.reads == 1 + len(MALFORMED)
    assert again == malformed  # unchanged files: still reported, not read again
    (heartbeat_dir(store) / "list.json").write_bytes(b"[1, 2]")
    read_heartbeats(store, cache=cache)
    assert cache.reads == 2 + len(MALFORMED) and "got list" in cache.malformed["list.json"][1]
    (heartbeat_dir(store) / "list.json").unlink()
    read_heartbeats(store, cache=cache)
    assert "list.json" not in cache.malformed


@pytest.mark.parametrize("data", [b"\x80\xff garbage", b"[" * 100_000, None], ids=["not utf-8", "nested", "folder"])
def test_a_result_json_that_is_not_json_is_a_store_error_naming_it(tmp_path, data):
    """The checks turn a StoreError into a rejection (test_acceptance.py); any other error stopped the coordinator."""
    store = ModuleStore(str(tmp_path))
    target = Path(store.root) / result_file(round=1, path=0, attempt=0)
    target.parent.mkdir(parents=True)
    if data is None:
        target.mkdir()  # a folder where the result's JSON should be
    else:
        target.write_bytes(data)
    with pytest.raises(StoreError, match=r"path-0000\.json (is not valid JSON|is a folder)"):
        read_result_meta(store, round=1, path=0, attempt=0)


def stored_result(tmp_path: Path) -> tuple[ModuleStore, ResultMeta, Path]:
    """A two-module int8 result in a fresh store, and the file holding its pseudo-gradient."""
    store = ModuleStore(str(tmp_path))
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    meta = ResultMeta(path=0, round=1, base=0, attempt=0, tokens=8, train_loss=1.0, losses=(1.0,), val_loss_start=1.0,
                      seconds=1.0, bytes_down_modules=0, bytes_down_inner=0, inner_state_local=False,
                      data_parallel_ranks=1)
    tensors = {"a/w": torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), "b/w": torch.ones(16)}
    meta, _ = write_result(store, task, tensors, meta, compression="int8", level=1)
    return store, meta, Path(store.root) / "results" / "round-000001" / meta.file


@pytest.mark.parametrize("damage", ["cut in the last module", "cut in the header", "emptied", "removed"])
def test_a_checked_result_whose_bytes_are_gone_is_a_changed_result(tmp_path, damage):
    """With the digests its checks took, a reader that cannot read the checked bytes any more raises
    `ResultChanged` (the coordinator redoes the result); without them, the plain StoreError naming the file."""
    store, meta, file = stored_result(tmp_path)
    digests = open_result(store, meta).digests
    data = file.read_bytes()
    if damage == "removed":
        file.unlink()
    else:
        file.write_bytes({"cut in the last module": data[:-10], "cut in the header": data[:20], "emptied": b""}[damage])
    with pytest.raises(ResultChanged, match=rf"{meta.file} changed after it was checked") as changed:
        reader = ResultReader(store, meta, digests=digests)
        for module in ("a", "b"):
            reader.module(module)
    assert changed.value.key == (1, 0, 0, 0)  # (round, path, link, attempt): the task the coordinator redoes
    with pytest.raises(StoreError, match=meta.file) as plain:
        reader = ResultReader(store, meta)
        for module in ("a", "b"):
            reader.module(module)
    assert not isinstance(plain.value, ResultChanged)


def test_a_malformed_heartbeat_leaves_the_coordinator_and_dipaco_status_running(tiny_routed, tmp_path, caplog,
                                                                                   capsys):
    """Malformed heartbeat files are there before the coordinator starts and one is rewritten (still malformed)
    while it runs: the run finishes, each version of each file is warned about once (not every tick), and
    `dipaco status` lists the files as malformed beside the one real island."""
    run = make_run(tiny_routed, tmp_path / "run", ["run.rounds=1"])
    write_malformed(run.store)
    clock = Clock()
    coordinator, island = run.coordinator(clock), run.island("a", clock)
    caplog.set_level(logging.WARNING, logger="dipaco.islands.coordinator.heartbeats")
    for _ in range(3):  # a few ticks with every file malformed
        coordinator.tick()
        island.poll()
        clock.t += 0.5
    (heartbeat_dir(run.store) / "list.json").write_bytes(b"[1]")  # a new version of one of them
    drive(coordinator, [island], clock)
    assert coordinator.done and coordinator.committed == 1
    warned = [r.getMessage() for r in caplog.records if "ignored a heartbeat" in r.getMessage()]
    for name in MALFORMED:
        assert sum(f"heartbeats/{name}" in message for message in warned) == (2 if name == "list.json" else 1), warned
    assert set(coordinator.seen) == {"a"}

    capsys.readouterr()
    code, log = dipaco_in_process("status", "--run", run.dir.root, "--json")
    assert code == 0, log
    status = json.loads(capsys.readouterr().out)
    assert [i["island"] for i in status["islands"]] == ["a"]
    assert sorted(Path(m["file"]).name for m in status["malformed_heartbeats"]) == sorted(MALFORMED)
    code, log = dipaco_in_process("status", "--run", run.dir.root)
    text = capsys.readouterr().out
    assert code == 0, log
    shown = [line for line in text.splitlines() if line.startswith("malformed heartbeat, ignored: ")]
    assert sorted(next(n for n in MALFORMED if f"heartbeats/{n}" in line) for line in shown) == sorted(MALFORMED)


def truncate_on_receipt(run: TinyRun, coordinator, key: str) -> list[Path]:
    """Cut the last 100 bytes of `key`'s result file in the tick that receives it, before that tick can close
    the round (after the checks read it: an island, or anyone, rewriting it meanwhile); returns the files cut."""
    receive, cut = coordinator.intake.receive, []

    def receive_then_truncate(board, policy):
        receive(board, policy)
        task = board.tasks.get(key)
        if not cut and task is not None and task.status == "received":
            meta = read_result_meta(run.store, round=task.round, path=task.path, attempt=task.result_attempt)
            file = Path(run.store.root) / result_file(round=task.round, path=task.path, attempt=task.result_attempt,
                                                      compression=meta.compression)
            file.write_bytes(file.read_bytes()[:-100])
            cut.append(file)

    coordinator.intake.receive = receive_then_truncate
    return cut


def test_a_sync_result_truncated_after_its_receipt_is_redone_and_the_run_equals_an_undisturbed_one(
        tiny_routed, tiny_straight, tmp_path, caplog):
    run = make_run(tiny_routed, tmp_path / "run", [])
    clock = Clock()
    coordinator = run.coordinator(clock)
    cut = truncate_on_receipt(run, coordinator, task_key(1, 0))
    caplog.set_level(logging.WARNING, logger="dipaco.islands.coordinator.intake")
    drive(coordinator, [run.island(f"i{k}", clock) for k in range(2)], clock)
    assert len(cut) == 1 and any(cut[0].name in r.getMessage() and "the path redoes it" in r.getMessage()
                                 for r in caplog.records)
    (entry,) = [e for e in read_manifest(run.store, 1).applied if e.path == 1]
    assert (entry.key, entry.attempt) == (task_key(1, 0), 1)  # the same task, redone as its next attempt
    rounds = run.config.run.rounds
    for name in run.topology.modules:  # sync, fixed seeds: the same modules as the run nobody disturbed
        for param, value in run.store.read_module(rounds, name).items():
            assert torch.equal(value, tiny_straight.store.read_module(rounds, name)[param]), (name, param)


def test_an_async_result_truncated_after_its_receipt_is_redone_and_every_version_is_its_manifests_step(
        tiny_routed, tmp_path, caplog):
    clock = Clock()
    run = make_run(tiny_routed, tmp_path / "run", ASYNC)
    coordinator = run.coordinator(clock)
    cut = truncate_on_receipt(run, coordinator, task_key(1, 0))
    caplog.set_level(logging.WARNING, logger="dipaco.islands.coordinator.intake")
    islands = [run.island("i0", clock, pinned=[0]), *(Every(3, run.island(f"i{k}", clock, pinned=[k])) for k in (1, 2, 3))]
    drive(coordinator, islands, clock)
    assert len(cut) == 1 and any(cut[0].name in r.getMessage() and "the path redoes it" in r.getMessage()
                                 for r in caplog.records)
    applied = [e for t in range(1, coordinator.committed + 1) for e in read_manifest(run.store, t).applied]
    assert not [e for e in applied if (e.key, e.attempt) == (task_key(1, 0), 0)]  # the cut bytes never applied
    assert_every_version_is_the_outer_step_of_its_record(run)  # and every path's planned steps applied once
