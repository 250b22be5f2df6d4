"""Fragments (`outer.fragments`, Streaming DiLoCo): the schedule against an independent computation (every
module once in any K consecutive rounds, balanced, the path's last task sends all), a tiny run whose results
hold exactly the scheduled modules and whose modules move only when synced, the drift (what a path trained
on a module it did not send) continuing the path's trajectory, surviving an island's kill and moving to
another island through the store, and the coordinator refusing a result with other modules, by name."""

import dataclasses
import random
import re

import pytest
import torch
from test_decoupled import assert_same_last_modules, killed_in_round_two
from tiny_runs import Clock, drive, make_run

from dipaco.carried.state import DRIFT, CarriedState
from dipaco.config import ResilienceConfig, RoundsConfig
from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.islands.island.training import push_result, train_task
from dipaco.rounds.fragments import FragmentSchedule
from dipaco.rounds.inputs import Grid, Result, Running
from dipaco.rounds.policy import RoundPolicy
from dipaco.stages.island import island_setup
from dipaco.store.board import all_inner_states, read_inner, read_manifest, read_result, write_inner
from dipaco.store.records import Task

FRAGMENTS = ["outer.fragments=2", "store.keep_versions=0"]


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


def stored(store, ref: str) -> CarriedState:
    """The carried state `ref` in the store."""
    return CarriedState.from_tensors(*read_inner(store, ref), where=ref)


