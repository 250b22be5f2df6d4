"""Error feedback (`compression.error_feedback` with `codec: topk`): nothing is lost over rounds, the residual
is the path's (it survives an island's restart through the inner checkpoint and moves to another island
through a hand-off of its carried state), a bad residual is refused by name, and a tiny run applies top-k
results end to end."""

import dataclasses
import re

import pytest
import torch
from test_decoupled import assert_same_last_modules, killed_in_round_two
from tiny_runs import Clock, drive, make_run

from dipaco.carried.state import RESIDUAL, CarriedState
from dipaco.codec.codec import Codec
from dipaco.codec.compress import decompress
from dipaco.codec.feedback import encode_with_feedback, with_residual
from dipaco.codec.sparse import TopK
from dipaco.islands.island.training import push_result, train_task
from dipaco.stages.island import island_setup
from dipaco.store.board import all_inner_states, read_inner, read_manifest, read_result, write_inner
from dipaco.store.module_store import StoreError
from dipaco.store.records import Task

TOPK = ["compression.codec=topk", "compression.density=0.05", "compression.bits=2", "compression.chunk=256"]
SPEC = TopK(density=0.05, bits=2, chunk=256)


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


def _updates(rounds: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"a/w": torch.randn(20, 30, generator=g) * 1e-3, "b/v": torch.randn(100, generator=g)} for _ in range(rounds)]


def test_over_three_rounds_what_was_dropped_comes_back():
    """Σ decoded updates + the final residual = Σ true updates; each residual is exactly what its upload lacked."""
    updates = _updates(3)
    residual: dict[str, torch.Tensor] = {}
    applied = {name: torch.zeros_like(t) for name, t in updates[0].items()}
    for delta in updates:
        sent = with_residual(delta, residual)
        data, _, residual = encode_with_feedback(sent, codec=Codec("topk", topk=SPEC))
        decoded, _ = decompress(data, method="topk")
        for name in applied:
            applied[name] += decoded[name]
            assert torch.equal(residual[name], sent[name] - decoded[name])
            dropped = decoded[name] == 0
            assert torch.equal(residual[name][dropped], sent[name][dropped])  # a dropped entry is carried whole
    for name in applied:
        truth = sum(delta[name] for delta in updates)
        torch.testing.assert_close(applied[name] + residual[name], truth, rtol=0, atol=1e-6)
        assert (applied[name] != 0).float().mean() > SPEC.density  # the residual pushed other entries out later


@pytest.mark.parametrize("bad, message", [
    ({"a/w": torch.zeros(20, 31)}, r"residual/a/w has shape \[20, 31\], its parameter's is \[20, 30\]"),
    ({"a/w": torch.zeros(20, 30, dtype=torch.float64)}, "residual/a/w is torch.float64, not float32"),
    ({"a/w": torch.full((20, 30), float("nan"))}, "residual/a/w has 600 NaN or infinite values"),
    ({"a/x": torch.zeros(20, 30)}, r"residual/a/x is not a moment, residual or drift of the path's parameters"),
])
def test_a_residual_that_does_not_fit_the_path_is_refused_by_name(bad, message):
    bound = dict(max_step=1, betas=(0.9, 0.95))  # no moments here: the AdamW bound is not reached
    CarriedState().check({"a/w": [20, 30]}, where="f", **bound)  # none: zeros
    CarriedState(residual={"a/w": torch.zeros(20, 30)}).check({"a/w": [20, 30]}, where="f", **bound)
    with pytest.raises(StoreError, match=f"store/x.safetensors: .*{message}"):
        CarriedState(residual=bad).check({"a/w": [20, 30]}, where="store/x.safetensors", **bound)
    shapes = {"a/w": [20, 30], "a/b": [20]}  # a residual of some parameters only
    with pytest.raises(StoreError, match=r"store/x.safetensors: error-feedback residual .*missing \['a/b'\]"):
        CarriedState(residual={"a/w": torch.zeros(20, 30)}).check(shapes, where="store/x.safetensors", **bound)


def test_the_residual_moves_to_another_island_through_the_store_and_is_added_to_the_next_update(tiny, tmp_path):
    """Path 0's first task on one island leaves its residual in the carried state it hands off; the path's next
    task on a fresh island (nothing in memory) reads it from the store and sends Δ + e."""
    run = make_run(tiny, tmp_path / "run", TOPK)
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    out = train_task(run.setup, first)
    meta, _, ref = push_result(run.setup, first, out, island="a", handing_off=True)
    stored = CarriedState.from_tensors(*read_inner(run.store, ref), where=ref)
    adam, residual = stored.adam, stored.residual
    decoded, _ = read_result(run.store, round=1, path=0, attempt=0)
    assert set(residual) == set(decoded) and adam and meta.bytes_residual == sum(t.numel() * 4 for t in residual.values())
    for name, delta in out.pseudo_gradient.items():
        assert torch.equal(residual[name], delta - decoded[name])  # e_1 = Δ_1 − decode(encode(Δ_1))

    steps = run.config.inner.steps
    second = Task.open(path=0, base=0, step_offset=steps, inner_from=ref)
    other_island = island_setup(run.config, run.dir)  # another process: its own model, no cached inner state
    with_feedback = train_task(other_island, second)
    without = train_task(dataclasses.replace(other_island, compression=dataclasses.replace(
        run.config.compression, error_feedback=False)), second)
    assert not with_feedback.meta.inner_state_local and with_feedback.meta.bytes_down_inner > 0
    assert without.encoded is None and without.meta.bytes_residual == 0
    assert not without.carried.residual and not any(k.startswith(RESIDUAL) for k in without.carried.to_tensors()[0])
    for name, delta in without.pseudo_gradient.items():
        torch.testing.assert_close(with_feedback.pseudo_gradient[name], delta + residual[name], rtol=0, atol=0)


