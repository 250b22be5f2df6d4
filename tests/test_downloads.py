"""Compressed downloads (`compression.download: update`): every committed version is its predecessor minus the
published update, rebuilt here in numpy from the update files alone and compared with the committed bytes; the
islands read whole modules only when they join, the rest arrives as updates; the download residual adds up
(Σ d + r_final = Σ u) and the last version flushes it; a missing update is the counted fallback; codec none
commits the float32 outer step; async runs with it."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy
from tiny_runs import Clock, drive, make_run

from dipaco.codec.codec import Codec
from dipaco.codec.update import FLOAT32, decode_update
from dipaco.islands.coordinator.downloads import UpdatePublisher
from dipaco.islands.island.polling import IslandWorker
from dipaco.stages.island import island_setup
from dipaco.store.board import read_manifest
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import RoundStats

TOPK = ["compression.codec=topk", "compression.density=0.1", "compression.bits=4", "store.keep_versions=0"]


def _islands(run, clock, n):
    """`n` islands, each with its own store client (its own byte counts)."""
    setups = [island_setup(run.config, run.dir) for _ in range(n)]
    return setups, [IslandWorker(s, name=f"i{k}", clock=clock) for k, s in enumerate(setups)]


def _module_file(run, version, name) -> bytes:
    return (run.dir.root / "store" / "modules" / run.store.version_name(version) / f"{name}.safetensors").read_bytes()


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
    """A tiny sync run with topk, one island per path (each with its own store client); once round 2 is
    committed, one update of version 2 is deleted: (run, setups, islands, the module whose update it was)."""
    run = make_run(tiny_routed, tmp_path_factory.mktemp("downloads") / "run", ["run.rounds=3", *TOPK])
    clock = Clock()
    setups, islands = _islands(run, clock, run.topology.n_paths)
    coordinator = run.coordinator(clock)
    drive(coordinator, islands, clock, until_round=2)
    name = next(m for m in run.topology.modules if _update(run, 2, m) is not None)
    (run.dir.root / "store" / "updates" / run.store.version_name(2) / f"{name}.topk.safetensors").unlink()
    drive(coordinator, islands, clock)
    return run, setups, islands, name


def test_versions_are_rebuilt_from_their_updates(topk_run):
    """For every version, the previous one minus the decoded update (numpy) has the committed bytes and sha;
    a module with no update is unchanged."""
    run = topk_run[0]
    last = run.store.current_round()
    assert last == 3
    updated = 0
    for version in range(1, last + 1):
        sums = json.loads((run.dir.root / "store" / "modules" / run.store.version_name(version) /
                           "checksums.json").read_text())
        for name in run.topology.modules:
            before, after = load_numpy(_module_file(run, version - 1, name)), _module_file(run, version, name)
            found = _update(run, version, name)
            if found is None:  # unchanged (or the update deleted by the fixture: checked below)
                if (version, name) != (2, topk_run[3]):
                    assert {k: v.tobytes() for k, v in load_numpy(after).items()} == \
                           {k: v.tobytes() for k, v in before.items()}, (version, name)
                continue
            data, codec = found
            d = decode_update(data, module=name, codec=codec, shapes={k: list(v.shape) for k, v in before.items()})
            rebuilt = save_numpy({k: (before[k] - d[k].numpy()).astype(np.float32) for k in sorted(before)})
            assert {k: v.tobytes() for k, v in load_numpy(rebuilt).items()} == \
                   {k: v.tobytes() for k, v in load_numpy(after).items()}, (version, name)
            assert hashlib.sha256(after).hexdigest() == sums[f"{name}.safetensors"]
            updated += 1
    assert updated >= 2 * len(run.topology.modules)


def test_islands_read_whole_modules_only_when_they_join_or_fall_back(topk_run):
    """Each island's `module` down bytes are its joining read (the version-0 files of its path) plus, for the
    islands holding the module whose update was deleted, that module at version 2: each counted as a fallback,
    in its island and in round 3's stats. The rest came as `module_update`."""
    run, setups, islands, deleted = topk_run
    store = run.dir.root / "store" / "modules"
    fell_back = 0
    for setup, island in zip(setups, islands):
        held = sorted(island.modules.modules)  # one path's modules
        assert any(held == sorted(run.topology.modules_of_path(p)) for p in range(run.topology.n_paths)), held
        joined = sum((store / "round-000000" / f"{m}.safetensors").stat().st_size for m in held)
        fallback = (store / run.store.version_name(2) / f"{deleted}.safetensors").stat().st_size
        counts = setup.store.traffic.counts()
        expected = deleted in held
        assert counts.bytes("down", "module") == joined + (fallback if expected else 0), island.presence
        assert counts.bytes("down", "module_update") > 0
        assert island.modules.fallbacks == int(expected)
        fell_back += expected
        for m, (version, _, sha) in island.modules.modules.items():  # what it holds is what was committed
            assert version == 2 and sha == run.store.module_checksum(2, m)
    assert fell_back == len(run.topology.paths_of_module(deleted)) >= 1
    stats = RoundStats.of(read_manifest(run.store, 3), in_flight=0)
    assert stats.module_fallbacks == fell_back