def random_sizes(n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    return {f"m{i:02d}": rng.choice([1, 10, 100, 5000]) * rng.randint(1, 9) for i in range(n)}


def reference_split(weights: dict[str, int], k: int) -> list[set[str]]:
    """Heaviest first (ties by name), each to the lightest fragment (ties: the lowest), written out plainly."""
    fragments, load = [set() for _ in range(k)], [0] * k
    for name in sorted(weights, key=lambda m: (-weights[m], m)):
        lightest = load.index(min(load))
        fragments[lightest].add(name)
        load[lightest] += weights[name]
    return fragments


# --- the schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_any_k_consecutive_rounds_sync_every_module_exactly_once_in_balanced_fragments(seed):
    sizes = random_sizes(3 + seed * 3, seed)
    paths = {m: range(random.Random(m).randint(1, 4)) for m in sizes}  # a module's Δ is sent by each path through it
    weights = {m: sizes[m] * len(paths[m]) for m in sizes}  # what a round that syncs it uploads
    for k in range(1, len(sizes) + 1):
        schedule = FragmentSchedule.split(sizes, k, paths=paths)
        assert [set(f) for f in schedule.fragments()] == reference_split(weights, k)
        for first in range(1, 2 * k + 2):
            counts = dict.fromkeys(sizes, 0)
            for round in range(first, first + k):
                for m in schedule.synced(sizes, round=round):
                    counts[m] += 1
            assert set(counts.values()) == {1}, (k, first)
        heaviest = max(sum(weights[m] for m in f) for f in schedule.fragments())
        assert heaviest <= sum(weights.values()) / k + max(weights.values())  # a round's upload
        shuffled = dict(random.Random(seed).sample(sorted(sizes.items()), len(sizes)))
        assert FragmentSchedule.split(shuffled, k, paths=paths).of_module == schedule.of_module  # deterministic


def test_one_fragment_syncs_everything_and_the_paths_last_task_syncs_everything():
    sizes = {"embeddings": 50, "level0.module0": 30, "level0.module1": 30, "level1.module0": 20}
    path = ["embeddings", "level0.module1", "level1.module0"]
    assert all(FragmentSchedule.split(sizes, 1).synced(path, round=r) == path for r in range(1, 6))
    schedule = FragmentSchedule.split(sizes, 3, inner_steps=4, rounds=5)
    for round in range(1, 6):
        synced = schedule.synced(path, round=round, step_offset=4 * (round - 1))
        assert synced == (path if round == 5 else [m for m in path if schedule.of_module[m] == round % 3])
    assert schedule.last(step_offset=16) and not schedule.last(step_offset=12)
    assert schedule.last(step_offset=18, steps=2) and not schedule.last(step_offset=10, steps=2)  # async: owed steps
    with pytest.raises(ValueError, match=r"outer.fragments 5 must be between 1 and the grid's 4 modules"):
        FragmentSchedule.split(sizes, 5)


# --- a tiny run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "topk"])
def test_a_tiny_run_sends_the_scheduled_modules_and_a_module_moves_only_when_synced(tiny, tmp_path, codec):
    """Three sync rounds, K = 2: round 1 sends fragment 1, round 2 fragment 0, round 3 (the last) every module.
    With top-k and error feedback a module not sent keeps its residual (the residual covers every parameter)."""
    clock = Clock()
    topk = ["compression.codec=topk", "compression.density=0.05", "compression.chunk=256"] if codec == "topk" else []
    every_task = "resilience.inner_checkpoint_every=1"  # each path's state in the store after each round
    run = make_run(tiny, tmp_path / "run", [*FRAGMENTS, "run.rounds=3", every_task, *topk])
    coordinator = run.coordinator(clock)
    schedule = coordinator.fragments
    assert schedule.count == 2 and {len(f) > 0 for f in schedule.fragments()} == {True}
    islands = [run.island(f"i{k}", clock) for k in range(2)]
    stats = []
    for round in (1, 2, 3):
        drive(coordinator, islands, clock, until_round=round)
        stats.append(coordinator.last_stats)
        synced_any = set()
        for entry in read_manifest(run.store, round).applied:
            modules = run.topology.modules_of_path(entry.path)
            expected = modules if round == 3 else [m for m in modules if schedule.of_module[m] == round % 2]
            tensors, meta = read_result(run.store, round=round, path=entry.path, attempt=entry.attempt)
            assert {name.partition("/")[0] for name in tensors} == set(expected) == set(entry.module_bytes)
            assert entry.float32_bytes == 4 * sum(run.store.module_sizes(modules).values())  # float32 DiLoCo: all
            synced_any |= set(expected)
            state = stored(run.store, coordinator.paths[entry.path].inner)
            drift, residual = state.drift, state.residual
            assert {name.partition("/")[0] for name in drift} == set(modules) - set(expected)
            assert {n.partition("/")[0] for n in residual} == (set(modules) if codec == "topk" else set())
        for name in run.topology.modules:
            before, after = run.store.read_module(round - 1, name), run.store.read_module(round, name)
            moved = any(not torch.equal(before[p], after[p]) for p in before)
            assert moved == (name in synced_any), (round, name)
    assert [s.bytes_up_final for s in stats] == [0, 0, stats[2].bytes_up]
    assert max(s.bytes_up for s in stats[:2]) < stats[2].bytes_up  # the final flush sends every module


def test_the_drift_continues_the_paths_trajectory_across_islands_as_one_fragment_would(tiny, tmp_path):
    """Path 0's round-1 task with K = 2 sends its fragment and keeps the rest as drift: together bit for bit
    the Δ of K = 1. Its round-2 task on a fresh island (nothing in memory: the drift comes from the store)
    starts from the same parameters as K = 1's once round 1 is applied by plain averaging, so a module it
    sends now carries round 1's training too: Δ_2(K=2) = Δ_1 + Δ_2(K=1)."""
    runs = {k: make_run(tiny, tmp_path / f"k{k}", [f"outer.fragments={k}", "run.rounds=3"]) for k in (1, 2)}
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    out = {k: train_task(run.setup, first) for k, run in runs.items()}
    synced = {n.partition("/")[0] for n in out[2].pseudo_gradient}
    drift = out[2].carried.drift
    assert synced and drift and not out[1].carried.drift
    assert out[2].pseudo_gradient.keys() | drift.keys() == out[1].pseudo_gradient.keys()
    for name, delta in out[1].pseudo_gradient.items():
        assert torch.equal(out[2].pseudo_gradient.get(name, drift.get(name)), delta)
    second = {}
    for k, run in runs.items():
        _, _, ref = push_result(run.setup, first, out[k], island="a", handing_off=True)
        for module in run.topology.modules:  # version 1: path 0's round-1 result applied by plain averaging
            params = run.store.read_module(0, module)
            if k == 1 or module in synced:
                params = {p: t - out[k].pseudo_gradient[f"{module}/{p}"] if f"{module}/{p}" in out[k].pseudo_gradient
                          else t for p, t in params.items()}
            run.store.write_module(1, module, params)
        task = Task.open(path=0, base=1, step_offset=run.config.inner.steps, inner_from=ref)
        second[k] = train_task(island_setup(run.config, run.dir), task)  # another island: the inner state from the store
        assert not second[k].meta.inner_state_local and second[k].meta.bytes_down_inner > 0
    later = {n.partition("/")[0] for n in second[2].pseudo_gradient}
    assert later == {n.partition("/")[0] for n in drift}  # round 2 sends the other fragment
    for name, delta in second[2].pseudo_gradient.items():
        torch.testing.assert_close(delta, out[1].pseudo_gradient[name] + second[1].pseudo_gradient[name],
                                   rtol=0, atol=1e-6)
    for name, delta in second[2].carried.drift.items():  # sent in round 1: only round 2's training
        assert torch.equal(delta, second[1].pseudo_gradient[name])


def test_a_drift_in_the_store_that_is_not_finite_is_refused_naming_the_file(tiny, tmp_path):
    """The island refuses it naming the file and the tensor (dipaco.carried.validate) and trains the task
    from fresh moments and no drift, saying so in its result (issue 36: the run never stalls)."""
    run = make_run(tiny, tmp_path / "run", FRAGMENTS)
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    _, _, ref = push_result(run.setup, first, train_task(run.setup, first), island="a", handing_off=True)
    tensors, meta = read_inner(run.store, ref)
    name = next(k for k in tensors if k.startswith(DRIFT))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    write_inner(run.store, ref, tensors, meta)  # a dishonest island's inner state
    second = Task.open(path=0, base=0, step_offset=run.config.inner.steps, inner_from=ref)
    out = train_task(island_setup(run.config, run.dir), second)
    assert re.search(rf"{ref}: {name} has \d+ NaN or infinite values", out.meta.inner_refused)
    fresh = train_task(island_setup(run.config, run.dir), dataclasses.replace(second, inner_from=None))
    for key, delta in fresh.pseudo_gradient.items():  # exactly the task from fresh moments and no drift
        torch.testing.assert_close(out.pseudo_gradient[key], delta, rtol=0, atol=0)


def test_an_island_killed_mid_task_resumes_its_paths_drift_bit_for_bit(tiny, tmp_path, monkeypatch):
    """Sync, fixed seeds, one island, K = 2: it dies inside a round-2 task (whose path carries drift from round
    1), resumes from its inner checkpoint, and the run's modules and every path's last inner state (drift
    included) are bit-identical to a run never killed."""
    straight, killed, island, saved = killed_in_round_two(tiny, tmp_path, FRAGMENTS, monkeypatch)
    resumed = next(c for c in saved if c.task["key"] == island.resumed[0][0])
    assert stored(killed.store, resumed.task["inner_from"]).drift  # it started from a drift (handed off at the switch)
    assert_same_last_modules(killed, straight)
    last = {name: {p: max(states)[1] for p, states in all_inner_states(run.store).items()}
            for name, run in (("straight", straight), ("killed", killed))}  # the killed path's is attempt 1's
    for path, ref in last["straight"].items():
        want, got = read_inner(straight.store, ref)[0], read_inner(killed.store, last["killed"][path])[0]
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), path


