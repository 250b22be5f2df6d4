"""Downloads as the round's results (`compression.download: results`, SparseLoCo's all-gather): where the outer
step is a plain average, every committed version is its predecessor minus the weighted sum of the results'
decoded bytes, which the published file copies unchanged from the result files (checked here in numpy against
the result files themselves); each island downloads only the other islands' contributions (its own bytes it
kept), rebuilds every version to its checksum, and reads whole modules only when it joins; a round that is not a
plain average publishes an encoded update instead, which the islands apply as well."""

import json
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load as load_numpy
from tiny_runs import Clock, drive, make_run

from dipaco.codec.compress import decompress
from dipaco.islands.island.polling import IslandWorker
from dipaco.stages.island import island_setup
from dipaco.store.board import read_manifest

TOPK = ["compression.codec=topk", "compression.density=0.1", "compression.bits=4", "store.keep_versions=0",
        "compression.download=results", "outer.weighting=uniform"]
PLAIN = ["outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false"]


def _gathered_run(routed, root, overrides):
    """A tiny sync run of 3 rounds, one island per path, each island with its own store client."""
    run = make_run(routed, root, ["run.rounds=3", *TOPK, *overrides])
    clock = Clock()
    setups = [island_setup(run.config, run.dir) for _ in range(run.topology.n_paths)]
    islands = [IslandWorker(s, name=f"i{k}", clock=clock) for k, s in enumerate(setups)]
    drive(run.coordinator(clock), islands, clock)
    return run, setups, islands


@pytest.fixture(scope="module")
def plain_run(tiny_routed, tmp_path_factory):
    return _gathered_run(tiny_routed, tmp_path_factory.mktemp("gather") / "run", PLAIN)


def _contributions(run, version, name):
    """(the file's path, its metadata's contributions) of module `name`'s version `version`, None without one."""
    f = run.dir.root / "store" / "updates" / run.store.version_name(version) / f"{name}.results.safetensors"
    if not f.exists():
        return None
    with safe_open(f, "np") as opened:
        return f, json.loads(opened.metadata()["dipaco"])["contributions"]


def _module(run, version, name):
    return load_numpy((run.dir.root / "store" / "modules" / run.store.version_name(version)
                       / f"{name}.safetensors").read_bytes())


def test_versions_are_the_weighted_results_bytes(plain_run):
    """Each version of each module a result touched: the file's entries are the result files' bytes at the
    listed spans, the weights are uniform over them, and the committed module is the previous one minus their
    weighted sum (decoded from the result files, in numpy)."""
    run = plain_run[0]
    assert run.store.current_round() == 3
    checked = 0
    for version in range(1, 4):
        manifest = read_manifest(run.store, version)
        assert manifest.downloads.gathered == manifest.downloads.modules > 0
        for name in run.topology.modules:
            found = _contributions(run, version, name)
            before, after = _module(run, version - 1, name), _module(run, version, name)
            if found is None:
                assert all(np.array_equal(before[k], after[k]) for k in before), (version, name)
                continue
            f, entries = found
            stored = load_numpy(f.read_bytes())
            total = {k: np.zeros_like(v, dtype=np.float32) for k, v in before.items()}
            for i, entry in enumerate(entries):
                result = (run.dir.root / "store" / entry["file"]).read_bytes()
                assert stored[str(i)].tobytes() == result[entry["start"]:entry["end"]]
                assert entry["weight"] == pytest.approx(1 / len(entries))
                delta = decompress(result, method=entry["method"])[0]
                for k in total:
                    total[k] += np.float32(entry["weight"]) * delta[f"{name}/{k}"].numpy()
            for k in before:
                np.testing.assert_allclose(after[k], before[k] - total[k], rtol=1e-6, atol=1e-7)
            checked += 1
    assert checked >= 2 * len(run.topology.modules)


