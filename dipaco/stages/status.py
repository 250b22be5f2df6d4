"""`dipaco status`: the live board of a run, read from its store (nothing is written).

    dipaco status --run runs/demo                  # the run's store (store.url or <run>/store)
    dipaco status --store s3://bucket/dipaco/demo  # only the store, from any machine
    dipaco status --run runs/demo --watch 5        # redrawn every 5 s until the run finishes (Ctrl-C stops)
    dipaco status --run runs/demo --json           # the same, as one JSON object

It shows the committed round and whether the run is finished, the lease holder, the module versions
kept, every island's last heartbeat and task, the queue of tasks, and from the round manifests the
results applied, their island-seconds and bytes and every path's latest losses (validation losses from
best.json); the outer step each span of rounds took (train.json's rows, as applied); goodput (by work:
applied tokens over the islands' failure-free capacity, the time-based share beside it) is train.json's
at the end of a run, an estimate while it runs. Bytes: the applied pseudo-gradients as
sent, against what float32 DiLoCo (the same results in float32) and data parallel (a ring all-reduce of a
float32 gradient per inner step of the same training among the run's islands) would have sent, by island and by module. Traffic: every byte and
request each process measured at the store, by direction, kind and process (`dipaco.store.ledger`).
A heartbeat file that is not an island's valid heartbeat is shown as malformed and left out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dipaco.config import Config
from dipaco.eval.early_stopping import best_rounds, read_history
from dipaco.optim.outer_history import describe_rows, describe_step
from dipaco.run_dir import RunDir
from dipaco.store.board import read_board, read_manifest
from dipaco.store.goodput import by_work, median_rate
from dipaco.store.heartbeat_files import read_heartbeats
from dipaco.store.lease import Holder, read_holder
from dipaco.store.ledger import read_summary
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import TASK_STATUSES, Board, ManifestEntry, RoundStats, Task
from dipaco.store.run_state import committed_record
from dipaco.store.traffic import ring_allreduce_bytes
from dipaco.tables import format_table


@dataclass(frozen=True)
class Source:
    """Where `dipaco status` reads: the store, and what the run directory adds (its config, train.json)."""

    store: ModuleStore
    run: RunDir | None = None
    config: Config | None = None


def source(*, run: str | None, store: str | None, config: Config | None) -> Source:
    """The store of `run` (its config's store.url, else <run>/store) or the store URL `store`."""
    if store:
        return Source(store=ModuleStore(store), run=RunDir(run) if run else None, config=config)
    if not run:
        raise ValueError("dipaco status needs --run DIR or --store URL")
    run_dir = RunDir(run)
    if not run_dir.root.is_dir():
        raise FileNotFoundError(f"--run {run}: no such run directory")
    return Source(store=ModuleStore((config.store.url if config else "") or str(run_dir.store)),
                  run=run_dir, config=config)


def collect(src: Source, *, now: float | None = None) -> dict[str, Any]:
    """Everything `dipaco status` shows, as a JSON-ready dict (`now`: this machine's wall clock)."""
    now = time.time() if now is None else now
    store = src.store
    state = store.state()
    if state is None:
        raise StoreError(f"store {store.url} has no committed round yet: `dipaco train` has not started on it")
    config = src.config or Config()
    round = int(state["round"])
    board, last_stats = _latest_board(store)
    tasks = dict(board.tasks) if board else {}
    holder = read_holder(store)
    applied = AppliedResults.read(store, round)
    islands, malformed = _islands(store, tasks, now=now, heartbeat_timeout=config.resilience.heartbeat_timeout)
    n_paths = len(board.paths) if board else max(applied.by_path, default=-1) + 1
    paths = _paths(store, board, applied.by_path, n_paths=n_paths)
    summary = _train_summary(src.run)
    goodput = _goodput(summary, applied.entries(), islands=len(islands), config=config if src.config else None,
                       since_start=None if holder is None else now - holder.started,
                       finished=bool(state.get("finished")))
    return {
        "store": store.url,
        "round": round,
        "finished": bool(state.get("finished")),
        "coordinator": _coordinator(holder, now=now),
        "module_versions": [v for v in store.versions("modules") if v <= round],  # not one being written
        "results_applied": sum(len(e) for e in applied.by_path.values()),
        "results_target": config.run.rounds * n_paths if src.config else None,
        "stale": int(applied.stale),
        "dropped": applied.dropped,
        "cancelled": _cancelled(summary, last_stats),
        "useful_island_seconds": applied.useful,
        "bytes_up": applied.bytes_up,
        "bytes": applied.moved.to_json(workers=summary.get("data_parallel_workers") or max(1, len(islands))),
        "traffic": read_summary(store),
        "goodput": goodput,
        "last_round": _last_round(last_stats),
        "outer_steps": _outer_steps(summary, src.run),
        "islands": islands,
        "malformed_heartbeats": [{"file": file, "reason": reason} for file, reason in sorted(malformed.items())],
        "queue": {status: sum(1 for t in tasks.values() if t.status == status) for status in TASK_STATUSES},
        "tasks": [{"task": t.key, "status": t.status, "island": t.island, "attempt": t.attempt, "base": t.base}
                  for t in sorted(tasks.values(), key=lambda t: (t.base, t.path))],
        "paths": paths,
    }


def _latest_board(store: ModuleStore) -> tuple[Board | None, RoundStats | None]:
    """The newest task board (the one written, else the last commit's when that is newer) and the last
    commit's round stats."""
    committed_board, last_stats = committed_record(store)
    board = read_board(store)
    if committed_board is not None and (board is None or board.round < committed_board.round):
        board = committed_board
    return board, last_stats


def _islands(store: ModuleStore, tasks: dict[str, Task], *, now: float,
             heartbeat_timeout: float) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each island's row from its heartbeat (its running task from `tasks` when it has one), and the heartbeat
    files that are not an island's valid heartbeat (file -> reason: shown, ignored)."""
    islands, malformed = [], {}
    for name, beat in sorted(read_heartbeats(store, malformed=malformed).items()):
        assigned = [t.key for t in tasks.values() if t.status in ("assigned", "cut") and t.island == name]
        age = max(0.0, now - beat.time)  # the island's wall clock against this one's: skew can make it negative
        islands.append({"island": name, "status": beat.status, "task": assigned[0] if assigned else beat.task,
                        "beat_seconds_ago": age, "alive": beat.status != "done" and age < heartbeat_timeout,
                        "failures": beat.failures, "pinned": list(beat.pinned), "world": beat.world,
                        "workers": beat.workers})
    return islands, malformed


def _paths(store: ModuleStore, board: Board | None, applied: dict[int, list[tuple[int, ManifestEntry]]], *,
           n_paths: int) -> list[dict[str, Any]]:
    """Each path's row: inner steps done (the board's), results applied, its latest train loss (the last
    applied result's) and its latest and best validation losses (best.json's history)."""
    history = read_history(store)
    best = best_rounds(history)
    paths = []
    for path in range(n_paths):
        entries = applied.get(path, [])
        last_round, last = entries[-1] if entries else (None, None)
        val = history.get(path, {})
        latest = max(val) if val else None
        paths.append({"path": path, "steps_done": board.paths[path].steps_done if board and path in board.paths else None,
                      "results_applied": len(entries), "train_loss": last.train_loss if last else None,
                      "train_loss_round": last_round, "val_loss": val[latest] if latest is not None else None,
                      "val_loss_version": latest, "best_val_loss": val[best[path]] if path in best else None,
                      "best_version": best.get(path)})
    return paths


def _coordinator(holder: Holder | None, *, now: float) -> dict[str, Any] | None:
    """The coordinator holding the store's lease (None: none holds it)."""
    if holder is None:
        return None
    return {"host": holder.host, "pid": holder.pid, "token": holder.token, "started_seconds_ago": now - holder.started,
            "renewed_seconds_ago": now - holder.renewed_at}


def _last_round(stats: RoundStats | None) -> dict[str, Any] | None:
    """The last committed round's stats (None before a commit recorded them)."""
    if stats is None:
        return None
    return {"round": stats.round, "seconds": stats.seconds, "applied": stats.applied, "in_flight": stats.in_flight,
            "cancelled": stats.cancelled, "outer_step": describe_step(stats.outer, stats.outer_step)}


@dataclass
class ByteCounts:
    """The applied results' bytes as sent, in float32 and as data parallel, in all, by island and by module."""

    sent: int = 0
    float32: int = 0  # 0 for results applied before their manifests recorded it
    data_parallel: int = 0  # one copy of the gradients (`to_json` applies the ring all-reduce)
    by_island: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)

    def add(self, entry: ManifestEntry) -> None:
        self.sent += entry.bytes
        self.float32 += entry.float32_bytes
        self.data_parallel += entry.data_parallel_bytes
        island = entry.island or "?"
        self.by_island[island] = self.by_island.get(island, 0) + entry.bytes
        for module, size in (entry.module_bytes or {}).items():
            self.by_module[module] = self.by_module.get(module, 0) + size

    def to_json(self, *, workers: int) -> dict[str, Any]:
        """`workers`: the run's islands, data parallel's workers (each sends and receives a ring all-reduce of a
        float32 gradient per inner step)."""
        return {"sent": self.sent, "float32_diloco": self.float32,
                "data_parallel": int(ring_allreduce_bytes(self.data_parallel, workers)), "data_parallel_workers": workers,
                "by_island": dict(sorted(self.by_island.items())), "by_module": dict(sorted(self.by_module.items()))}


