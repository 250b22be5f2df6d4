"""How busy the machine's cores were during a benchmark run: all of it (/proc/stat) and this process's tree.

    with CoreSampler() as cores:          # samples every second in a thread (Linux)
        run_the_benchmark()
    cores.summary()   # {"machine_busy_mean", "machine_busy_max", "ours_busy_mean", "ours_busy_max", "windows", ...}

A window's busy fraction is the share of all cores' time (user, nice, system, irq, softirq, steal) that
was not idle or waiting for I/O, from the first line of /proc/stat (`machine_*`, whoever ran: on a shared
machine other jobs count too), and the CPU seconds of this process and its descendants, from
/proc/<pid>/stat, divided by the window's wall time × the cores (`ours_*`). A process that ends inside
a window does not count in it (its CPU goes to its parent's reaped total, which is not read).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")


def cpu_jiffies(stat_text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all cores from /proc/stat's text (its first, "cpu" line)."""
    fields = stat_text.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"/proc/stat's first line should start with 'cpu', got {fields[0]!r}")
    values = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of the cores' time busy between two `cpu_jiffies` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def process_cpu_seconds(stat_text: str, *, ticks: int) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) from one /proc/<pid>/stat's text."""
    rest = stat_text.rsplit(")", 1)[1].split()  # the command name (in parentheses) may hold spaces
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / ticks


def tree_cpu_seconds(root: int, *, proc: Path = PROC) -> dict[int, float]:
    """CPU seconds of `root` and every descendant alive now, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents, seconds = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent, cpu = process_cpu_seconds((entry / "stat").read_text(), ticks=ticks)
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        parents[int(entry.name)], seconds[int(entry.name)] = parent, cpu
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return {pid: seconds[pid] for pid in tree if pid in seconds}


class CoreSampler:
    def __init__(self, *, interval: float = 1.0, root: int | None = None,
                 read_stat: Callable[[], str] = lambda: (PROC / "stat").read_text(),
                 read_tree: Callable[[int], dict[int, float]] = tree_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.root = interval, root or os.getpid()
        self.read_stat, self.read_tree, self.clock = read_stat, read_tree, clock
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.machine: list[float] = []  # busy fraction of each window
        self.ours: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, tuple[int, int], dict[int, float]] | None = None

    def sample(self) -> None:
        """Read the counters now and, after the first reading, close one window."""
        now, jiffies, tree = self.clock(), cpu_jiffies(self.read_stat()), self.read_tree(self.root)
        if self._last is not None:
            then, jiffies_then, tree_then = self._last
            self.machine.append(busy_fraction(jiffies_then, jiffies))
            ours = sum(cpu - tree_then[pid] for pid, cpu in tree.items() if pid in tree_then)
            self.ours.append(ours / (max(now - then, 1e-9) * self.cores))
        self._last = (now, jiffies, tree)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> CoreSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="core-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def summary(self) -> dict:
        def stats(values: list[float], name: str) -> dict:
            if not values:
                return {f"{name}_busy_mean": None, f"{name}_busy_max": None}
            return {f"{name}_busy_mean": statistics.mean(values), f"{name}_busy_max": max(values)}

        return {"cores": self.cores, "window_seconds": self.interval, "windows": len(self.machine),
                **stats(self.machine, "machine"), **stats(self.ours, "ours"),
                "machine_windows_saturated": sum(1 for v in self.machine if v >= SATURATED),
                "ours_windows_saturated": sum(1 for v in self.ours if v >= SATURATED)}


SATURATED = 0.95  # a window at least this busy counts as saturated
