"""The coordinator service: the single writer of the task board, module versions and outer state.

    dipaco coordinator --config configs/tiny.yaml --run runs/tiny      # islands run elsewhere
    dipaco train       --config configs/tiny.yaml --run runs/tiny      # the same, plus local islands

`Coordinator.tick()` does one pass, and everything it decides it reads back from the store:
1. reads the islands' heartbeats; an island whose `seq` has not changed for `train.heartbeat_timeout`
   seconds (coordinator clock), or that came back as a new incarnation, has lost its task;
2. picks up finished results (one attempt per task is accepted: the current one when it has reported,
   else an older one that reported late);
3. opens a task for every path that has none in flight, from the newest module version;
4. hands a lost task to another island as the next attempt (in async mode a lost task from an old
   version is replaced by one from the newest version);
5. assigns open tasks to idle islands: an island pinned with `--path` only takes its paths, and an
   island prefers the path it trained last (its inner optimiser state is then already local);
6. closes the round when `dipaco.async_outer.round_ready` says so: applies the outer step, writes
   module version t, the round manifest `rounds/round-t.json` (which results were applied), then
   `state.json` (the commit point).

Restarting after a crash resumes from the store: rounds up to the committed one are final, the
applied set is rebuilt from their manifests (nothing is applied twice), and a half-written round t is
written again from the same inputs (in sync mode exactly the same modules).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from dipaco.eval.early_stopping import record_val_losses
from dipaco.islands.rounds import apply_round, round_ready
from dipaco.model.path_model import load_parameters, split_into_modules
from dipaco.stages.context import PathFactory
from dipaco.store.board import (
    TASKS,
    inner_file,
    manifest_file,
    new_task,
    read_board,
    read_heartbeats,
    result_exists,
)

log = logging.getLogger(__name__)


def initialise_store(factory: PathFactory) -> int:
    """Write module version 0 (every module from one seeded dense init, or from the `dipaco pretrain`
    dense model) unless the store has a run.

    Returns the last completed round. A store made for another grid is refused."""
    store, topology = factory.store, factory.topology
    state = store.state()
    if state is not None:
        if state.get("levels") != list(topology.levels) or state.get("modules") != topology.modules:
            raise ValueError(
                f"store {store.url} holds a run with levels {state.get('levels')}, "
                f"but the config asks for {list(topology.levels)}; use another --run or train.store_url"
            )
        return int(state["round"])
    model = factory.new_model(seed=factory.config.train.seed)
    warm_start = factory.run.pretrain / "model.safetensors"
    if factory.config.pretrain.warm_start and warm_start.exists():  # version 0 = the dense pretrained model
        load_parameters(model, warm_start)
        log.info("every module starts from the dense warm start %s", warm_start)
    written: set[str] = set()
    for path in range(topology.n_paths):
        for name, tensors in split_into_modules(model, topology, path=path).items():
            if name not in written:
                store.write_module(0, name, tensors)
                written.add(name)
    store.commit(round=0, levels=list(topology.levels), modules=topology.modules)
    log.info("initialised %d modules for %d paths in %s", len(written), topology.n_paths, store.url)
    return 0


class Coordinator:
    def __init__(self, factory: PathFactory, *, clock: Callable[[], float] = time.monotonic):
        self.factory = factory
        self.config = factory.config
        self.store = factory.store
        self.topology = factory.topology
        self.clock = clock
        self.committed = initialise_store(factory)
        board = read_board(self.store) or {"tasks": {}, "paths": {}}
        self.tasks: dict[str, dict] = board["tasks"]
        self.paths: dict[str, dict] = {str(p): board["paths"].get(str(p), {"steps_done": 0, "inner": None})
                                       for p in range(self.topology.n_paths)}
        self.used: set[str] = set()  # task keys applied or dropped by committed rounds
        for r in range(1, self.committed + 1):
            if self.store.exists(manifest_file(r)):
                manifest = self.store.read_json(manifest_file(r))
                self.used |= {e["key"] for e in manifest["applied"] + manifest["dropped"]}
        for key in [k for k in self.tasks if k in self.used]:
            del self.tasks[key]  # applied by a committed round whose board update was lost in a crash
        self.seen: dict[str, tuple[str, int, float, dict]] = {}  # island -> (incarnation, seq, changed at, beat)
        self.quorum_since: float | None = None
        self.first_beat: float | None = None  # when an island was first seen (goodput counts island time from here)
        self.last_stats: dict[str, Any] | None = None
        self._board_written = _copy(board)  # a copy: self.tasks is mutated in place

    # --- one pass ----------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One pass of the loop; returns True when the run's last round is committed."""
        now = self.clock()
        for name, beat in read_heartbeats(self.store).items():
            key = (beat["incarnation"], beat["seq"])
            if self.first_beat is None:
                self.first_beat = now
            if name not in self.seen or self.seen[name][:2] != key:
                self.seen[name] = (*key, now, beat)
        self._receive()
        if self.committed < self.config.train.rounds:
            self._open_tasks()
            self._reassign_lost(now)
            self._assign(now)
            self._maybe_close(now)
        self._write_board()
        return self.committed >= self.config.train.rounds

    def run_round(self, round: int, *, poll_seconds: float = 0.1, check: Callable[[], None] | None = None) -> dict:
        """Tick until `round` is committed; returns its stats."""
        while self.committed < round:
            self.tick()
            if self.committed >= round:
                break
            if check:
                check()
            time.sleep(poll_seconds)
        return self.last_stats or {}

    # --- steps ---------------------------------------------------------------------------------------
    def alive(self, island: str, now: float) -> bool:
        seen = self.seen.get(island)
        return seen is not None and seen[3].get("status") != "down" and now - seen[2] < self.config.train.heartbeat_timeout

    def _receive(self) -> None:
        steps = self.config.inner.steps
        for task in self.tasks.values():
            if task["status"] not in ("open", "assigned"):
                continue
            for attempt in range(task["attempt"], -1, -1):  # the current attempt first, then late older ones
                if result_exists(self.store, task["round"], task["path"], attempt):
                    task.update(status="received", result_attempt=attempt)
                    self.paths[str(task["path"])] = {"steps_done": task["step_offset"] + steps,
                                                      "inner": inner_file(task["path"], task["round"], attempt)}
                    log.info("received %s (attempt %d)", task["key"], attempt)
                    break

    def _in_flight(self, path: int) -> dict | None:
        for task in self.tasks.values():
            if task["path"] == path and task["status"] in ("open", "assigned"):
                return task
        return None

    def _open_tasks(self) -> None:
        for path in range(self.topology.n_paths):
            if self._in_flight(path) is not None:
                continue
            key = new_task(path=path, base=self.committed, step_offset=0, inner_from=None)["key"]
            if key in self.tasks:
                continue  # this path already reported from the newest version; it waits for the round
            state = self.paths[str(path)]
            self.tasks[key] = new_task(path=path, base=self.committed, step_offset=state["steps_done"],
                                       inner_from=state["inner"])

    def _reassign_lost(self, now: float) -> None:
        for key, task in list(self.tasks.items()):
            if task["status"] != "assigned":
                continue
            island = task["island"]
            seen = self.seen.get(island)
            lost = not self.alive(island, now) or seen[0] != task["incarnation"]
            if not lost:
                continue
            if self.config.outer.mode == "async" and task["base"] < self.committed:
                log.warning("%s: island %s lost it; replaced by a task from version %d", key, island, self.committed)
                task["status"] = "lost"
                state = self.paths[str(task["path"])]
                fresh = new_task(path=task["path"], base=self.committed, step_offset=state["steps_done"],
                                 inner_from=state["inner"])
                self.tasks[fresh["key"]] = fresh
            else:
                log.warning("%s: island %s lost it; attempt %d is open", key, island, task["attempt"] + 1)
                task.update(status="open", island=None, incarnation=None, attempt=task["attempt"] + 1)

    def _assign(self, now: float) -> None:
        busy = {t["island"] for t in self.tasks.values() if t["status"] == "assigned"}
        idle = sorted(name for name, seen in self.seen.items()
                      if name not in busy and self.alive(name, now) and seen[3].get("status") == "idle")
        for task in sorted((t for t in self.tasks.values() if t["status"] == "open"), key=lambda t: (t["base"], t["path"])):
            path = task["path"]

            def rank(name: str, path: int = path) -> tuple:
                beat = self.seen[name][3]
                pinned = beat.get("pinned") or []
                return (0 if path in pinned else 1, 0 if beat.get("last_path") == path else 1, name)

            candidates = [n for n in idle if not self.seen[n][3].get("pinned") or path in self.seen[n][3]["pinned"]]
            if not candidates:
                continue
            island = min(candidates, key=rank)
            idle.remove(island)
            task.update(status="assigned", island=island, incarnation=self.seen[island][0])
            log.info("%s attempt %d -> island %s", task["key"], task["attempt"], island)

    def _maybe_close(self, now: float) -> None:
        fresh = {t["path"] for t in self.tasks.values() if t["status"] == "received" and t["base"] == self.committed}
        all_in, quorum = round_ready(self.topology, fresh, config=self.config.outer)
        if not quorum:
            self.quorum_since = None
            return
        if self.quorum_since is None:
            self.quorum_since = now
        if not all_in and now - self.quorum_since < self.config.outer.grace_seconds:
            return
        self._close()

    def _close(self) -> None:
        round = self.committed + 1
        pending = [t for t in self.tasks.values() if t["status"] == "received" and t["key"] not in self.used]
        outcome = apply_round(self.factory, round, pending)
        manifest = {"round": round, **outcome}
        self.store.write_json(manifest_file(round), manifest)
        self.store.commit(round=round, levels=list(self.topology.levels), modules=self.topology.modules)
        self.committed = round
        self.used |= {e["key"] for e in outcome["applied"] + outcome["dropped"]}
        for key in [k for k, t in self.tasks.items() if k in self.used or t["status"] == "lost"]:
            del self.tasks[key]  # finished business: the manifests keep the record
        self.quorum_since = None
        self._prune(round, outcome["applied"])
        applied = outcome["applied"]
        self.last_stats = {
            "round": round,
            "tokens": sum(e["tokens"] for e in applied),
            "bytes_up": sum(e["bytes"] for e in applied),
            "train_loss": {e["path"]: e["train_loss"] for e in applied},
            "val_loss_start": {e["path"]: e["val_loss_start"] for e in applied},
            "island_seconds": {e["path"]: e["seconds"] for e in applied},
            "applied": len(applied),
            "dropped": len(outcome["dropped"]),
            "stale": sum(1 for e in applied if e["staleness"] > 0),
            "in_flight": sum(1 for t in self.tasks.values() if t["status"] == "assigned"),
        }
        log.info("round %d committed: %d results applied (%d stale), %d dropped", round, len(applied),
                 self.last_stats["stale"], len(outcome["dropped"]))

    def _prune(self, round: int, applied: list[dict]) -> None:
        """Record each applied result's validation loss for the version it started from, then delete
        versions older than `train.keep_rounds` except the modules some path's best version needs."""
        keep = self.config.train.keep_rounds
        if keep and self.config.outer.mode == "async":
            keep = max(keep, self.config.outer.max_staleness + 2)
        keep_from = round - keep + 1 if keep else None
        by_version: dict[int, dict[int, float]] = {}
        for entry in applied:
            by_version.setdefault(entry["base"], {})[entry["path"]] = entry["val_loss_start"]
        for version, losses in sorted(by_version.items()):
            record_val_losses(self.store, self.topology, version=version, losses=losses, keep_from=None)
        if keep_from is None:
            return
        record_val_losses(self.store, self.topology, version=round - 1, losses={}, keep_from=keep_from)
        referenced = {s["inner"] for s in self.paths.values()} | {t["inner_from"] for t in self.tasks.values()}
        for path in range(self.topology.n_paths):
            folder = f"islands/path-{path:04d}"
            if not self.store.exists(folder):
                continue
            for entry in self.store.fs.ls(self.store._path(folder), detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                relative = f"{folder}/{name}"
                if name.startswith("inner-round-") and int(name[12:18]) < keep_from and relative not in referenced:
                    self.store.fs.rm(entry)

    def _write_board(self) -> None:
        board = {"round": self.committed, "tasks": self.tasks, "paths": self.paths}
        if board != self._board_written:
            self.store.write_json(TASKS, board)
            self._board_written = _copy(board)


def goodput(store, *, rounds: int, islands: int, seconds: float) -> dict:
    """Share of the islands' time (islands × wall seconds) spent on inner steps whose results were applied."""
    useful = 0.0
    for r in range(1, rounds + 1):
        if store.exists(manifest_file(r)):
            useful += sum(e["seconds"] for e in store.read_json(manifest_file(r))["applied"])
    total = islands * seconds
    return {"useful_island_seconds": useful, "island_seconds": total, "goodput": useful / total if total else math.nan}


def _copy(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj))