@dataclass
class AppliedResults:
    """The results the round manifests of rounds 1..the committed one record as applied, and their totals."""

    by_path: dict[int, list[tuple[int, ManifestEntry]]] = field(default_factory=dict)  # path -> (round, entry), oldest first
    useful: float = 0  # island-seconds of the applied results
    bytes_up: int = 0  # their pseudo-gradients' bytes as sent
    stale: int = 0  # results applied with a staleness > 0
    dropped: int = 0  # results the manifests dropped
    moved: ByteCounts = field(default_factory=ByteCounts)  # their bytes by island and module, and in float32

    @classmethod
    def read(cls, store: ModuleStore, round: int) -> AppliedResults:
        """From the manifests of rounds 1..`round` (a round without one is skipped)."""
        applied = cls()
        for r in range(1, round + 1):
            manifest = read_manifest(store, r)
            if manifest is None:
                continue
            for entry in manifest.applied:
                applied.by_path.setdefault(entry.path, []).append((r, entry))
                applied.useful += entry.seconds
                applied.bytes_up += entry.bytes
                applied.stale += entry.staleness > 0
                applied.moved.add(entry)
            applied.dropped += len(manifest.dropped)
        return applied

    def entries(self) -> list[ManifestEntry]:
        """Every applied result, path by path."""
        return [entry for path_entries in self.by_path.values() for _, entry in path_entries]


