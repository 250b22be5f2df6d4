"""Signals (issue 13, item 7): SIGTERM or SIGINT to `dipaco train` stops it and every island process it
started, and the run resumes with the same command; a coordinator killed with SIGKILL leaves no island
running either (each notices its launcher is gone). On main SIGTERM left the islands polling."""

import os
import signal
import time
from pathlib import Path

import pytest
from cli_helpers import TINY, copy_run, dipaco, start_dipaco

from dipaco.store.module_store import ModuleStore


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_stopped_train_leaves_no_island_running_and_resumes(sig, tiny_routed, tmp_path):
    run = copy_run(tiny_routed, tmp_path / "run")
    args = ("train", "--config", str(TINY), "--run", str(run.root), "hardware.device=cpu", "hardware.islands=2",
            "run.rounds=40", "inner.val_batches=0")
    train = start_dipaco(*args)
    islands: list[int] = []
    try:
        heartbeats = run.root / "store" / "heartbeats"
        wait_for(lambda: heartbeats.is_dir() and len(list(heartbeats.glob("*.json"))) == 2, 120, "two islands")
        islands = children(train.pid)
        assert len(islands) == 2
        os.kill(train.pid, sig)  # the coordinator alone, as `kill` or a supervisor would
        code = train.wait(timeout=60)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
        wait_for(lambda: not any(running(pid) for pid in islands), 30, f"islands {islands} to stop")
    finally:  # whatever happened, nothing this test started keeps running
        for pid in [train.pid, *islands]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        train.wait()
    done = ModuleStore(str(run.root / "store")).current_round()
    result = dipaco(*args[:-3], "run.rounds=40", "inner.val_batches=0", "hardware.islands=1",
                    f"run.stop_after_round={done + 1}")
    assert ModuleStore(str(run.root / "store")).current_round() == done + 1, result.stdout[-2000:]
