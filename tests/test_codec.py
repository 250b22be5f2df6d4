"""The codec package (`dipaco.codec`): its one registry of names is `compression.codec`'s allowed values;
every codec round-trips within its bound and its byte count is the size of the file the store holds; and
SparseLoCo's decaying error-feedback accumulator (`compression.ef_decay`) against an independent numpy
recursion, on the island and, with the outer momentum kept (`outer.decay: keep`), in the outer step."""

import dataclasses
import math
import re
import typing
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_sparse import reference_topk
from tiny_runs import Clock, drive, make_run

from dipaco.carried.state import CarriedState
from dipaco.codec.codec import Codec
from dipaco.codec.compress import Q_MAX
from dipaco.codec.feedback import encode_with_feedback, with_residual
from dipaco.codec.registry import NAMES, codec_info
from dipaco.codec.sparse import TopK
from dipaco.config import CompressionConfig, load_config
from dipaco.islands.coordinator.service import CoordinatorSettings
from dipaco.islands.island.training import push_result, train_task
from dipaco.store.board import read_inner, read_manifest, read_result, write_result
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ResultMeta, Task

SPARSELOCO = ["compression.codec=topk", "compression.density=0.05", "compression.bits=2", "compression.chunk=256",
              "compression.ef_decay=0.8"]


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


def test_the_codec_registry_names_are_the_configs_allowed_values():
    """The config's `Literal` (what its validator and docs/configuration.md read) is the registry's names; each
    loads, another is refused naming them; each has its own file suffix."""
    hint = typing.get_type_hints(CompressionConfig, include_extras=True)["codec"]
    assert typing.get_args(hint) == NAMES and len(NAMES) >= 4
    for name in NAMES:
        assert load_config(None, [f"compression.codec={name}"]).compression.codec == name
    with pytest.raises(ValueError, match=re.escape(f"compression.codec must be one of {list(NAMES)}, got 'int2'")):
        load_config(None, ["compression.codec=int2"])
    suffixes = [codec_info(name).suffix for name in NAMES]
    assert len(set(suffixes)) == len(NAMES) and all(s.endswith(".safetensors") for s in suffixes)
    with pytest.raises(ValueError, match=re.escape(f"unknown codec 'int2'; codecs are {list(NAMES)}")):
        codec_info("int2")


def _delta() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"level0.module0/w": torch.randn(24, 50, generator=g) * torch.logspace(-5, -2, 24)[:, None],
            "embeddings/b": torch.randn(300, generator=g) * 1e-3}


