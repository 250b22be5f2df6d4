"""Every byte at the store boundary is counted: the store clients' counts against the bytes Python's `open`
moved to and from the store's files (measured here, apart from the store's code), for a tiny sync and async
run; the islands' published counts collected by the coordinator, across a coordinator restart; malformed
reports ignored by name; an unchanged board read for no bytes."""

import builtins
import dataclasses
import logging
import os
import time

import fsspec
import pytest
from tiny_runs import Clock, drive, make_run

from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.islands.island.polling import IslandWorker
from dipaco.pipeline.context import PathFactory
from dipaco.store import board as board_mod
from dipaco.store.board import read_board, read_manifest, write_board
from dipaco.store.lease import LEASE_FILE
from dipaco.store.ledger import Ledger, publish_counts, report_file
from dipaco.store.module_store import BEST_FILE, ModuleStore
from dipaco.store.publish import PUBLISHED, object_name
from dipaco.store.records import Board
from dipaco.store.traffic import KINDS, ByteCounts, kind_of

ASYNC = ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0", "rounds.max_staleness=2"]


class Metered:
    """A file opened under the store's root: the bytes read through it, and its size (os.fstat) when it was
    opened for writing and is closed."""

    def __init__(self, f, meter: "FileMeter", writing: bool):
        self._f, self._meter, self._writing = f, meter, writing

    def read(self, *args):
        data = self._f.read(*args)
        self._meter.read += len(data)
        return data

    def readinto(self, buffer):
        n = self._f.readinto(buffer)
        self._meter.read += n or 0
        return n

    def close(self):
        if self._writing and not self._f.closed:
            self._f.flush()
            self._meter.written += os.fstat(self._f.fileno()).st_size
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


