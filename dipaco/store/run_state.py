"""The run's state in the store: version 0, the committed round and what its commit holds, whether the
run is finished, and the tokens the round manifests applied (goodput: `dipaco.store.goodput`).

    initialise_store(store, topology, {module: tensors}, inner=None)   # version 0, committed as round 0
    committed_round(store, topology)          # None for an empty store; another grid's store is refused
    commit_round(store, topology, 3, board=..., stats=...)            # state.json: the commit point
    board, stats = committed_record(store); run_finished(store); reopen_run(store); first_inner(store)
    applied_tokens(store, n_paths=8)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dipaco.store.board import inner_exists, read_manifest, warm_start_inner_ref, write_inner
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Board, RoundStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class GridShape(Protocol):
    """What identifies a run's grid in `state.json` (`dipaco.model.topology.Topology` is one)."""

    levels: Sequence[int]
    modules: list[str]
    n_paths: int


def initialise_store(store: ModuleStore, topology: GridShape, modules: dict[str, dict[str, torch.Tensor]], *,
                     inner: tuple[dict[str, torch.Tensor], dict] | None = None) -> None:
    """Write module version 0 (`modules`: every module's tensors, in the order to write them) and commit
    round 0. `inner`: an AdamW state every path's first task continues (the warm start's), written first."""
    if inner is not None:
        write_inner(store, warm_start_inner_ref(), *inner)
    for name, tensors in modules.items():
        store.write_module(0, name, tensors)
    commit_round(store, topology, 0)
    log.info("initialised %d modules for %d paths in %s", len(modules), topology.n_paths, store.url)


def commit_round(store: ModuleStore, topology: GridShape, round: int, *, finished: bool = False,
                 **record: Any) -> None:
    """Write state.json (with `record`: the board and the round's stats); `finished` marks the run's last
    round (islands stop when they read it)."""
    extra = {"finished": True} if finished else {}
    store.commit(round=round, levels=list(topology.levels), modules=topology.modules, **record, **extra)


def committed_round(store: ModuleStore, topology: GridShape) -> int | None:
    """The store's last completed round, None for an empty store; a store made for another grid is refused."""
    state = store.state()
    if state is None:
        return None
    if state.get("levels") != list(topology.levels) or state.get("modules") != topology.modules:
        raise ValueError(
            f"store {store.url} holds a run with levels {state.get('levels')}, "
            f"but the config asks for {list(topology.levels)}; use another --run or store.url"
        )
    return int(state["round"])


def committed_record(store: ModuleStore) -> tuple[Board | None, RoundStats | None]:
    """The board and the round stats the last commit holds (None for a store committed without them)."""
    state = store.state() or {}
    file = store.location("state.json")
    board = Board.from_json(state["board"], file=file, where="board") if "board" in state else None
    stats = RoundStats.from_json(state["stats"], file=file, where="stats") if "stats" in state else None
    return board, stats


def run_finished(store: ModuleStore) -> bool:
    """Has the coordinator committed the run's last round (every path has had run.rounds results applied)?"""
    state = store.state()
    return bool(state and state.get("finished"))


def reopen_run(store: ModuleStore) -> None:
    """A finished run whose length grew (a larger run.rounds) goes on: state.json no longer says `finished`,
    so islands, which stop on `run_finished`, work again. The commit itself (round, board, stats) is kept."""
    state = store.state()
    if state and state.get("finished"):
        store.rewrite_state({k: v for k, v in state.items() if k != "finished"})
        log.info("store %s: the finished run goes on: the config plans more inner steps per path (run.rounds x "
                 "inner.steps) than its paths have had applied", store.url)


def first_inner(store: ModuleStore) -> str | None:
    """The inner state a path's first task starts from: the warm start's when `initialise_store` wrote one."""
    ref = warm_start_inner_ref()
    return ref if inner_exists(store, ref) else None


def applied_tokens(store: ModuleStore, n_paths: int) -> list[int] | None:
    """The tokens each path trained in results the committed rounds applied (from their manifests); None
    when a committed round has no manifest (a store written before manifests existed)."""
    tokens = [0] * n_paths
    for r in range(1, store.current_round() + 1):
        manifest = read_manifest(store, r)
        if manifest is None:
            return None
        for entry in manifest.applied:
            tokens[entry.path] += entry.tokens
    return tokens