def test_a_result_with_other_modules_than_its_round_syncs_is_refused_naming_them(tiny, tmp_path):
    run = make_run(tiny, tmp_path / "run", FRAGMENTS)
    every = dataclasses.replace(run.setup, fragments=1)  # an island that sends every module
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    push_result(every, task, train_task(every, task), island="a")
    checks = ResultChecks(run.store, run.topology, resilience=ResilienceConfig())
    modules = run.topology.modules_of_path(0)
    fragment = run.setup.schedule.synced(modules, round=1)
    extra = sorted(set(modules) - set(fragment))
    reason = checks.check(task, 0, modules=fragment)
    assert f"tensors do not match the modules path 0 syncs in round 1 ({', '.join(fragment)})" in reason
    assert f"unexpected ['{extra[0]}/" in reason

    run = make_run(tiny, tmp_path / "missing", FRAGMENTS)
    push_result(run.setup, task, train_task(run.setup, task), island="a")  # round 1's fragment only
    reason = ResultChecks(run.store, run.topology, resilience=ResilienceConfig()).check(task, 0, modules=modules)
    assert "tensors do not match path 0's modules (missing [" in reason and f"'{extra[0]}/" in reason


# --- async -----------------------------------------------------------------------------------------
def test_an_async_quorum_counts_for_a_module_only_the_results_and_tasks_that_carry_it():
    """Paths 0, 1 and 2 share module s (quorum 1.0): 0 and 1 reported results carrying s. One fragment: s
    waits for path 2. Fragments: path 2's running task will not carry s, so s does not wait for it (and the
    plan gives s only the results that carry it); when it will, s waits. With nothing pending or in flight
    that carries s, s is not waited for at all."""
    g = Grid(n_paths=3, modules={"s": (0, 1, 2), "p0": (0,), "p1": (1,), "p2": (2,)})
    config = RoundsConfig(mode="async", quorum=1.0, grace_seconds=100.0)

    def policy(fragments: int, carries: dict[int, set[str]]) -> tuple[RoundPolicy, list[Running]]:
        def carry(path):
            return frozenset(carries[path]) if fragments > 1 else None
        p = RoundPolicy(g, config, rounds=5, fragments=fragments)
        for path in (0, 1):
            p.received(Result(key=f"r{path}", path=path, base=0, tokens=1, arrived=0.0, modules=carry(path)))
        return p, [Running(key="r2", path=2, base=0, started=0.0, modules=carry(2))]

    one, running = policy(1, {0: {"s"}, 1: {"s"}, 2: {"p2"}})
    assert not one.close_due(1.0, running=running)
    split, running = policy(2, {0: {"s", "p0"}, 1: {"s"}, 2: {"p2"}})
    assert split.close_due(1.0, running=running)
    plan = split.plan()
    assert [c.key for c in plan.modules["s"]] == ["r0", "r1"] and [c.key for c in plan.modules["p1"]] == []
    waiting, running = policy(2, {0: {"s"}, 1: {"s"}, 2: {"s", "p2"}})
    assert not waiting.close_due(1.0, running=running)
    nobody, running = policy(2, {0: {"p0"}, 1: {"p1"}, 2: {"p2"}})
    assert nobody.close_due(1.0, running=running) and nobody.plan().modules["s"] == ()


