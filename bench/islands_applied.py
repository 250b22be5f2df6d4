"""Reading a finished islands run (bench/bench_islands.py): its applied results from the round manifests, with
the island that trained each, their tokens per second, and the islands' pacing lines summed from their logs.

    tasks = applied_tasks(store); rate = applied_rate(tasks, seconds=run_seconds); pace = pace_from_logs(logs)
"""

from __future__ import annotations

import re
from pathlib import Path

from dipaco.islands.island.pacing import PACED
from dipaco.store.board import read_manifest, read_result_meta
from dipaco.store.module_store import ModuleStore


def manifests(store: ModuleStore) -> list:
    return [m for m in (read_manifest(store, r) for r in range(1, store.current_round() + 1)) if m is not None]


def applied_tasks(store: ModuleStore) -> list[dict]:
    """Every applied result's manifest entry, with the island that trained it and the island's wall clock when it
    began the upload (`finished`)."""
    out = []
    for manifest in manifests(store):
        for entry in manifest.applied:
            meta = read_result_meta(store, round=entry.base + 1, path=entry.path, attempt=entry.attempt, link=entry.link)
            out.append({**entry.to_json(), "island": meta.island, "finished": meta.finished})
    return out


def applied_rate(tasks: list[dict], *, seconds: float) -> dict:
    """Tokens of the applied results, and per second of the run (first heartbeat to last commit)."""
    tokens = sum(t["tokens"] for t in tasks)
    return {"applied_tokens": tokens, "tokens_per_second": tokens / seconds if seconds > 0 else 0.0}


def tasks_by_island(tasks: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in tasks:
        counts[t["island"]] = counts.get(t["island"], 0) + 1
    return dict(sorted(counts.items()))


def pace_from_logs(logs: list[Path]) -> dict:
    """The islands' `paced ...` lines (one per finished task, dipaco/islands/island/pacing.py) summed: tasks,
    steps, compute and padding seconds, the slowest step's compute, steps whose compute exceeded the pace."""
    total = {"tasks": 0, "steps": 0, "compute": 0.0, "padding": 0.0, "slowest": 0.0, "over_pace": 0}
    pattern = re.compile(PACED)
    for path in logs:
        for match in pattern.finditer(path.read_text(errors="replace")):
            total["tasks"] += 1
            total["steps"] += int(match["steps"])
            total["compute"] += float(match["compute"])
            total["padding"] += float(match["padding"])
            total["slowest"] = max(total["slowest"], float(match["slowest"]))
            total["over_pace"] += int(match["over"])
    return total


def worker_failures(logs: Path) -> int:
    """Injected failures of an elastic island's workers, from their logs (`faults.FaultClock`'s warning)."""
    return sum(len(re.findall(r"injected failure \d+ \(", path.read_text(errors="replace")))
               for path in logs.glob("island-*-w*.log"))


def worker_time(logs: Path) -> dict[str, float] | None:
    """An elastic island's workers' wall seconds by kind (`elastic_time.KINDS`), summed over every worker: the last
    `elastic worker time` line of each worker's log (None: no worker logged one)."""
    from dipaco.islands.island.elastic_time import KINDS, parse_line

    each = [parse_line(path.read_text(errors="replace")) for path in sorted(logs.glob("island-*-w*.log"))]
    each = [seconds for seconds in each if seconds is not None]
    return {kind: round(sum(seconds.get(kind, 0.0) for seconds in each), 2) for kind in KINDS} if each else None


def resumed_tasks(logs: Path) -> int:
    """Tasks an elastic island resumed from its inner checkpoint after all its workers died, from their logs."""
    from dipaco.islands.island.elastic_island import RESUMED

    return sum(path.read_text(errors="replace").count(RESUMED) for path in logs.glob("island-*-w*.log"))


def worker_heals(logs: Path) -> int:
    """Times an elastic island's workers healed from a live peer (a return, or a worker left out of a quorum)."""
    return sum(path.read_text(errors="replace").count("healed from a live peer") for path in logs.glob("island-*-w*.log"))
