"""Compressed downloads (`compression.download: update`): every committed version is its predecessor minus the
published update, rebuilt here in numpy from the update files alone and compared with the committed bytes; the
islands read whole modules only when they join, the rest arrives as updates; the download residual adds up
(Σ d + r_final = Σ u) and the last version flushes it; a missing update is the counted fallback; codec none
commits the float32 outer step; async runs with it."""

import hashlib
import io
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy
from tiny_runs import Clock, drive, make_run

from dipaco.codec.codec import Codec
from dipaco.codec.update import FLOAT32, decode_update
from dipaco.islands.island.polling import IslandWorker
from dipaco.stages.island import island_setup
from dipaco.store.board import read_manifest

TOPK = ["compression.codec=topk", "compression.density=0.1", "compression.bits=4", "store.keep_versions=0"]


def _islands(run, clock, n):
    """`n` islands, each with its own store client (its own byte counts)."""
    setups = [island_setup(run.config, run.dir) for _ in range(n)]
    return setups, [IslandWorker(s, name=f"i{k}", clock=clock) for k, s in enumerate(setups)]


def _train(tiny_routed, root, overrides, *, n=None):
    run = make_run(tiny_routed, root, overrides)
    clock = Clock()
    setups, islands = _islands(run, clock, n or run.topology.n_paths)
    coordinator = run.coordinator(clock)
    drive(coordinator, islands, clock)
    return run, setups, islands


def _module_file(run, version, name) -> bytes:
    return (run.dir.root / "store" / "modules" / run.store.version_name(version) / f"{name}.safetensors").read_bytes()


def _numpy_module(data: bytes) -> dict[str, np.ndarray]:
    return load_numpy(data)


def _update(run, version, name):
    """(the update's bytes, its codec) of module `name` in version `version`, None when it has none."""
    folder = run.dir.root / "store" / "updates" / run.store.version_name(version)
    config = run.config.compression
    codec = Codec.of(config.codec, level=config.zstd_level, density=config.density, bits=config.bits,
                     chunk=config.chunk)
    for c in (codec, FLOAT32):
        f = folder / f"{name}{c.suffix}"
        if f.exists():
            return f.read_bytes(), c
    return None


@pytest.fixture(scope="module")
def topk_run(tiny_routed, tmp_path_factory):
    """A tiny sync run with topk, its islands (one per path) and their store clients."""
    return _train(tiny_routed, tmp_path_factory.mktemp("downloads") / "run", ["run.rounds=3", *TOPK])


def test_versions_are_rebuilt_from_their_updates(topk_run):
    """For every version, the previous one minus the decoded update (numpy) has the committed bytes and sha."""
    run, _, _ = topk_run
    last = run.store.current_round()
    assert last == 3
    updated = 0
    for version in range(1, last + 1):
        sums = json.loads((run.dir.root / "store" / "modules" / run.store.version_name(version) /
                           "checksums.json").read_text())
        for name in run.topology.modules:
            before, after = _numpy_module(_module_file(run, version - 1, name)), _module_file(run, version, name)
            found = _update(run, version, name)
            if found is None:  # unchanged: no update was written
                assert _numpy_module(after).keys() == before.keys()
                assert all(np.array_equal(_numpy_module(after)[k], before[k]) for k in before)
                continue
            data, codec = found
            d = decode_update(data, module=name, codec=codec, shapes={k: list(v.shape) for k, v in before.items()})
            rebuilt = save_numpy({k: (before[k] - d[k].numpy()).astype(np.float32) for k in sorted(before)})
            assert {k: v.tobytes() for k, v in _numpy_module(rebuilt).items()} == \
                   {k: v.tobytes() for k, v in _numpy_module(after).items()}, (version, name)
            assert hashlib.sha256(after).hexdigest() == sums[f"{name}.safetensors"]
            updated += 1
    assert updated >= run.topology.n_paths  # every round changed modules


def test_islands_read_whole_modules_only_when_they_join(topk_run):
    """Each island's `module` down bytes are its joining read: the version-0 files of its path; the rest came
    as `module_update`; train.json-facing counts say no fallback was taken."""
    run, setups, islands = topk_run
    for setup, island in zip(setups, islands):
        counts = setup.store.traffic.counts()
        paths = {p for _, p in island.presence.done} if hasattr(island.presence, "done") else None
        held = sorted(island.modules.modules)
        assert held, island
        joined = sum((run.dir.root / "store" / "modules" / "round-000000" / f"{m}.safetensors").stat().st_size
                     for m in held)
        assert counts.bytes("down", "module") == joined, (island, paths)
        assert counts.bytes("down", "module_update") > 0
        assert island.modules.fallbacks == 0
    stats = [read_manifest(run.store, r) for r in range(1, 4)]
    assert all(m.downloads is not None and m.downloads.bytes > 0 for m in stats)
    assert stats[-1].downloads.flush and not stats[0].downloads.flush
