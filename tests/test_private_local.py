"""Private modules that stay on their island (`outer.private_modules: local`) and the path's last task sent
in float32 (`compression.last_task: float32`): the schedule leaves the private modules to the last task; a
tiny run with them local sends no private tensor before its last task, leaves their committed copy at
version 0 until then, and under plain averaging ends bit-near the run that syncs them every round; with
top-k the last task's result is float32 and no residual is left on the island."""

import pytest
import torch
from tiny_runs import Clock, drive, make_run

from dipaco.carried.state import CarriedState
from dipaco.rounds.fragments import FragmentSchedule
from dipaco.store.board import read_inner, read_manifest, read_result

PRIVATE = ["topology.private_embeddings=true", "store.keep_versions=0"]
PLAIN = ["outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false"]  # every round a plain average


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


def test_local_modules_are_sent_only_by_the_paths_last_task_and_fragments_split_the_shared_ones():
    paths = {"emb.0": [0], "emb.1": [1], "a": [0, 1], "b": [0, 1], "c": [0, 1]}
    sizes = {"emb.0": 100, "emb.1": 100, "a": 50, "b": 40, "c": 10}
    one = FragmentSchedule.of(count=1, sizes=lambda: pytest.fail("K = 1 reads no sizes"), paths=paths,
                              inner_steps=4, rounds=3, private_local=True)
    assert one.local == {"emb.0", "emb.1"} and not one.sends_all
    assert one.synced(["emb.0", "a", "b", "c"], round=1, step_offset=0) == ["a", "b", "c"]
    assert one.synced(["emb.0", "a", "b", "c"], round=3, step_offset=8) == ["emb.0", "a", "b", "c"]  # the last task
    two = FragmentSchedule.of(count=2, sizes=lambda: sizes, paths=paths, inner_steps=4, rounds=3, private_local=True)
    assert set(two.of_module) == {"a", "b", "c"}  # the private modules are in no fragment
    sent = [set(two.synced(["emb.1", "a", "b", "c"], round=r, step_offset=4 * (r - 1))) for r in (1, 2)]
    assert sent[0] | sent[1] == {"a", "b", "c"} and not sent[0] & sent[1]
    synced = FragmentSchedule.of(count=1, sizes=dict, paths=paths, inner_steps=4, rounds=3, private_local=False)
    assert synced.sends_all and synced.synced(["emb.0", "a"], round=1) == ["emb.0", "a"]


def test_private_modules_kept_on_their_island_end_where_syncing_them_every_round_does(tiny, tmp_path):
    """Three sync rounds, plain averaging, float32: a private module has one contributor, so the run that syncs
    it every round commits exactly what its path trained; the run that keeps it on the island carries it as
    drift and sends it once, at the end. Every module of the last version agrees to float rounding, no result
    before the last holds a private tensor, and the private modules' committed copy stays at version 0."""
    clock = Clock()
    runs = {mode: make_run(tiny, tmp_path / mode, [*PRIVATE, *PLAIN, "run.rounds=3", f"outer.private_modules={mode}"])
            for mode in ("synced", "local")}
    for run in runs.values():
        drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(2)], clock)
    local = runs["local"]
    private = set(local.setup.schedule.local)
    assert private
    for round in (1, 2, 3):
        for entry in read_manifest(local.store, round).applied:
            tensors, meta = read_result(local.store, round=round, path=entry.path, attempt=entry.attempt)
            sent = {name.partition("/")[0] for name in tensors}
            mine = set(local.topology.modules_of_path(entry.path))
            assert sent == (mine if round == 3 else mine - private), (round, entry.path)
    for name in private:
        version0 = local.store.read_module(0, name)
        for round in (1, 2):
            assert all(torch.equal(t, local.store.read_module(round, name)[p]) for p, t in version0.items())
    for name in local.topology.modules:
        for param, value in local.store.read_module(3, name).items():
            torch.testing.assert_close(value, runs["synced"].store.read_module(3, name)[param], rtol=0, atol=2e-6)


@pytest.mark.parametrize("last_task, codec", [("float32", "none"), ("int8", "int8")])
def test_the_last_task_sends_its_codec_and_leaves_no_drift_on_the_island(tiny, tmp_path, last_task, codec):
    """Top-k tasks, then the last one in `compression.last_task`'s codec with every module of its path: float32
    leaves no residual at all; int8 leaves only its rounding (far below what top-k left in round 1)."""
    clock = Clock()
    topk = ["compression.codec=topk", "compression.density=0.05", "compression.chunk=256",
            "resilience.inner_checkpoint_every=1", f"compression.last_task={last_task}"]
    run = make_run(tiny, tmp_path / "run", [*PRIVATE, *PLAIN, "run.rounds=2", "outer.private_modules=local", *topk])
    coordinator = run.coordinator(clock)
    drive(coordinator, [run.island(f"i{k}", clock) for k in range(2)], clock)
    for round, expected in ((1, "topk"), (2, codec)):
        for entry in read_manifest(run.store, round).applied:
            tensors, meta = read_result(run.store, round=round, path=entry.path, attempt=entry.attempt)
            assert meta.compression == expected, (round, entry.path)
            if round == 2:  # every module of the path
                assert {n.partition("/")[0] for n in tensors} == set(run.topology.modules_of_path(entry.path))
    for entry in read_manifest(run.store, 2).applied:  # the state each path's last task uploaded
        ref = coordinator.paths[entry.path].inner
        state = CarriedState.from_tensors(*read_inner(run.store, ref), where=ref)
        assert not state.drift and state.residual
        left = max(float(t.abs().max()) for t in state.residual.values())
        assert left == 0.0 if codec == "none" else 0.0 < left < 1e-2, (entry.path, left)


def test_private_modules_local_under_an_outer_step_with_momentum_are_refused_by_name():
    """The last task's Δ holds a private module's whole training: an outer step of lr x (1 + momentum) would
    scale it up whole, so the config is refused naming both keys; plain averaging (the recipe) is accepted."""
    from dipaco.config import load_config

    assert load_config(None, ["outer.private_modules=local"]).outer.private_modules == "local"
    with pytest.raises(ValueError, match=r"outer.private_modules 'local'.*outer.decay 'keep'"):
        load_config(None, ["outer.private_modules=local", "outer.decay=keep"])
    plain = ["outer.private_modules=local", "outer.decay=keep", "outer.lr=1.0", "outer.momentum=0.0"]
    assert load_config(None, plain).outer.decay == "keep"  # an outer step of lr 1 without momentum is a plain average
