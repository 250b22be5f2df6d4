"""`faults.store_bandwidth`: a store client with a bandwidth limit takes bytes / bandwidth seconds per transfer
(measured around real store writes and reads), each way, a concurrent small one not queued behind a large one,
and counts what it did unlimited."""

from __future__ import annotations

import os
import threading
import time

import pytest
from tiny_runs import Clock, drive, make_run

from dipaco.store.bandwidth import BandwidthLimit
from dipaco.store.files import StoreFiles

RATE = 2_000_000.0  # bytes per second: 400 KB take 0.2 s


def test_a_limited_store_takes_bytes_over_bandwidth_and_counts_the_same(tmp_path):
    data = os.urandom(400_000)
    free, limited = StoreFiles(str(tmp_path / "free")), StoreFiles(str(tmp_path / "limited"))
    limited.limit_bandwidth(RATE)
    started = time.monotonic()
    limited.write_bytes("modules/round-000001/block.safetensors", data)
    wrote = time.monotonic() - started
    started = time.monotonic()
    assert limited.read_bytes("modules/round-000001/block.safetensors") == data
    read = time.monotonic() - started
    assert wrote >= len(data) / RATE and read >= len(data) / RATE  # each way takes N / bandwidth
    free.write_bytes("modules/round-000001/block.safetensors", data)
    free.read_bytes("modules/round-000001/block.safetensors")
    assert limited.traffic.counts() == free.traffic.counts()  # pacing changes no count
    on_disk = os.stat(tmp_path / "limited" / "modules" / "round-000001" / "block.safetensors").st_size
    assert limited.traffic.counts().bytes("up", "module") == on_disk == len(data)
    assert limited.traffic.counts().bytes("down", "module") == on_disk


def test_each_transfer_takes_its_bytes_over_bandwidth_and_a_concurrent_one_is_not_queued(tmp_path):
    slept = []
    limit = BandwidthLimit(1000.0, sleep=slept.append)
    assert [limit.take("up", 500), limit.take("down", 250), limit.take("up", 0)] == pytest.approx([0.5, 0.25, 0.0])
    assert slept == pytest.approx([0.5, 0.25]) and limit.waited == pytest.approx(0.75)
    with pytest.raises(ValueError, match="-1"):
        BandwidthLimit(-1)
    store = StoreFiles(str(tmp_path))  # a heartbeat written during a long upload passes at its own rate
    store.limit_bandwidth(RATE)
    upload = threading.Thread(target=store.write_bytes, args=("results/round-000001/path-0000.none.safetensors",
                                                                b"x" * 600_000))  # 0.3 s
    upload.start()
    time.sleep(0.02)
    started = time.monotonic()
    store.write_bytes("heartbeats/island-0.json", b"{}" * 100)
    beat = time.monotonic() - started
    upload.join()
    assert beat < 0.15  # not behind the upload's remaining 0.28 s


def test_a_tiny_run_under_a_limit_trains_to_the_end_with_every_counted_byte_paced(tiny_routed, tmp_path):
    run = make_run(tiny_routed, tmp_path / "run", ["run.rounds=1", "faults.store_bandwidth=1e9"])  # island_setup's store
    limit = run.store.traffic.limit
    assert limit is not None and limit.bytes_per_second == 1e9
    clock = Clock()
    drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(2)], clock)
    assert run.store.current_round() == 1
    moved = run.store.traffic.counts().bytes()  # in one process the coordinator shares the islands' client
    assert moved > 0 and limit.waited == pytest.approx(moved / 1e9)
    unlimited = make_run(tiny_routed, tmp_path / "free", ["run.rounds=1"])
    assert unlimited.store.traffic.limit is None
