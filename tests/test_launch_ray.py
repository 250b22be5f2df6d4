"""`dipaco train launcher.kind=ray` on a local Ray instance: the tiny config to completion, with the
coordinator and two islands as Ray tasks, and one island killed mid-run (Ray places it again).

Ray comes with the test extra (`make install`); `pip install 'dipaco[ray]'` installs it alone.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from cli_helpers import TINY, copy_run, dipaco_in_process

from dipaco.store.board import read_heartbeats
from dipaco.store.module_store import ModuleStore


def island_pids(run_root: Path, name: str) -> list[int]:
    """The `dipaco island --name NAME` processes of this run (started by this test's launcher)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"island" in args and str(run_root).encode() in args and name.encode() in args:
            pids.append(int(entry.name))
    return pids


def kill_first_island_once_it_beats(store: ModuleStore, run_root: Path, seen: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        beat = read_heartbeats(store).get("island-0") if store.exists("heartbeats") else None
        pids = island_pids(run_root, "island-0") if beat else []
        if pids:
            seen["incarnation"] = beat.incarnation
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance on the loopback address: two islands and the coordinator, one CPU each."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@pytest.mark.slow  # 15-18 s; make test keeps the Ray launcher's failing-islands run (2 s)
def test_ray_launcher_runs_the_tiny_config_to_completion_through_an_island_kill(tiny_routed, tiny_straight, tmp_path,
                                                                               local_ray):
    """...and ends with the modules of the same config trained in one process (conftest's `tiny_straight`):
    sync rounds with fixed seeds, however the islands ran."""
    run = copy_run(tiny_routed, tmp_path / "run")
    store = ModuleStore(str(run.store))
    seen: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=kill_first_island_once_it_beats, args=(store, run.root, seen, stop), daemon=True)
    killer.start()
    try:
        code, log = dipaco_in_process("train", "--config", TINY, "--run", run.root, "launcher.kind=ray",
                                      "hardware.islands=2", "resilience.heartbeat_timeout=3", "hardware.device=cpu")
    finally:
        stop.set()
        killer.join()
    coordinator_log = (run.logs / "coordinator.log").read_text()
    assert code == 0, f"{log[-2000:]}\n{coordinator_log[-3000:]}"
    summary = json.loads(run.train_summary.read_text())
    assert summary["results_applied"] == 8 and summary["rounds_completed"] == 2
    assert 0 < summary["goodput"]["goodput"] <= 1
    assert "placed 2 islands on Ray" in coordinator_log
    # island-0 was killed once it had beaten, and Ray placed it again (a second start in its log)
    assert "incarnation" in seen, "island-0 never heart-beat"
    island_log = (run.logs / "island-0.log").read_text()
    assert island_log.count("ray: island-0 starts") == 2, island_log[-3000:]
    assert (run.logs / "island-1.log").read_text().count("ray: island-1 starts") == 1
    for name in tiny_straight.topology.modules:
        got, want = store.read_module(2, name), tiny_straight.store.read_module(2, name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


def test_ray_islands_that_all_fail_stop_the_run_with_the_log(tmp_path, local_ray):
    """An island exiting with an error is not placed again (it would fail again); when every island has
    ended, the error names the island and shows the end of its log."""
    from dipaco.islands.launch_ray import RayIslands
    from dipaco.islands.processes import Task

    tasks = [Task(name=f"island-{i}", args=["no-such-command"], log=tmp_path / f"island-{i}.log") for i in range(2)]
    islands = RayIslands(tasks, threads=1, cpus=1, gpus=0, restarts=3)
    deadline = time.monotonic() + 120
    with pytest.raises(RuntimeError, match=r"island-\d failed with exit code 2; its log .*island-\d\.log ends with:"):
        while time.monotonic() < deadline:
            islands.check_any_alive()
            time.sleep(0.2)
    islands.terminate()
    for i in range(2):  # placed once each
        assert (tmp_path / f"island-{i}.log").read_text().count("ray: island-") == 1


def test_launcher_is_checked():
    from dipaco.config import load_config

    with pytest.raises(ValueError, match="launcher.kind must be one of \\['local', 'ray'\\], got 'slurm'"):
        load_config(TINY, ["launcher.kind=slurm"])
    with pytest.raises(ValueError, match="launcher.ray_island_cpus must be >= 1"):
        load_config(TINY, ["launcher.ray_island_cpus=0"])


def test_ray_launcher_without_ray_says_how_to_install_it(monkeypatch, tmp_path):
    import builtins

    from dipaco.islands import launch_ray

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(RuntimeError, match=r"pip install 'dipaco\[ray\]'"):
        launch_ray.connect("")
