"""An elastic island's processes on this machine: its torchft lighthouse and its worker processes, each
restarted when it dies before the run's end (it rejoins the island and heals from a live peer).

    dipaco island --config configs/tiny.yaml --run runs/tiny --name island-0 hardware.workers_per_island=2

runs `run_group(...)`, which starts worker k as the same command with `--worker k` (log: <run>/logs/island-0-wk.log)
and TORCHFT_LIGHTHOUSE naming the lighthouse (`dipaco.islands.island.elastic_island`). Workers on other machines
join the same island by running that command there with TORCHFT_LIGHTHOUSE set to this lighthouse's address
(logged), each with its own `--worker` number.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from dipaco.islands.island.elastic import start_lighthouse
from dipaco.islands.processes import Task, failure_message, start, stop_processes

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # where torchft's Manager finds the island's lighthouse
RESTART_SECONDS = 1.0  # a dead worker is started again this long after it exited
MAX_RESTARTS = 20  # restarts of the island's workers, all together, before the island gives up


def run_group(*, name: str, args: list[str], workers: int, threads: int, logs: Path,
              finished: Callable[[], bool], join_seconds: float, lost_seconds: float,
              restart_seconds: float = RESTART_SECONDS) -> int:
    """Run island `name`'s `workers` worker processes (`python -m dipaco <args> --worker k`) until every one has
    exited; a worker that fails before the run is `finished` is restarted. The lighthouse forms a quorum without a
    live worker not there `join_seconds` after the first asked, and without a worker silent for `lost_seconds`.
    Returns the restarts; raises naming the worker's log when the restarts run out or when no worker ended cleanly."""
    lighthouse = start_lighthouse(join_timeout_ms=max(1, round(join_seconds * 1000)),
                                  heartbeat_timeout_ms=max(1, round(lost_seconds * 1000)))
    env = {LIGHTHOUSE_ENV: lighthouse.address(), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft's own
    log.info("island %s: lighthouse at %s, %d workers of %d threads", name, lighthouse.address(), workers, threads)
    tasks = [Task(name=f"island {name} worker {k}", args=[*args, "--worker", str(k)], log=logs / f"{name}-w{k}.log")
             for k in range(workers)]
    running = {k: start(task, threads=threads, env=env) for k, task in enumerate(tasks)}
    ended: dict[int, int] = {}  # worker -> its exit code, once it is not restarted
    restarts = 0
    try:
        while len(ended) < workers:
            for k, (proc, out) in running.items():
                code = proc.poll()
                if code is None or k in ended:
                    continue
                out.close()
                if code == 0 or finished():
                    ended[k] = code
                    continue
                restarts += 1
                if restarts > MAX_RESTARTS:
                    raise RuntimeError(f"island {name}: {MAX_RESTARTS} worker restarts; "
                                       + failure_message(tasks[k], code))
                log.warning("%s exited with code %s; starting it again in %.0fs (it rejoins from a live peer)",
                            tasks[k].name, code, restart_seconds)
                time.sleep(restart_seconds)
                running[k] = start(tasks[k], threads=threads, env=env)
            time.sleep(0.2)
    finally:
        stop_processes([proc for proc, _ in running.values()])
        for _, out in running.values():
            out.close()
        lighthouse.shutdown()
    if 0 not in ended.values():
        k = next(iter(ended))
        raise RuntimeError(failure_message(tasks[k], ended[k]))
    return restarts
