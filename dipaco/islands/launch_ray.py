"""The coordinator and the islands as Ray tasks: `dipaco train launcher.kind=ray`.

    dipaco train --config configs/demo.yaml --run runs/demo launcher.kind=ray                      # a local Ray instance
    dipaco train --config configs/demo.yaml --run runs/demo launcher.kind=ray launcher.ray_address=auto  # the running cluster

The driver places one Ray task that runs the coordinator (`dipaco train` over the run's config.yaml);
it places `hardware.islands` islands as Ray tasks (`RayIslands`, `dipaco island` each, with
`launcher.ray_island_cpus` / `ray_island_gpus`; 0 islands: as many as the cluster holds). Each Ray task
runs its command as a child process (`dipaco.islands.processes.run_one`); an island killed by a signal
is placed again up to `launcher.ray_island_restarts` times; stopping the driver cancels everything.
Ray is optional (`pip install 'dipaco[ray]'`) and imported when called. docs/islands.md#clusters.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from dipaco.islands.processes import STOP_SECONDS, Task, failure_message, run_one

log = logging.getLogger(__name__)

COORDINATOR_ENV = "DIPACO_RAY_COORDINATOR"  # set in the coordinator task's process: place islands through Ray
ADDRESS_ENV = "DIPACO_RAY_ADDRESS"  # the Ray cluster (GCS address) the coordinator task's islands go to
POLL_SECONDS = 1.0
PROBE_SECONDS = 10.0  # how long a launcher.ray_address host:port may take to accept a connection


class IslandKilled(RuntimeError):
    """An island's process was killed by a signal: Ray places it again (`launcher.ray_island_restarts`)."""


def require_ray():
    """The `ray` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("launcher.kind=ray needs Ray, which is not installed: pip install 'dipaco[ray]' "
                           "(or pip install ray), or use launcher.kind=local") from None
    return ray


def probe(address: str, *, timeout: float = PROBE_SECONDS) -> None:
    """Refuse, within `timeout` seconds, a Ray address `host:port` (or `ray://host:port`) where nothing
    accepts a connection: `ray.init` would wait minutes for it, and longer to obey SIGTERM. Other forms
    ("", "auto", no port) are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise RuntimeError(f"cannot reach the Ray cluster at launcher.ray_address={address!r}: nothing accepts "
                           f"a connection on {host}:{port} within {timeout:g}s ({err.strerror or err}); start it "
                           f"(`ray start --head`), fix the address, or leave it empty for a local Ray instance") from None


def connect(address: str):
    """Connect to Ray at `address` ("" = start a local instance, "auto" = this node's cluster) unless this
    process already is; returns (the ray module, whether this call started the connection). A `host:port`
    address is probed first (`probe`)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray, False
    probe(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")  # this machine only
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = f"the Ray cluster at launcher.ray_address={address!r}" if address else "a local Ray instance"
        raise RuntimeError(f"cannot connect to {where}: {err}") from None
    return ray, True


def in_coordinator_task() -> bool:
    """Is this process the coordinator that a `launcher.kind=ray` driver placed on Ray?"""
    return os.environ.get(COORDINATOR_ENV) == "1"


def run_command(args: list[str], log_file: str, name: str, threads: int, env: dict[str, str], cwd: str | None) -> int:
    """Body of every Ray task here: `python -m dipaco <args>` to its end, in this Ray worker. A process
    killed by a signal raises `IslandKilled` (retried by Ray), another failure RuntimeError with its log."""
    task = Task(name=name, args=args, log=Path(log_file))
    task.log.parent.mkdir(parents=True, exist_ok=True)
    with task.log.open("a") as out:  # one line per placement: a restarted island has several
        out.write(f"{time.strftime('%H:%M:%S')} ray: {name} starts on {socket.gethostname()} "
                  f"(Ray worker pid {os.getpid()})\n")
    code = run_one(task, threads=threads, env=env, cwd=cwd if cwd and os.path.isdir(cwd) else None)
    if code < 0:
        raise IslandKilled(failure_message(task, code))
    if code:
        raise RuntimeError(failure_message(task, code))
    return code


def _reason(err: Exception) -> str:
    """A Ray error as the message of what failed in the task (its cause), else Ray's own words."""
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err).strip().splitlines()[-1]


def cancel(refs: list, *, grace: float = STOP_SECONDS + 5.0) -> None:
    """Cancel Ray tasks: KeyboardInterrupt in each (its command's process group is stopped), then, for a
    task still running after `grace` seconds, its worker is killed."""
    ray = require_ray()
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref)
    _, left = ray.wait(refs, num_returns=len(refs), timeout=grace)
    for ref in left:
        ray.cancel(ref, force=True)