def test_the_last_version_flushes_the_download_residual(topk_run):
    """The last version's updates are float32 (the residual sent whole): their bytes are the manifest's, no
    residual is left, and before it the residual was reported."""
    run = topk_run[0]
    manifests = [read_manifest(run.store, r) for r in (1, 2, 3)]
    assert not manifests[0].downloads.flush and manifests[-1].downloads.flush
    assert all(0 < m.downloads.residual_max for m in manifests)
    folder = run.dir.root / "store" / "updates" / run.store.version_name(3)
    files = sorted(folder.iterdir())
    assert files and all(f.name.endswith(".safetensors") and ".topk." not in f.name for f in files)
    assert manifests[-1].downloads.bytes == sum(f.stat().st_size for f in files)
    assert not list((run.dir.root / "store" / "outer" / run.store.version_name(3)).glob("*.residual.safetensors"))
    assert list((run.dir.root / "store" / "outer" / run.store.version_name(2)).glob("*.residual.safetensors"))


def _steps(seed: int, rounds: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A module θ_0 and `rounds` outer steps u_t (random)."""
    g = torch.Generator().manual_seed(seed)
    theta = {"a.weight": torch.randn(64, 48, generator=g), "b.bias": torch.randn(48, generator=g)}
    return theta, [{k: 0.01 * torch.randn(v.shape, generator=g) for k, v in theta.items()} for _ in range(rounds)]


def test_residual_accounting_and_the_flush(tmp_path):
    """Publishing after = before − u_t round after round (topk, 10%): Σ d_t + r_T = Σ u_t (numpy), each
    version is before − d_t, and the flushed last version is before − (u_T + r_{T−1}) exactly in float32."""
    store = ModuleStore(str(tmp_path / "store"))
    theta, steps = _steps(0, 4)
    codec = Codec.of("topk", level=1, density=0.1, bits=4, chunk=256)
    sent = {k: np.zeros(v.shape) for k, v in theta.items()}
    total = {k: np.zeros(v.shape) for k, v in theta.items()}
    for t, step in enumerate(steps, start=1):
        final = t == len(steps)
        before = {k: v.numpy().copy() for k, v in theta.items()}
        residual = {k: v.numpy().copy() for k, v in store.read_download_residual(t - 1, "m").items()}
        after = {k: theta[k] - step[k] for k in theta}
        u = {k: before[k] - after[k].numpy() for k in theta}  # the outer step, float32
        publisher = UpdatePublisher(store, codec=codec, final=final)
        theta = publisher.publish(t, "m", before=theta, after=after)
        data, used = _stored_update(tmp_path, t), (FLOAT32 if final else codec)
        d = decode_update(data, module="m", codec=used, shapes={k: list(v.shape) for k, v in before.items()})
        for k in before:
            assert np.array_equal(theta[k].numpy(), (before[k] - d[k].numpy()).astype(np.float32))
            sent[k] += d[k].numpy()
            total[k] += u[k]
        if final:  # u + r in full, float32
            assert residual  # the lossy rounds before left one
            for k in before:
                assert np.array_equal(theta[k].numpy(), before[k] - (u[k] + residual[k]))
            assert publisher.summary().flush and store.read_download_residual(t, "m") == {}
        else:
            assert publisher.summary().residual_max > 0
    for k in theta:
        np.testing.assert_allclose(sent[k], total[k], atol=1e-5)  # Σ d + r_final (0 after the flush) = Σ u


def test_residual_accounting_without_the_flush(tmp_path):
    """Before the last version: Σ_t d_t + r_t = Σ_t u_t, with r_t the residual stored beside the outer state."""
    store = ModuleStore(str(tmp_path / "store"))
    theta, steps = _steps(1, 3)
    codec = Codec.of("int4", level=1, density=0.1, bits=4, chunk=256)
    sent = {k: np.zeros(v.shape) for k, v in theta.items()}
    for t, u in enumerate(steps, start=1):
        before = {k: v.clone() for k, v in theta.items()}
        theta = UpdatePublisher(store, codec=codec, final=False).publish(t, "m", before=theta,
                                                                         after={k: theta[k] - u[k] for k in theta})
        for k in theta:
            sent[k] += (before[k] - theta[k]).double().numpy()
    left = store.read_download_residual(len(steps), "m")
    assert left
    for k in theta:
        np.testing.assert_allclose(sent[k] + left[k].double().numpy(),
                                   sum(u[k].double().numpy() for u in steps), atol=1e-5)


def test_codec_none_commits_the_float32_outer_step(tmp_path):
    """Codec none: d is u's float32 bytes exactly, the committed version the outer step's to float rounding,
    and no residual is kept."""
    store = ModuleStore(str(tmp_path / "store"))
    theta, (u,) = _steps(2, 1)
    after = {k: theta[k] - u[k] for k in theta}
    committed = UpdatePublisher(store, codec=Codec("none"), final=False).publish(1, "m", before=theta, after=after)
    d = load_numpy(_stored_update(tmp_path, 1))
    for k in theta:
        assert d[f"m/{k}"].tobytes() == (theta[k] - after[k]).numpy().astype(np.float32).tobytes()
        np.testing.assert_allclose(committed[k].numpy(), after[k].numpy(), rtol=0, atol=1e-6)
    assert store.read_download_residual(1, "m") == {}


def _stored_update(root, version: int) -> bytes:
    (found,) = (root / "store" / "updates" / f"round-{version:06d}").iterdir()
    return found.read_bytes()