def _times(than: int, sent: int) -> str:
    return f"{than / sent:.1f}x" if than and sent else "-"


def _goodput(summary: dict, entries: list[ManifestEntry], *, islands: int, config: Config | None,
             since_start: float | None, finished: bool) -> dict[str, Any]:
    """{"value": goodput by work, "by_time": the time-based share, "how"}: train.json's at the end of a run;
    while it runs an estimate: applied tokens / (islands x the run's seconds x an island's failure-free
    tokens/s: the pace's where `config` paces the islands, else the median applied result's)."""
    recorded = summary.get("goodput")
    if recorded:
        if "applied_tokens" not in recorded:  # train.json written before goodput by work
            return {"value": None, "by_time": recorded["goodput"],
                    "how": "by work not recorded (train.json written before it)"}
        return {"value": recorded["goodput"], "by_time": recorded.get("goodput_by_time"),
                "how": "train.json, at the end of the run"}
    elapsed, how = None, ""
    if summary.get("rounds"):
        elapsed, how = sum(r.get("seconds", 0.0) for r in summary["rounds"]), "train.json's round seconds"
    elif since_start is not None:
        elapsed, how = since_start, "since the coordinator started"
    if not elapsed or not islands:
        return {"value": None, "by_time": None,
                "how": "recorded in the run's train.json (pass --run)" if finished else "not known yet"}
    pace = config.faults.step_seconds if config else 0.0
    speed, speed_how = ((config.inner.batch_size * config.sharding.seq_len / pace, "the pace's")
                        if pace else (median_rate((e.tokens, e.seconds) for e in entries), "the median result's"))
    value = by_work(tokens=sum(e.tokens for e in entries), seconds=elapsed, islands=islands, tokens_per_second=speed)
    return {"value": None if math.isnan(value) else value,
            "by_time": sum(e.seconds for e in entries) / (islands * elapsed),
            "how": f"estimate: applied tokens / ({islands} islands x {how} x {speed_how} tokens/s)"}


