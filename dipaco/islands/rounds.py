"""When a round may close, and which results its outer step applies with what weight (`outer.mode`).

- `sync` (the paper's algorithm): round t closes once every path has reported from version t − 1.
- `async` (Decoupled DiLoCo): round t may close once, for every module, at least
  ceil(outer.quorum × its paths) of its paths have reported from version t − 1; it then waits at
  most `outer.grace_seconds` for the rest. Results that arrive later (their task started from an
  older version b) are applied in a later round t' with their weight × (1 + s) ** −staleness_power,
  s = t' − 1 − b, and dropped when s > outer.max_staleness.

Each result's weight and what the weights are divided by are `dipaco.optim.weighting.result_weights`
(`outer.weighting`, `outer.normalize`; the shard sizes come from the run's shards/index.json).

The outer step itself is `dipaco.optim.outer` (weighted average per module, then Nesterov SGD); a module
no result touches this round is carried over unchanged.

Memory: the outer step streams, module by module and result by result. It reads every result's
metadata (the weights) and its file's header (where each module's bytes lie), then for each module
reads that module's bytes from one contributing result at a time and adds them into a running sum
(`combine_streamed`), and only then reads the module's parameters and momentum. The coordinator so
holds about six copies of one module (the sum, one decoded Δ_p, parameters and momentum before and
after the step, the bytes being written) whatever the grid: bounded by one module × the paths that
share it, and in fact independent of them, where reading whole results held every pseudo-gradient of
the round (paths × a path's size; bench/results/memory.md: 22 MiB against 790 MiB at 8x8). Why this
design rather than decoding each result once and spilling its modules to temporary files: it writes
nothing more, and a ranged read of one module costs what its bytes cost (on object stores one GET
per (result, module)). It needs a result file whose modules can be read alone: float32 safetensors
can be (their header lists each tensor's byte range), and int8 / int4 results hold one zstd frame
per module (`dipaco.store.compress`, format 2). With the weights known before any Δ_p is read, the
sum adds the same floats in the same order as an all-in-memory average: the modules are bit-for-bit
those of the earlier implementation (`tests/test_memory.py`).
"""

from __future__ import annotations

import math

from dipaco.config import OuterConfig
from dipaco.model.topology import Topology
from dipaco.optim.outer import combine_streamed, outer_update
from dipaco.optim.weighting import PathSizes, result_weights
from dipaco.store.board import ResultReader, read_result_meta
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry, RoundManifest, Task


def staleness_weight(staleness: int, *, config: OuterConfig) -> float | None:
    """Multiplier for a result `staleness` versions old; None when it is to be dropped."""
    if staleness < 0:
        raise ValueError(f"a result cannot start from a version newer than the one it is applied to (staleness {staleness})")
    if config.mode == "sync":
        return 1.0 if staleness == 0 else None
    if staleness > config.max_staleness:
        return None
    return (1.0 + staleness) ** -config.staleness_power


def round_ready(topology: Topology, fresh_paths: set[int], *, config: OuterConfig) -> tuple[bool, bool]:
    """(every path has reported, every module has its quorum) for the round being built."""
    all_in = fresh_paths >= set(range(topology.n_paths))
    if config.mode == "sync":
        return all_in, all_in
    quorum = all(
        len(fresh_paths & set(paths)) >= math.ceil(config.quorum * len(paths))
        for paths in (topology.paths_of_module(m) for m in topology.modules)
    )
    return all_in, quorum


def apply_round(store: ModuleStore, topology: Topology, *, round: int, pending: list[Task],
                config: OuterConfig, sizes: PathSizes | None = None) -> RoundManifest:
    """Outer step for `round` from the received, not yet applied tasks `pending`; writes module (and
    momentum) version `round` and returns the manifest of what it applied and dropped (not written).
    Streams module by module (module docstring): memory holds a few copies of one module."""
    applied, dropped, readers = [], [], {}
    for task in sorted(pending, key=lambda t: (t.path, t.base)):
        staleness = round - 1 - task.base
        factor = staleness_weight(staleness, config=config)
        meta = read_result_meta(store, round=task.round, path=task.path, attempt=task.result_attempt)
        entry = ManifestEntry(key=task.key, path=task.path, base=task.base, attempt=task.result_attempt,
                              staleness=staleness, tokens=meta.tokens, seconds=meta.seconds, bytes=meta.bytes,
                              train_loss=meta.train_loss, val_loss_start=meta.val_loss_start, factor=factor)
        if factor is None:
            dropped.append(entry)
            continue
        applied.append(entry)
        readers[task.key] = ResultReader(store, meta)  # reads the header only
    for name in topology.modules:
        paths = set(topology.paths_of_module(name))
        sharing = [entry for entry in applied if entry.path in paths]
        outer_grad = None
        if sharing:
            weights, total = result_weights(sharing, n_paths=topology.n_paths, sizes=sizes, config=config)
            deltas = (readers[e.key].module(name) for e in sharing)  # read one at a time, as the sum needs them
            outer_grad = combine_streamed(deltas, weights, total=total, rescale_by_paths=config.rescale_by_paths)
        params = store.read_module(round - 1, name)
        momentum = store.read_outer_state(round - 1, name)
        if outer_grad is not None:
            params, momentum = outer_update(params, momentum, outer_grad, config)
        del outer_grad
        store.write_module(round, name, params)
        if momentum:
            store.write_outer_state(round, name, momentum)
        del params, momentum
    return RoundManifest(round=round, applied=tuple(applied), dropped=tuple(dropped))