def test_a_residual_in_the_store_that_is_not_finite_is_refused_naming_the_file(tiny, tmp_path):
    """The island refuses it naming the file and the tensor (dipaco.carried.validate) and trains the path's
    task from fresh moments and no residual, saying so in its result (issue 36: the run never stalls)."""
    run = make_run(tiny, tmp_path / "run", TOPK)
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    _, _, ref = push_result(run.setup, first, train_task(run.setup, first), island="a", handing_off=True)
    tensors, meta = read_inner(run.store, ref)
    name = next(k for k in tensors if k.startswith(RESIDUAL))
    tensors[name] = torch.full_like(tensors[name], float("inf"))
    write_inner(run.store, ref, tensors, meta)  # a dishonest island's inner state
    second = Task.open(path=0, base=0, step_offset=run.config.inner.steps, inner_from=ref)
    out = train_task(island_setup(run.config, run.dir), second)
    assert re.search(rf"{ref}: {name} has \d+ NaN or infinite values", out.meta.inner_refused)
    assert out.meta.bytes_down_inner > 0 and not out.meta.inner_state_local
    fresh = train_task(island_setup(run.config, run.dir), dataclasses.replace(second, inner_from=None))
    for key, delta in fresh.pseudo_gradient.items():  # exactly the task from fresh moments and no residual
        torch.testing.assert_close(out.pseudo_gradient[key], delta, rtol=0, atol=0)


def test_an_island_killed_mid_task_resumes_with_the_residual_its_task_started_from(tiny, tmp_path, monkeypatch):
    """Sync, fixed seeds, one island: it dies inside a round-2 task (whose path carries a residual from
    round 1), comes back, resumes from its inner checkpoint, and the run ends bit-identical to one never
    killed. The checkpoint held the residual the task's inner state in the store holds."""
    straight, killed, island, saved = killed_in_round_two(tiny, tmp_path, TOPK, monkeypatch)
    resumed = next(c for c in saved if c.task["key"] == island.resumed[0][0])
    assert resumed.task["inner_from"] is not None and resumed.residual  # a round-2 task starts from a residual
    ref = resumed.task["inner_from"]  # handed off when the island took the round's next path
    stored = CarriedState.from_tensors(*read_inner(killed.store, ref), where=ref).residual
    assert resumed.residual.keys() == stored.keys()
    assert all(torch.equal(resumed.residual[k], stored[k]) for k in stored)
    assert_same_last_modules(killed, straight)


def test_a_tiny_run_with_the_topk_codec_applies_its_results(tiny, tmp_path):
    """configs/tiny.yaml with codec topk, two islands: every round applies one top-k result per path, its
    file a small fraction of float32, the modules move and stay finite, and each path's inner state holds
    its residual (the last task too: `compression.last_task: codec`)."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [*TOPK, "compression.last_task=codec"])
    drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(2)], clock)
    rounds = run.config.run.rounds
    for round in range(1, rounds + 1):
        manifest = read_manifest(run.store, round)
        assert sorted(e.path for e in manifest.applied) == list(range(run.topology.n_paths))
        for entry in manifest.applied:
            tensors, meta = read_result(run.store, round=round, path=entry.path, attempt=entry.attempt)
            raw = sum(t.numel() * 4 for t in tensors.values())
            assert meta.compression == "topk" and meta.file.endswith(".topk.safetensors") and meta.bytes < raw / 5
            assert meta.bytes_residual == raw  # the residual: one float32 per parameter, in the inner state
            assert entry.float32_bytes == raw and entry.island in ("i0", "i1")  # byte accounting (dipaco status)
            assert 0 < sum(entry.module_bytes.values()) < entry.bytes == meta.bytes
            kept = sum(int((t != 0).sum()) for t in tensors.values()) / sum(t.numel() for t in tensors.values())
            assert SPEC.density <= kept < 2 * SPEC.density  # ceil per chunk, at least one per small tensor
    fresh = make_run(tiny, tmp_path / "fresh", TOPK)  # version 0 again (the run pruned its own)
    for name in run.topology.modules:
        before, after = fresh.store.read_module(0, name), run.store.read_module(rounds, name)
        assert all(torch.isfinite(after[p]).all() and not torch.equal(after[p], before[p]) for p in before)
    for path, states in all_inner_states(run.store).items():
        ref = max(states)[1]  # the path's last task uploads its state
        residual = CarriedState.from_tensors(*read_inner(run.store, ref), where=ref).residual
        assert residual and all(torch.isfinite(t).all() for t in residual.values()), path
