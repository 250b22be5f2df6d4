"""Run worker processes (islands, baselines) on this machine: a batch a bounded number at a time
(`run_tasks`), or long-running islands all at once (`WorkerPool`).

    run_tasks([Task(name="help", args=["--help"], log=Path("help.log"))], processes=1, threads=1, desc="demo")

Each process gets its share of the cores for torch's threads (oversubscribed threads slow a small
machine many-fold), writes its own log file, and a failure stops the batch with an error that names
the log and shows its last lines.

No worker outlives its launcher: each starts in a process group of its own, stopped as a whole
(SIGTERM, then SIGKILL after a grace period) when the launcher stops or is interrupted (SIGINT and
SIGTERM end the launcher through `dipaco.cli`, so its `finally` runs); and a worker whose launcher
died without stopping it (SIGKILL) notices within a second and exits (`exit_with_parent`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)

THREADS_ENV = "DIPACO_THREADS"
PARENT_ENV = "DIPACO_PARENT_PID"  # the launcher's pid, given to its workers (`exit_with_parent`)
STOP_SECONDS = 10.0  # a worker's grace period between SIGTERM and SIGKILL


@dataclass(frozen=True)
class Task:
    name: str  # shown in progress and errors, e.g. "round 3 path 2"
    args: list[str]  # arguments of `python -m dipaco`
    log: Path  # where the process's output goes


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plan_parallelism(n_tasks: int, *, processes: int = 0, threads: int = 0) -> tuple[int, int]:
    """(processes at once, torch threads each): by default one process per core, up to the task count."""
    cores = available_cores()
    processes = processes or max(1, min(n_tasks, cores))
    threads = threads or max(1, cores // processes)
    return processes, threads


def set_threads_from_env() -> None:
    """Called first thing in a worker process: use the thread count its launcher gave it (`dipaco.threads`)."""
    threads = os.environ.get(THREADS_ENV)
    if threads:
        from dipaco.threads import use_threads

        use_threads(int(threads))


def exit_with_parent() -> None:
    """Called first thing in a worker process: exit (SIGTERM to itself) as soon as the launcher that
    started it is gone. Only a direct child of the launcher watches; its own children are left to it."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent or os.getppid() != int(parent):
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        log.error("the process that started this one (pid %s) is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, THREADS_ENV: str(threads), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            PARENT_ENV: str(os.getpid())}


def _start(task: Task, env: dict[str, str], *, cwd: str | None = None) -> tuple[subprocess.Popen, object]:
    task.log.parent.mkdir(parents=True, exist_ok=True)
    out = open(task.log, "a")  # noqa: SIM115 - closed when the process ends
    proc = subprocess.Popen([sys.executable, "-m", "dipaco", *task.args], stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=cwd, start_new_session=True)  # its own process group: stopped with everything it started
    return proc, out


def start(task: Task, *, threads: int, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, object]:
    """Start `python -m dipaco <task.args>` (output appended to its log, `threads` torch threads, extra `env`
    variables) in a process group of its own; returns the process and its open log (close it once it ends)."""
    return _start(task, {**_env(threads), **(env or {})})


def stop_processes(procs: list[subprocess.Popen], *, grace: float = STOP_SECONDS) -> None:
    """SIGTERM the process group of every process still running, wait up to `grace` s, then SIGKILL."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in alive:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("process %d did not stop in %.0fs after SIGTERM; killing it", proc.pid, grace)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    for proc in alive:
        _signal_group(proc, signal.SIGKILL)  # anything its group still holds (e.g. torchrun ranks)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


def _failure(task: Task, code: int) -> RuntimeError:
    return RuntimeError(f"{task.name} failed with exit code {code}; its log {task.log} ends with:\n" + _tail(task.log))


class WorkerPool:
    """Long-running worker processes (pull-based islands, `dipaco island`), started at once."""

    def __init__(self, tasks: list[Task], *, threads: int):
        env = _env(threads)
        self.running = [(task, *_start(task, env)) for task in tasks]
        self._reported: set[str] = set()

    def check_any_alive(self) -> None:
        """Raise when every worker has exited (a fault-tolerant run survives single island deaths)."""
        codes = [proc.poll() for _, proc, _ in self.running]
        if all(code is not None for code in codes):
            task, proc, _ = self.running[0]
            raise _failure(task, proc.returncode) if proc.returncode else RuntimeError("every island process has exited")
        for (task, _, _), code in zip(self.running, codes):
            if code not in (None, 0) and task.name not in self._reported:
                self._reported.add(task.name)
                log.warning("%s exited with code %s; the other islands carry on. Its log %s ends with:\n%s",
                            task.name, code, task.log, _tail(task.log, 5))

    def stop(self, *, timeout: float = 30.0) -> None:
        """Wait for workers to finish (they stop after the last round), killing any that hang."""
        for task, proc, out in self.running:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; terminating it", task.name, timeout)
                stop_processes([proc])
            out.close()

    def wait(self) -> None:
        """Wait for every worker to exit (however long it takes); raise naming the first that failed."""
        for _task, proc, out in self.running:
            proc.wait()
            out.close()
        for task, proc, _ in self.running:
            if proc.returncode != 0:
                raise _failure(task, proc.returncode)

    def terminate(self) -> None:
        """Stop every worker and what it started (its process group)."""
        stop_processes([proc for _, proc, _ in self.running])
        for _, _, out in self.running:
            out.close()


def run_one(task: Task, *, threads: int, env: dict[str, str] | None = None, cwd: str | None = None) -> int:
    """Run one task to its end (`python -m dipaco <args>`, output appended to its log) and return its exit
    code (negative: killed by that signal). An interruption of the caller (KeyboardInterrupt: Ctrl-C,
    SIGTERM through `dipaco.cli`, `ray.cancel`) stops the task's process group first. Extra `env`
    variables are added to the worker's environment; `cwd` is its directory (default: this one's)."""
    proc, out = _start(task, {**_env(threads), **(env or {})}, cwd=cwd)
    try:
        return proc.wait()
    finally:
        stop_processes([proc])  # nothing when it has ended
        out.close()


def failure_message(task: Task, code: int) -> str:
    """What a failed task's error says: its name, exit code and the end of its log."""
    return str(_failure(task, code))


def run_tasks(tasks: list[Task], *, processes: int, threads: int, desc: str) -> None:
    """Run `python -m dipaco <args>` for every task, `processes` at a time; raise on the first failure."""
    env = _env(threads)
    pending = list(tasks)
    running: list[tuple[Task, subprocess.Popen, object]] = []
    with tqdm(total=len(tasks), desc=desc, unit="task", leave=False, dynamic_ncols=True, disable=None) as bar:
        try:
            while pending or running:
                while pending and len(running) < processes:
                    task = pending.pop(0)
                    running.append((task, *_start(task, env)))
                for item in list(running):
                    task, proc, out = item
                    if proc.poll() is None:
                        continue
                    out.close()
                    running.remove(item)
                    if proc.returncode != 0:
                        raise _failure(task, proc.returncode)
                    bar.update(1)
                time.sleep(0.1)
        finally:
            stop_processes([proc for _, proc, _ in running])
            for _, _, out in running:
                out.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
