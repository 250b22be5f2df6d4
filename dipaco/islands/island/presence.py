"""What an island's heartbeat says, and its writing (`heartbeats/<island>.json`, `dipaco.store.board`).

The heartbeat names the island, its incarnation (new after each injected death), its status (idle /
training / done), the task it trains, the paths it is pinned to, the path it trained last and the tasks
it finished, and for an elastic island its workers in the quorum (`world`) of `workers`; `seq` goes up with
every beat, and a background thread beats every `resilience.heartbeat_seconds` while the island works. A silent
island (failed, or a worker of an elastic island that does not lead it now) writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Protocol

from dipaco.store.heartbeat_files import check_island_name, write_heartbeat
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Heartbeat, Task

log = logging.getLogger(__name__)

JOIN_SECONDS = 30.0  # how long an island waits for its heartbeat thread's last write when it stops


class Failures(Protocol):
    failures: int  # injected failures so far (`faults.FaultClock`)


class Presence:
    def __init__(self, store: ModuleStore, *, name: str, pinned: list[int], faults: Failures):
        self.store, self.name, self.pinned, self.faults = store, check_island_name(name), pinned, faults
        self.incarnation = uuid.uuid4().hex[:12]
        self.seq = 0
        self.status = "idle"
        self.current: str | None = None  # the key of the task it trains
        self.last_path: int | None = None
        self.finished: list[str] = []  # "key#attempt" of tasks this incarnation completed
        self.silent = False  # failed: no heartbeats
        self.world, self.workers = 1, 1  # an elastic island: its workers in the quorum now, and when whole
        self._lock = threading.Lock()

    def beat(self) -> None:
        if self.silent:
            return
        with self._lock:
            self.seq += 1
            write_heartbeat(self.store, Heartbeat(
                island=self.name, incarnation=self.incarnation, seq=self.seq, status=self.status,
                task=self.current, pinned=tuple(self.pinned), last_path=self.last_path,
                finished=tuple(self.finished[-8:]), time=time.time(), failures=self.faults.failures,
                world=min(self.world, self.workers), workers=self.workers))

    def training(self, task: Task) -> None:
        self.status, self.current = "training", task.key

    def finished_task(self, task: Task) -> None:
        self.finished.append(f"{task.key}#{task.attempt}")
        self.last_path, self.status, self.current = task.path, "idle", None

    def idle(self) -> None:
        self.status, self.current = "idle", None

    def reincarnate(self) -> None:
        """A new incarnation that remembers nothing (after an injected death)."""
        self.incarnation = uuid.uuid4().hex[:12]
        self.status, self.current, self.last_path = "idle", None, None
        self.finished = []

    @contextlib.contextmanager
    def beating(self, every: float) -> Iterator[None]:
        """Beat every `every` seconds in a background thread; at the end, the thread is stopped and joined
        (none is left running when the interpreter exits) and a last beat says "done"."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                try:
                    self.beat()
                except Exception as err:  # a transient store error must not kill the island
                    log.warning("island %s: heartbeat failed: %s", self.name, err)

        thread = threading.Thread(target=beat, name=f"heartbeat-{self.name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            join(thread, timeout=JOIN_SECONDS)
            self.status = "done"
            self.beat()


def join(thread: threading.Thread, *, timeout: float) -> None:
    """Wait up to `timeout` s for a thread told to stop, also when a signal (KeyboardInterrupt) interrupts the
    wait: a daemon thread still running at the interpreter's exit is killed wherever it is, in a C++ library
    too, which can abort the process (`terminate called without an active exception`)."""
    try:
        thread.join(timeout)
    except BaseException:
        thread.join(timeout)
        raise
    if thread.is_alive():
        log.warning("thread %s did not stop within %.0fs", thread.name, timeout)
