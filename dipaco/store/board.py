"""The task board: the files through which the coordinator hands out work and islands report.

Every file has exactly one writer:

    tasks.json                                    coordinator: every task, its attempt and its island
    rounds/round-000004.json                      coordinator: which results round 4's outer step applied
    heartbeats/<island>.json                      island <island>: alive, idle or training, what it trained
    results/round-000004/path-0002[.a1].json      the island running attempt 1 of (path 2, round 4)
    results/round-000004/path-0002[.a1].<ext>     its pseudo-gradient (.safetensors, .int8.zst, .int4.zst)
    islands/path-0002/inner-round-000004[.a1].safetensors   its inner AdamW state after the task

A task is "train path p for inner.steps steps from module version b" (it is meant for round b + 1).
Attempt 0 keeps the pre-task-board file names, so a result written by `dipaco island --path P` is
picked up. A task handed to another island (its island stopped heart-beating, or came back as a new
incarnation) gets the next attempt number and so its own files: a late result from the old attempt
never overwrites anything, and the coordinator accepts exactly one attempt per task.

Islands say they are alive by bumping `seq` in their heartbeat; the coordinator times heartbeats with
its own clock (when it last saw `seq` change), so island clocks need not agree.
"""

from __future__ import annotations

from typing import Any

import torch

from dipaco.store.compress import compress, decompress
from dipaco.store.module_store import ModuleStore, StoreError

TASKS = "tasks.json"
EXTENSIONS = {"none": ".safetensors", "int8": ".int8.zst", "int4": ".int4.zst"}


def task_key(path: int, base: int) -> str:
    return f"path-{path:04d}-round-{base + 1:06d}"


def _suffix(attempt: int) -> str:
    return "" if attempt == 0 else f".a{attempt}"


def result_stem(round: int, path: int, attempt: int) -> str:
    return f"results/round-{round:06d}/path-{path:04d}{_suffix(attempt)}"


def inner_file(path: int, round: int, attempt: int) -> str:
    return f"islands/path-{path:04d}/inner-round-{round:06d}{_suffix(attempt)}.safetensors"


def heartbeat_file(island: str) -> str:
    return f"heartbeats/{island}.json"


def manifest_file(round: int) -> str:
    return f"rounds/round-{round:06d}.json"


def new_task(*, path: int, base: int, step_offset: int, inner_from: str | None) -> dict[str, Any]:
    return {
        "key": task_key(path, base), "path": path, "base": base, "round": base + 1, "attempt": 0,
        "status": "open", "island": None, "incarnation": None, "step_offset": step_offset,
        "inner_from": inner_from, "result_attempt": None,
    }


# --- results ---------------------------------------------------------------------------------------
def write_result(store: ModuleStore, task: dict, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                 compression: str, level: int) -> dict:
    """Upload a pseudo-gradient (compressed) then its JSON (the commit); returns the compression stats."""
    stem = result_stem(task["round"], task["path"], task["attempt"])
    data, stats = compress(tensors, method=compression, level=level)
    name = stem + EXTENSIONS[compression]
    store.write_bytes(name, data)
    store.write_json(stem + ".json", {**meta, "bytes": len(data), "compression": compression,
                                      "file": name.rsplit("/", 1)[-1], "attempt": task["attempt"]})
    return stats


def result_exists(store: ModuleStore, round: int, path: int, attempt: int) -> bool:
    return store.exists(result_stem(round, path, attempt) + ".json")


def read_result(store: ModuleStore, round: int, path: int, attempt: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A result's float32 pseudo-gradient and metadata (a pre-task-board result is plain safetensors)."""
    stem = result_stem(round, path, attempt)
    meta = store.read_json(stem + ".json")
    method = meta.get("compression", "none")
    folder = stem.rsplit("/", 1)[0]
    name = f"{folder}/{meta['file']}" if "file" in meta else stem + EXTENSIONS["none"]
    data = store.read_bytes(name)
    try:
        tensors, _ = decompress(data, method=method)
    except Exception as err:  # zstd / safetensors raise their own error types
        raise StoreError(f"store file {store._path(name)} is not a valid {method} pseudo-gradient: {err}") from None
    return tensors, meta


# --- inner optimiser state -------------------------------------------------------------------------
def write_inner(store: ModuleStore, relative: str, tensors: dict[str, torch.Tensor], meta: dict) -> int:
    """An inner AdamW state: tensors, with its metadata in the safetensors header."""
    return store.write_tensors_with_meta(relative, tensors, meta)


def read_inner(store: ModuleStore, relative: str) -> tuple[dict[str, torch.Tensor], dict]:
    return store.read_tensors_with_meta(relative)


# --- the board -------------------------------------------------------------------------------------
def read_board(store: ModuleStore) -> dict[str, Any] | None:
    return store.read_json(TASKS) if store.exists(TASKS) else None


def read_heartbeats(store: ModuleStore) -> dict[str, dict]:
    """Every island's latest heartbeat, by island name."""
    if not store.exists("heartbeats"):
        return {}
    beats = {}
    for entry in store.fs.ls(store._path("heartbeats"), detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not name.endswith(".json"):
            continue  # a temporary file of a write in progress
        try:
            beat = store.read_json(f"heartbeats/{name}")
        except StoreError:
            continue  # removed or half-visible on an eventually consistent store: next poll
        beats[beat["island"]] = beat
    return beats