def _bound(name: str, codec: Codec, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(numpy's expected decoding or None, the largest error allowed per element) for codec `name`."""
    if name == "none":
        return x, np.zeros_like(x)
    if name == "topk":
        spec = codec.topk
        decoded, kept, steps = reference_topk(x, density=spec.density, bits=spec.bits, chunk=spec.chunk)
        return decoded.reshape(x.shape), np.where(kept, steps / 2, np.abs(x.reshape(-1))).reshape(x.shape) + 1e-7
    rows = x.reshape(x.shape[0] if x.ndim >= 2 else 1, -1)
    half_step = np.abs(rows).max(axis=1, keepdims=True) / Q_MAX[name] / 2  # each row's scale / 2
    return None, np.broadcast_to(half_step, rows.shape).reshape(x.shape) * (1 + 1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_every_codec_round_trips_within_its_bound_and_its_byte_count_is_the_file_in_the_store(tmp_path, name):
    codec = Codec.of(name, level=1, density=0.05, bits=2, chunk=256)  # top-k: SparseLoCo's 2 bits
    delta = _delta()
    data, stats = codec.encode(delta)
    back = codec.decode(data, shapes={k: list(v.shape) for k, v in delta.items()})
    for key, tensor in delta.items():
        x = tensor.numpy()
        expected, bound = _bound(name, codec, x)
        error = np.abs(back[key].numpy() - x)
        assert back[key].dtype == torch.float32 and (error <= bound).all(), (key, float((error - bound).max()))
        if expected is not None:
            np.testing.assert_allclose(back[key].numpy(), expected, rtol=0, atol=1e-7)
    store = ModuleStore(str(tmp_path / "store"))
    task = Task.open(path=1, base=2, step_offset=0, inner_from=None)  # round 3
    meta = ResultMeta(path=1, round=3, base=2, attempt=0, tokens=10, train_loss=2.5, losses=(2.5,), val_loss_start=3.0,
                      seconds=1.0, bytes_down_modules=0, bytes_down_inner=0, inner_state_local=False,
                      data_parallel_ranks=1)
    written, _ = write_result(store, task, delta, meta, compression=name, level=1, topk=codec.topk)
    on_disk = tmp_path / "store" / "results" / "round-000003" / written.file
    assert written.file == "path-0001" + codec.suffix
    assert stats["bytes"] == len(data) == written.bytes == on_disk.stat().st_size
    assert on_disk.read_bytes() == data  # the same bytes: the codec is deterministic
    assert stats["raw_bytes"] == sum(t.numel() * 4 for t in delta.values())


def test_the_decaying_accumulator_matches_a_numpy_recursion_over_three_rounds():
    """SparseLoCo's recipe (chunks of 4096, 2% kept, 2 bits, β = 0.8): e_t = β e_{t−1} + Δ_t, send
    topk(e_t), e_t −= what the bytes decode to; numpy runs the same recursion with its own top-k. Each
    chunk sends exactly k = ceil(2% of it) entries."""
    beta, spec = 0.8, TopK(density=0.02, bits=2, chunk=4096)
    codec = Codec("topk", topk=spec)
    g = torch.Generator().manual_seed(5)
    shapes = {"a/w": (64, 200), "b/v": (4096,)}  # 12,800 = 3 chunks + one of 512; one whole chunk
    updates = [{k: torch.randn(*s, generator=g) * 1e-3 for k, s in shapes.items()} for _ in range(3)]
    residual: dict[str, torch.Tensor] = {}
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    for delta in updates:
        data, _, residual = encode_with_feedback(with_residual(delta, residual, decay=beta), codec=codec)
        decoded = codec.decode(data)
        for key, tensor in delta.items():
            reference[key] = np.float32(beta) * reference[key] + tensor.numpy()
            sent, _, _ = reference_topk(reference[key], density=spec.density, bits=spec.bits, chunk=spec.chunk)
            reference[key] = reference[key] - sent.reshape(shapes[key])
            np.testing.assert_allclose(decoded[key].numpy().reshape(-1), sent, rtol=0, atol=1e-7)
            np.testing.assert_allclose(residual[key].numpy(), reference[key], rtol=0, atol=1e-7)
            flat = decoded[key].reshape(-1)
            for start in range(0, flat.numel(), spec.chunk):
                chunk = flat[start:start + spec.chunk]
                assert int((chunk != 0).sum()) == math.ceil(spec.density * chunk.numel())


def test_the_island_sends_its_update_plus_the_decayed_residual(tiny, tmp_path):
    """Path 0's second task, with `compression.ef_decay` 0.8, sends Δ + 0.8 e: e from the carried state its
    first task handed off through the store, Δ what the same task trains without error feedback."""
    run = make_run(tiny, tmp_path / "run", SPARSELOCO)
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    _, _, ref = push_result(run.setup, first, train_task(run.setup, first), island="a", handing_off=True)
    residual = CarriedState.from_tensors(*read_inner(run.store, ref), where=ref).residual
    second = Task.open(path=0, base=0, step_offset=run.config.inner.steps, inner_from=ref)
    decayed = train_task(run.setup, second)
    without = train_task(dataclasses.replace(run.setup, compression=replace(
        run.config.compression, error_feedback=False, ef_decay=1.0)), second)
    assert residual and decayed.encoded is not None
    for name, delta in without.pseudo_gradient.items():
        torch.testing.assert_close(decayed.pseudo_gradient[name], delta + 0.8 * residual[name], rtol=0, atol=0)


def test_with_the_outer_momentum_kept_the_accumulator_replaces_it_unless_asked_for_both(tiny, tmp_path):
    """`outer.decay: keep` keeps DiLoCo's Nesterov step in every round; with `compression.ef_decay` < 1 the
    coordinator's outer step drops its momentum (a plain step of outer.lr on the average, as SparseLoCo), and
    keeps it with `compression.ef_with_momentum`. A tiny run with that combination applies every path's
    result each round, and its manifests record the step applied."""
    keep = ["outer.decay=keep", *SPARSELOCO]
    both = load_config(None, [*keep, "compression.ef_with_momentum=true"])
    assert CoordinatorSettings.from_config(both).outer == both.outer and both.outer.momentum > 0
    assert CoordinatorSettings.from_config(load_config(None, keep[:-1])).outer.momentum > 0  # β = 1: no change
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [*keep, "compression.last_task=codec"])  # every round's result top-k
    assert run.config.outer.momentum > 0 and run.config.compression.replaces_momentum
    drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(2)], clock)
    for round in range(1, run.config.run.rounds + 1):
        manifest = read_manifest(run.store, round)
        assert (manifest.outer.momentum, manifest.outer.nesterov) == (0.0, False)
        assert manifest.outer.lr == run.config.outer.lr  # not plain averaging: the outer lr, no momentum
        assert sorted(e.path for e in manifest.applied) == list(range(run.topology.n_paths))
        for entry in manifest.applied:
            tensors, meta = read_result(run.store, round=round, path=entry.path, attempt=entry.attempt)
            assert meta.compression == "topk" and all(torch.isfinite(t).all() for t in tensors.values())