def test_islands_download_only_the_other_islands_results(plain_run):
    """An island's module_update bytes are, per version and module of its path, the file's 8-byte length and
    header plus the spans of the contributions it did not upload; it reads whole modules only when it joins,
    takes no fallback, and holds each module at the last version's checksum."""
    run, setups, islands = plain_run
    store = run.dir.root / "store"
    for setup, island in zip(setups, islands, strict=True):
        held = sorted(island.modules.modules)
        path = next(p for p in range(run.topology.n_paths) if held == sorted(run.topology.modules_of_path(p)))
        mine = {f"results/{d.name}/{f.name}" for d in (store / "results").iterdir() for f in d.iterdir()
                if f.name.startswith(f"path-{path:04d}") and not f.name.endswith(".json")}
        expected = 0
        for version in (1, 2):  # its tasks' bases: 0 (the joining read), then 1 and 2 rebuilt
            for name in held:
                found = _contributions(run, version, name)
                if found is None:
                    continue
                f, entries = found
                (length,) = struct.unpack("<Q", f.read_bytes()[:8])
                others = [e for e in entries if e["file"] not in mine]
                assert len(others) < len(entries)  # its own result is one of them
                expected += 8 + length + sum(e["end"] - e["start"] for e in others)
        counts = setup.store.traffic.counts()
        joined = sum((store / "modules" / "round-000000" / f"{m}.safetensors").stat().st_size for m in held)
        assert counts.bytes("down", "module") == joined
        assert counts.bytes("down", "module_update") == expected
        assert island.modules.fallbacks == 0
        for m, (version, _, sha) in island.modules.modules.items():
            assert version == 2 and sha == run.store.module_checksum(2, m)


def test_a_round_that_is_not_a_plain_average_publishes_an_update(tiny_routed, tmp_path):
    """Under the tiny config's Nesterov step, no round gathers: every changed module publishes an encoded
    update (with its download residual), and the islands rebuild each version from them without a fallback."""
    run, _, islands = _gathered_run(tiny_routed, tmp_path / "run", [])
    for version in range(1, 4):
        downloads = read_manifest(run.store, version).downloads
        assert downloads.gathered == 0 and downloads.modules > 0
    folder = run.dir.root / "store" / "updates" / run.store.version_name(2)
    assert any(f.name.endswith(".topk.safetensors") for f in folder.iterdir())
    assert not any(f.name.endswith(".results.safetensors") for f in folder.iterdir())
    assert all(island.modules.fallbacks == 0 for island in islands)


def test_async_islands_rebuild_every_version_from_the_results(tiny_routed, tmp_path):
    """Async, one island polling every turn and three every third: a round gathers a chain of one path's results
    beside the others'; every island still rebuilds each version it starts from to its checksum, without a
    fallback."""
    run = make_run(tiny_routed, tmp_path / "run", ["run.rounds=3", "inner.steps=2", "rounds.mode=async",
                                                   "rounds.quorum=0.5", "rounds.grace_seconds=0", *TOPK, *PLAIN])
    clock = Clock()
    islands = [run.island(f"i{k}", clock, pinned=[k]) for k in range(run.topology.n_paths)]
    coordinator = run.coordinator(clock)
    for turn in range(2000):
        if coordinator.tick():
            break
        for k, island in enumerate(islands):
            if k == 0 or turn % 3 == 0:
                island.poll()
        clock.t += 0.5
    else:
        raise AssertionError(f"the run did not finish (round {coordinator.committed})")
    rounds = run.store.current_round()
    manifests = [read_manifest(run.store, v) for v in range(1, rounds + 1)]
    assert sum(m.downloads.gathered for m in manifests) > 0
    assert any(e.link > 0 for m in manifests for e in m.applied)  # a round gathered a chain of one path's results
    for island in islands:
        assert island.modules.fallbacks == 0
        for m, (version, _, sha) in island.modules.modules.items():
            assert sha == run.store.module_checksum(version, m)