def _cancelled(summary: dict[str, Any], last: RoundStats | None) -> dict[str, Any] | None:
    """Running tasks cancelled so far: train.json's rows (a row written before cancellation existed has
    none), else only what the last commit's stats say."""
    if summary.get("rounds"):
        return {"tasks": sum(r.get("cancelled", 0) for r in summary["rounds"]), "how": "train.json"}
    if last is not None:
        return {"tasks": last.cancelled, "how": f"in round {last.round}, the last commit"}
    return None


def _outer_steps(summary: dict[str, Any], run: RunDir | None) -> str | None:
    """The outer step each span of rounds took, from train.json's rows (None without them)."""
    if not summary.get("rounds"):
        return None
    return describe_rows(summary["rounds"], file=str(run.train_summary if run else "train.json"))


def _train_summary(run: RunDir | None) -> dict[str, Any]:
    if run is None or not run.train_summary.exists():
        return {}
    try:
        return json.loads(run.train_summary.read_text())
    except json.JSONDecodeError:
        return {}  # being replaced (atomically): only the estimate is lost


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_status(status: dict[str, Any]) -> str:
    """`collect`'s dict as the text `dipaco status` prints."""
    lines = [f"store {status['store']}: round {status['round']} committed, "
             + ("finished" if status["finished"] else "running")]
    lines.extend(_coordinator_lines(status))
    versions = status["module_versions"]
    lines.append(f"module versions kept: {', '.join(map(str, versions)) or '-'}")
    lines.extend(_results_lines(status))
    lines.extend(_traffic_lines(status["traffic"]))
    last = status["last_round"]
    if last:
        lines.append(f"last round {last['round']}: {last['applied']} results applied in {last['seconds']:.1f}s, "
                     f"{last['in_flight']} tasks in flight when it closed, {last['cancelled']} cancelled; "
                     f"outer step: {last['outer_step']}")
    if status["outer_steps"]:
        lines.append(f"outer steps (train.json): {status['outer_steps']}")
    lines.extend(_islands_lines(status))
    lines.extend(_tasks_lines(status))
    lines.append("\npaths")
    lines.append(format_table(
        ["path", "inner steps", "results applied", "train loss (round)", "val loss (version)", "best val loss (version)"],
        [[p["path"], _num(p["steps_done"], "d"), p["results_applied"],
          f"{_num(p['train_loss'])} ({_num(p['train_loss_round'], 'd')})",
          f"{_num(p['val_loss'])} ({_num(p['val_loss_version'], 'd')})",
          f"{_num(p['best_val_loss'])} ({_num(p['best_version'], 'd')})"] for p in status["paths"]]))
    return "\n".join(lines)


def _coordinator_lines(status: dict[str, Any]) -> list[str]:
    """The lease holder, or that none holds the lease of a run not finished."""
    coordinator = status["coordinator"]
    if coordinator:
        return [f"coordinator: {coordinator['host']} pid {coordinator['pid']} (lease token {coordinator['token']}, "
                f"started {coordinator['started_seconds_ago']:.0f}s ago, renewed "
                f"{coordinator['renewed_seconds_ago']:.0f}s ago)"]
    if not status["finished"]:
        return ["coordinator: none holds the store's lease (stopped; the same command resumes the run)"]
    return []