class FileMeter:
    """Bytes read from and written to files under `root`, at Python's `open` (the store's code not involved)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root) + os.sep
        self.read = self.written = 0

    def install(self, monkeypatch) -> None:
        real = builtins.open

        def metered_open(file, mode="r", *args, **kwargs):
            f = real(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(self.root):
                return Metered(f, self, writing=any(c in mode for c in "wax+"))
            return f

        monkeypatch.setattr(builtins, "open", metered_open)


def _clients(run, clock, islands: int):
    """A coordinator and `islands` islands, each with its own store client (its own counts)."""
    url = str(run.dir.store)
    coordinator = Coordinator(ModuleStore(url), run.topology, settings=CoordinatorSettings.from_config(run.config),
                              sizes=PathFactory(run.config, run.dir).path_sizes, clock=clock)
    workers = [IslandWorker(dataclasses.replace(run.setup, store=ModuleStore(url)), name=f"i{k}", clock=clock)
               for k in range(islands)]
    return coordinator, workers


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_counts_equal_the_bytes_of_the_files_written_and_read(tiny_routed, tmp_path, monkeypatch, mode):
    run = make_run(tiny_routed, tmp_path / "run", ["run.rounds=1", *(ASYNC if mode == "async" else [])])
    meter = FileMeter(str(run.dir.store))
    meter.install(monkeypatch)  # after version 0 was written: the clients below start at zero, as the meter does
    clock = Clock()
    coordinator, islands = _clients(run, clock, 2)
    drive(coordinator, islands, clock)
    for island in islands:
        island.report_traffic()
    coordinator.report_traffic()
    counts = [c.store.traffic.counts() for c in (coordinator, *islands)]
    total = ByteCounts.total(counts)
    assert total.bytes("up") == meter.written > 0
    assert total.bytes("down") == meter.read > 0
    assert total.bytes(kind="other") == 0  # every store name has its kind
    assert sum(total.bytes(d, k) for d in ("up", "down") for k in KINDS) == total.bytes()
    manifest = read_manifest(run.store, 1)
    sent = sum(e.bytes for e in manifest.applied)
    pseudo_gradients = sum(c.store.traffic.counts().bytes("up", "pseudo_gradient") for c in islands)
    if mode == "sync":  # every result applied
        assert pseudo_gradients == sent
    else:
        assert pseudo_gradients >= sent
    assert coordinator.store.traffic.counts().bytes("up", "pseudo_gradient") == 0  # only islands upload results
    assert total.bytes("down", "module") > 0 and total.bytes("up", "inner_state") > 0


def test_a_carried_state_that_stays_on_its_island_moves_no_inner_state_bytes(tiny_routed, tmp_path, monkeypatch):
    """One island per path for 3 rounds, a checkpoint every 2 tasks: the counts still equal the bytes `open`
    moved, the inner-state bytes up are the sizes (os.stat) of the carried-state files the islands wrote
    (rounds 2 and 3: a checkpoint, the last task) and each result's `bytes_up_inner`; no island reads one, the
    coordinator reads each once (its check, `acceptance`)."""
    run = make_run(tiny_routed, tmp_path / "run", ["run.rounds=3", "resilience.inner_checkpoint_every=2",
                                                   "store.keep_versions=0"])
    islands_dir = run.dir.store / "islands"
    before = {f for f in islands_dir.rglob("*") if f.is_file()} if islands_dir.exists() else set()
    meter = FileMeter(str(run.dir.store))
    meter.install(monkeypatch)
    clock = Clock()
    coordinator, islands = _clients(run, clock, run.topology.n_paths)
    drive(coordinator, islands, clock)
    total = ByteCounts.total([c.store.traffic.counts() for c in (coordinator, *islands)])
    assert total.bytes("up") == meter.written and total.bytes("down") == meter.read
    written = sorted(f for f in islands_dir.rglob("*") if f.is_file() and f not in before)
    assert len(written) == 2 * run.topology.n_paths  # rounds 2 and 3 of each path
    assert total.bytes("up", "inner_state") == sum(f.stat().st_size for f in written) > 0
    # every task continued its path's state from memory; the coordinator read each uploaded one once to check it
    assert total.bytes("down", "inner_state") == total.bytes("up", "inner_state")
    assert coordinator.store.traffic.counts().bytes("down", "inner_state") == total.bytes("up", "inner_state")
    metas = [board_mod.read_result_meta(run.store, round=r, path=p, attempt=0)
             for r in (1, 2, 3) for p in range(run.topology.n_paths)]
    assert sum(m.bytes_up_inner for m in metas) == total.bytes("up", "inner_state")
    assert all(m.bytes_down_inner == 0 for m in metas)


def test_the_coordinator_collects_every_session_across_a_restart(tiny_routed, tmp_path):
    run = make_run(tiny_routed, tmp_path / "run", [])
    clock = Clock()
    first, islands = _clients(run, clock, 2)
    drive(first, islands, clock, until_round=1)
    first_counts = first.store.traffic.counts()
    first.report_traffic()  # then it is gone (a crash: no release)
    second, _ = _clients(run, clock, 0)
    drive(second, islands, clock)
    island_counts = {}
    for island in islands:
        island_counts[island.name] = island.store.traffic.counts()  # what its last report holds
        island.report_traffic()
    second_counts = second.store.traffic.counts()
    traffic = second.report_traffic()
    coordinator = traffic["by_owner"]["coordinator"]
    assert coordinator["sessions"] == 2
    both = first_counts + second_counts
    assert (coordinator["up_bytes"], coordinator["down_bytes"]) == (both.bytes("up"), both.bytes("down"))
    for name, counts in island_counts.items():
        assert traffic["by_owner"][name]["up_bytes"] == counts.bytes("up")
        assert traffic["by_owner"][name]["down_requests"] == counts.requests("down")
    everything = ByteCounts.total([both, *island_counts.values()])
    assert traffic["up_bytes"] == everything.bytes("up") and traffic["down_bytes"] == everything.bytes("down")
    islands_total = ByteCounts.total(island_counts.values())
    assert traffic["by_role"]["island"] == islands_total.to_json()
    assert traffic["by_role"]["coordinator"] == both.to_json()
    kinds = traffic["by_kind"]
    assert sum(cell["bytes"] for cell in kinds["up"].values()) == traffic["up_bytes"]
    assert sum(cell["requests"] for cell in kinds["down"].values()) == traffic["down_requests"]


def test_malformed_reports_are_ignored_by_name(tmp_path, caplog):
    store = ModuleStore(str(tmp_path / "store"))
    store.write_bytes("tasks.json", b"{}")
    good = publish_counts(store, owner="island-0", role="island")
    session = "0123456789ab"
    valid = {"schema": 1, "owner": "island-1", "role": "island", "session": session, "time": 1.0,
             "counts": {"up": {"pseudo_gradient": {"bytes": 10, "requests": 1}}, "down": {}}}
    bad = {
        "negative": {**valid, "counts": {"up": {"board": {"bytes": -5, "requests": 1}}}},
        "kind": {**valid, "counts": {"up": {"everything": {"bytes": 5, "requests": 1}}}},
        "float": {**valid, "counts": {"down": {"board": {"bytes": 1.5, "requests": 1}}}},
        "owner": {**valid, "owner": "island-9"},
        "schema": {**valid, "schema": 7},
        "role": {**valid, "role": "king"},
    }
    for i, obj in enumerate(bad.values()):
        sess = f"{i:012x}"
        store.write_json(f"traffic/island-1.{sess}.json", {**obj, "session": sess})
    store.write_bytes(f"traffic/island-2.{session}.json", b"not json")
    with caplog.at_level(logging.WARNING, logger="dipaco.store.ledger"):
        ledger = Ledger()
        ledger.read(store)
    summary = ledger.summary()
    assert summary["ignored"] == sorted([f"island-1.{i:012x}.json" for i in range(len(bad))]
                                        + [f"island-2.{session}.json"])
    assert summary["up_bytes"] == good.bytes("up") and summary["down_bytes"] == good.bytes("down")
    assert list(summary["by_owner"]) == ["island-0"]
    for name in summary["ignored"]:
        assert name in caplog.text
    store.write_json(report_file("island-1", session), valid)  # a valid report is taken
    ledger.read(store)
    assert ledger.summary()["by_owner"]["island-1"]["up_bytes"] == 10


def test_every_store_name_has_its_kind():
    expected = {
        board_mod.result_file(round=2, path=1, attempt=1, compression="int8"): "pseudo_gradient",
        board_mod.result_file(round=2, path=1, attempt=0): "manifests",
        board_mod.inner_ref(path=3, round=2, attempt=0): "inner_state",
        board_mod.warm_start_inner_ref(): "inner_state",
        board_mod._heartbeat_file("island-0"): "heartbeats",
        "rounds/round-000004.json": "manifests",
        "rounds/round-000004.t2.json": "manifests",  # staged under a lease token (fenced commits)
        board_mod.TASKS: "board",
        "state.json": "board",
        LEASE_FILE: "board",
        BEST_FILE: "manifests",
        "modules/round-000003/embeddings.safetensors": "module",
        "modules/round-000003/checksums.json": "manifests",
        "modules/round-000003.t2/embeddings.safetensors": "module",
        "modules/round-000003.t2/checksums.json": "manifests",
        "outer/round-000003/embeddings.safetensors": "outer_state",
        PUBLISHED: "inputs",
        object_name("ab" * 32): "inputs",
        report_file("island-0", "0123456789ab"): "heartbeats",
        "somewhere/else.bin": "other",
    }
    assert {name: kind_of(name) for name in expected} == expected


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_unchanged_board_costs_no_bytes(tmp_path, request, where):
    """An island polling tasks.json reads it again only when it changed: one stamp request (a stat, an S3 HEAD)
    and no bytes otherwise; the sizes come from fsspec itself, not from the store's counts."""
    if where == "s3":
        from s3_server import BUCKET

        request.getfixturevalue("s3_env")
        url = f"s3://{BUCKET}/fresh-{time.time_ns()}"
    else:
        url = str(tmp_path / "s")
    coordinator_store, island_store = ModuleStore(url), ModuleStore(url)
    assert read_board(island_store) is None
    write_board(coordinator_store, Board(round=0, tasks={}, paths={}))
    size = fsspec.core.url_to_fs(url)[0].size(coordinator_store.location("tasks.json"))
    before = island_store.traffic.counts()
    assert read_board(island_store).round == 0
    first = island_store.traffic.counts() - before
    assert (first.bytes("down", "board"), first.requests("down", "board")) == (size, 2)  # a stamp, then the file
    for _ in range(3):
        again = island_store.traffic.counts()
        assert read_board(island_store).round == 0
        unchanged = island_store.traffic.counts() - again
        assert (unchanged.bytes(), unchanged.requests()) == (0, 1)  # one stamp request, no bytes
    write_board(coordinator_store, Board(round=1, tasks={}, paths={}))
    again = island_store.traffic.counts()
    assert read_board(island_store).round == 1  # a changed board is read again
    size = fsspec.core.url_to_fs(url)[0].size(coordinator_store.location("tasks.json"))
    assert (island_store.traffic.counts() - again).bytes("down", "board") == size