class RayIslands:
    """Pull-based islands as Ray tasks, with `dipaco.islands.processes.WorkerPool`'s interface
    (`check_any_alive`, `stop`, `terminate`), so the round loop runs them alike."""

    def __init__(self, tasks: list[Task], *, threads: int, cpus: float, gpus: float, restarts: int):
        self.ray = require_ray()
        remote = self.ray.remote(run_command)
        self.tasks = tasks
        self.refs = [remote.options(num_cpus=cpus, num_gpus=gpus, max_retries=restarts, retry_exceptions=[IslandKilled],
                                    name=task.name).remote(task.args, str(task.log), task.name, threads, {}, os.getcwd())
                     for task in tasks]
        self._failed: dict[str, str] = {}
        self._ended: set[str] = set()
        log.info("placed %d islands on Ray (%s CPUs, %s GPUs each; up to %d restarts)", len(tasks), cpus, gpus, restarts)

    def _collect(self, timeout: float = 0.0) -> None:
        """Note every island task that has ended (and why), once."""
        ready, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        for task, ref in zip(self.tasks, self.refs):
            if ref not in ready or task.name in self._ended:
                continue
            self._ended.add(task.name)
            try:
                self.ray.get(ref)
            except Exception as err:  # a RayTaskError (the command failed) or a RayError (worker, node, cancel)
                self._failed[task.name] = _reason(err)
                log.warning("%s ended: %s; the other islands carry on", task.name, self._failed[task.name])

    def check_any_alive(self) -> None:
        """Raise when every island task has ended (a fault-tolerant run survives single island deaths)."""
        self._collect()
        if len(self._ended) == len(self.tasks):
            first = next(iter(self._failed.values()), None)
            raise RuntimeError(first or "every island has exited")

    def stop(self, *, timeout: float = 30.0) -> None:
        """Wait for the islands to finish (they stop after the last round), cancelling any that hang."""
        deadline = time.monotonic() + timeout
        while len(self._ended) < len(self.tasks) and time.monotonic() < deadline:
            self._collect(timeout=min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        self.terminate()

    def terminate(self) -> None:
        """Cancel every island task still running (each stops its process group)."""
        cancel([ref for task, ref in zip(self.tasks, self.refs) if task.name not in self._ended])


def island_plan(*, n_paths: int, islands: int, cpus: int, gpus: float, coordinator_cpus: float) -> int:
    """How many islands to place: `islands`, or (0) as many as the cluster's free CPUs (and GPUs) hold,
    at least one, at most one per path."""
    if islands:
        return islands
    ray = require_ray()
    resources = ray.cluster_resources()
    fit = int((resources.get("CPU", 0.0) - coordinator_cpus) // cpus)
    if gpus > 0:
        fit = min(fit, int(resources.get("GPU", 0.0) // gpus))
    return max(1, min(n_paths, fit))


def start_islands(tasks: list[Task], *, cpus: int, gpus: float, restarts: int) -> RayIslands:
    """In the coordinator task: join the driver's Ray cluster and place `tasks` as Ray tasks."""
    connect(os.environ.get(ADDRESS_ENV, "auto"))
    return RayIslands(tasks, threads=cpus, cpus=cpus, gpus=gpus, restarts=restarts)


def run_coordinator(args: list[str], *, address: str, cpus: float, log_file: Path) -> None:
    """In the driver: place the coordinator (`python -m dipaco <args>`) as a Ray task and wait for it.
    An interruption (Ctrl-C, SIGTERM) cancels it, which stops its islands; a failure raises RuntimeError
    with the end of its log. A local Ray instance started here is shut down at the end."""
    ray, started = connect(address)
    try:
        env = {COORDINATOR_ENV: "1", ADDRESS_ENV: ray.get_runtime_context().gcs_address}
        remote = ray.remote(run_command).options(num_cpus=cpus, max_retries=0, name="dipaco-coordinator")
        ref = remote.remote(args, str(log_file), "the coordinator", 1, env, os.getcwd())
        log.info("the coordinator runs as a Ray task (%s CPUs; log %s)", cpus, log_file)
        try:
            while not ray.wait([ref], timeout=POLL_SECONDS)[0]:
                pass
        except BaseException:
            cancel([ref])
            raise
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:
            raise RuntimeError(_reason(err)) from None
    finally:
        if started:
            ray.shutdown()