def _results_lines(status: dict[str, Any]) -> list[str]:
    """The results applied, goodput, and the applied bytes against float32 DiLoCo and data parallel."""
    target = f" of {status['results_target']}" if status["results_target"] else ""
    cancelled = status["cancelled"]
    cut = f", {cancelled['tasks']} running tasks cancelled ({cancelled['how']})" if cancelled else ""
    lines = [f"results applied: {status['results_applied']}{target} ({status['stale']} stale, "
             f"{status['dropped']} dropped{cut}); pseudo-gradients applied: {status['bytes_up'] / 1e6:.2f} MB; "
             f"applied island time {status['useful_island_seconds']:.1f}s"]
    goodput = status["goodput"]
    by_time = f"; by time {100 * goodput['by_time']:.1f}%" if goodput.get("by_time") is not None else ""
    lines.append(f"goodput: {100 * goodput['value']:.1f}% by work ({goodput['how']}){by_time}"
                 if goodput["value"] is not None else f"goodput: {goodput['how']}{by_time}")
    moved = status["bytes"]
    if moved["sent"]:
        lines.append(f"bytes applied: {moved['sent'] / 1e6:.2f} MB sent; float32 DiLoCo would send "
                     f"{moved['float32_diloco'] / 1e6:.2f} MB ({_times(moved['float32_diloco'], moved['sent'])} more), "
                     f"data parallel on {moved['data_parallel_workers']} workers {moved['data_parallel'] / 1e6:.2f} MB each way "
                     f"({_times(moved['data_parallel'], moved['sent'])}); by island: "
                     + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in moved["by_island"].items())
                     + "; by module: " + (", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in moved["by_module"].items()) or "-"))
    return lines


def _islands_lines(status: dict[str, Any]) -> list[str]:
    """The islands' table (last heartbeat, task, workers) and the malformed heartbeats ignored."""
    lines = [f"\nislands ({len(status['islands'])})"]
    if status["islands"]:
        lines.append(format_table(["island", "status", "task", "last beat", "alive", "workers", "failures"],
                                  [[i["island"], i["status"], i["task"] or "-", f"{i['beat_seconds_ago']:.1f}s ago",
                                    "yes" if i["alive"] else "no", f"{i['world']} of {i['workers']}", i["failures"]]
                                   for i in status["islands"]]))
    for bad in status["malformed_heartbeats"]:
        lines.append(f"malformed heartbeat, ignored: {bad['reason']}")
    return lines


def _tasks_lines(status: dict[str, Any]) -> list[str]:
    """The queue's counts by status and the tasks' table."""
    queue = status["queue"]
    lines = [f"\ntasks: {queue['open']} open, {queue['assigned']} running, {queue['received']} received "
             f"(waiting for their round), {queue['lost']} lost, {queue['cancelled']} cancelled "
             f"(their islands stop them)"]
    if status["tasks"]:
        lines.append(format_table(["task", "status", "island", "attempt", "base version"],
                                  [[t["task"], t["status"], t["island"] or "-", t["attempt"], t["base"]]
                                   for t in status["tasks"]]))
    return lines


def _traffic_lines(traffic: dict[str, Any]) -> list[str]:
    """The measured store traffic: each direction's bytes and requests by kind, and each process's."""
    if not traffic["by_owner"]:
        return []
    lines = []
    for direction, word in (("up", "written to the store"), ("down", "read from it")):
        kinds = ", ".join(f"{k} {c['bytes'] / 1e6:.3f} MB ({c['requests']})" for k, c in traffic["by_kind"][direction].items())
        lines.append(f"traffic {direction} ({word}): {traffic[f'{direction}_bytes'] / 1e6:.2f} MB in "
                     f"{traffic[f'{direction}_requests']} requests; {kinds or '-'}")
    lines.append("traffic by process (MB up / down): " + ", ".join(
        f"{name} {o['up_bytes'] / 1e6:.2f} / {o['down_bytes'] / 1e6:.2f}" for name, o in traffic["by_owner"].items())
        + (f"; ignored reports: {', '.join(traffic['ignored'])}" if traffic["ignored"] else ""))
    return lines


def status(src: Source, *, watch: float = 0.0, as_json: bool = False, out=print) -> dict[str, Any]:
    """Print the status once, or with `watch` every `watch` seconds until the run is finished; returns
    the last status."""
    clear = "\033[H\033[J" if watch and not as_json else ""
    while True:
        current = collect(src)
        out(json.dumps(current) if as_json else clear + format_status(current))
        if not watch or current["finished"]:
            return current
        time.sleep(watch)


def config_of(run: str | None, config_file: str | None) -> Config | None:
    """The run's config (`--config`, else <run>/config.yaml) when there is one."""
    from dipaco.config import load_config

    if config_file:
        return load_config(config_file)
    if run and (Path(run) / "config.yaml").exists():
        return load_config(Path(run) / "config.yaml")
    return None


def command(args: argparse.Namespace) -> None:
    """`dipaco status`: reads the store only (no config or run directory to prepare)."""
    if args.watch < 0:
        raise ValueError(f"--watch must be >= 0 seconds, got {args.watch}")
    status(source(run=args.run, store=args.store, config=config_of(args.run, args.config)), watch=args.watch,
           as_json=args.json)