def test_an_async_tiny_run_with_fragments_syncs_each_result_s_fragment_and_ends_with_no_drift(tiny, tmp_path):
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [*FRAGMENTS, "run.rounds=4", "rounds.mode=async", "rounds.quorum=0.5",
                                            "rounds.grace_seconds=0"])
    coordinator = run.coordinator(clock)
    drive(coordinator, [run.island(f"i{k}", clock) for k in range(3)], clock, turns=800)
    schedule, steps = coordinator.fragments, run.config.inner.steps
    applied = [e for r in range(1, coordinator.committed + 1) for e in read_manifest(run.store, r).applied]
    for path in range(run.topology.n_paths):
        ours = [e for e in applied if e.path == path]
        assert sum(e.steps for e in ours) == run.config.run.rounds * steps
        modules = run.topology.modules_of_path(path)
        for entry in ours[:-1]:
            assert sorted(entry.module_bytes) == sorted(schedule.synced(modules, round=entry.base + 1)), entry.key
        assert sorted(ours[-1].module_bytes) == sorted(modules)  # the path's last task: every module
    for path, states in all_inner_states(run.store).items():
        assert not stored(run.store, max(states)[1]).drift, path


def test_more_fragments_than_the_grids_modules_are_refused_when_the_coordinator_starts(tiny, tmp_path):
    run = make_run(tiny, tmp_path / "run", ["outer.fragments=6"])  # the tiny grid has 5 modules
    with pytest.raises(ValueError, match=r"outer.fragments 6 must be between 1 and the grid's 5 modules \(\['embeddings'"):
        run.coordinator(Clock())
