"""Coordinator, pull-based islands and the outer-step modes, on the tiny config over real shards.

The coordinator and the islands are the real classes driven in one process, turn by turn, with a
fake clock (so heartbeat timeouts need no sleeping and every schedule is exact); the DDP test runs a
real `torchrun --nproc-per-node 2` island against it.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_runs import Clock, Crash, TinyRun, drive, make_run

from dipaco.config import load_config, save_config
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.islands.island.faults import FaultClock
from dipaco.islands.island.training import train_task
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir
from dipaco.stages.island import island_setup
from dipaco.store.board import read_manifest, read_result, read_result_meta, result_exists
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import RoundManifest, Task, task_key
from dipaco.store.run_state import run_finished

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
PLAIN = ["outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false"]


@pytest.fixture(scope="module")
def tiny(tiny_routed) -> RunDir:
    return tiny_routed  # conftest's routed and sharded tiny run (read only: make_run copies it)


@pytest.fixture(scope="module")
def straight(tiny_straight) -> TinyRun:
    """Two rounds run without interruption by two islands (conftest's, read only)."""
    return tiny_straight


def manifests(store: ModuleStore, rounds: int) -> list[RoundManifest]:
    return [read_manifest(store, r) for r in range(1, rounds + 1)]


def assert_same_modules(resumed: TinyRun, straight: TinyRun, round: int) -> None:
    for name in resumed.topology.modules:
        for kind in ("read_module", "read_outer_state"):
            a, b = getattr(resumed.store, kind)(round, name), getattr(straight.store, kind)(round, name)
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    for manifest in manifests(resumed.store, round):
        assert sorted(e.path for e in manifest.applied) == [0, 1, 2, 3]  # each result applied once


def test_a_coordinator_killed_between_module_writes_resumes_to_the_same_modules(tiny, straight, tmp_path,
                                                                                 monkeypatch):
    clock = Clock()
    resumed = make_run(tiny, tmp_path / "resumed", [])
    islands = [resumed.island(f"i{k}", clock) for k in range(2)]
    written = []
    original = ModuleStore.write_module

    def crash_on_second_write(self, round, name, tensors):
        if round == 2:
            written.append(name)
            if len(written) == 2:
                raise Crash(f"killed before writing {name}")
        original(self, round, name, tensors)

    monkeypatch.setattr(ModuleStore, "write_module", crash_on_second_write)
    with pytest.raises(Crash):
        drive(resumed.coordinator(clock), islands, clock)
    monkeypatch.undo()
    store = resumed.store
    assert store.current_round() == 1 and store.has_module(2, written[0])

    drive(resumed.coordinator(clock), islands, clock)  # a new coordinator process, same store
    assert store.current_round() == 2
    assert_same_modules(resumed, straight, 2)


def test_a_coordinator_killed_right_after_a_commit_resumes_to_the_same_modules(tiny, straight, tmp_path,
                                                                                monkeypatch):
    """The results received in the tick that closes the round must survive a crash before the board is
    written again: their paths continue from them (steps done, inner state) in the next round."""
    clock = Clock()
    resumed = make_run(tiny, tmp_path / "resumed", [])
    islands = [resumed.island(f"i{k}", clock) for k in range(2)]
    original = ModuleStore.commit

    def crash_after_committing_round_1(self, *, round, **meta):
        original(self, round=round, **meta)
        if round == 1:
            raise Crash("killed right after committing round 1")

    monkeypatch.setattr(ModuleStore, "commit", crash_after_committing_round_1)
    with pytest.raises(Crash):
        drive(resumed.coordinator(clock), islands, clock)
    monkeypatch.undo()
    assert resumed.store.current_round() == 1

    drive(resumed.coordinator(clock), islands, clock)
    assert_same_modules(resumed, straight, 2)


def test_an_island_killed_mid_task_has_its_task_rerun_by_another_island(tiny, tmp_path):
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["resilience.heartbeat_timeout=10"])
    coordinator = run.coordinator(clock)
    faults = FaultClock(mtbf=5.0, return_after=1000.0, mode="die", seed=0, island="a", clock=clock)
    a = run.island("a", clock, faults=faults)
    b = run.island("b", clock)
    coordinator.tick()
    a.heartbeat(), b.heartbeat()
    coordinator.tick()
    task = a.next_task()
    assert task is not None and task.attempt == 0
    clock.t = faults.next_at  # the failure falls due inside the task's inner steps
    assert a.execute(task) is None and faults.failures == 1
    assert not result_exists(run.store, round=task.round, path=task.path, attempt=0)

    drive(coordinator, [a, b], clock)
    assert run.store.current_round() == run.config.run.rounds
    first = manifests(run.store, 1)[0]
    rerun = next(e for e in first.applied if e.key == task.key)
    assert rerun.attempt == 1
    assert read_result_meta(run.store, round=1, path=task.path, attempt=1).island == "b"


def test_a_late_result_of_a_reassigned_task_is_applied_once(tiny, tmp_path):
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["resilience.heartbeat_timeout=10", "run.rounds=1"])
    coordinator = run.coordinator(clock)
    a, b = run.island("a", clock), run.island("b", clock)
    coordinator.tick()
    a.heartbeat(), b.heartbeat()
    coordinator.tick()
    task = a.next_task()  # a takes its task ... and hangs
    for _ in range(30):  # b keeps heart-beating and working; a is silent for longer than the timeout
        clock.t += 1.0
        coordinator.tick()
        b.poll()
        if result_exists(run.store, round=1, path=task.path, attempt=1):
            break
    assert a.execute(task) is not None  # a wakes up and pushes its (now duplicate) result
    drive(coordinator, [a, b], clock)
    applied = manifests(run.store, 1)[0].applied
    assert sorted(e.path for e in applied) == [0, 1, 2, 3]
    assert next(e for e in applied if e.path == task.path).attempt == 1


@pytest.mark.parametrize("max_staleness", [2, 0])
def test_a_stale_result_is_down_weighted_or_dropped_as_configured(tiny, tmp_path, max_staleness):
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [*PLAIN, "rounds.mode=async", "rounds.quorum=0.5",
                                                "rounds.grace_seconds=0", f"rounds.max_staleness={max_staleness}",
                                                "rounds.staleness_power=1.0"])
    store = run.store
    coordinator = run.coordinator(clock)
    slow = run.island("slow", clock, pinned=[0])
    fast = run.island("fast", clock, pinned=[1, 2, 3])
    coordinator.tick()
    slow.heartbeat(), fast.heartbeat()
    coordinator.tick()
    held = slow.next_task()
    assert held.path == 0 and held.base == 0
    while coordinator.committed < 1:  # round 1 closes on a quorum, without path 0
        slow.heartbeat()
        fast.poll()
        coordinator.tick()
    assert all(e.path != 0 for e in manifests(store, 1)[0].applied)
    # max_staleness 0: committing version 1 cancelled the task (its result could only be dropped)
    assert coordinator.last_stats.cancelled == (1 if max_staleness == 0 else 0)
    assert coordinator.tasks[held.key].status == ("cancelled" if max_staleness == 0 else "assigned")
    slow.execute(held)  # path 0's result from version 0 arrives while round 2 is being built
    # (the fake clock stands still inside the task, so slow never looks at the board: it uploads)
    drive(coordinator, [slow, fast], clock, until_round=2)  # (the run goes on: 2 results per path)

    second = manifests(store, 2)[1]
    if max_staleness == 0:
        assert all(held.key not in m.keys for m in manifests(store, 2))  # ignored: neither applied nor dropped
        assert not second.dropped and all(e.staleness == 0 for e in second.applied)
    else:
        stale = next(e for e in second.applied if e.path == 0)
        assert stale.staleness == 1 and stale.factor == pytest.approx(0.5)
    # the module update: each path's results (consecutive pieces of its training, async) weighted once by its
    # shard size, each result by its staleness factor (on a private module its own), divided by the paths'
    # weights without the factors (a stale result alone is discounted too)
    deltas = {e.key: read_result(store, round=e.base + 1, path=e.path, attempt=e.attempt, link=e.link)[0]
              for e in second.applied}
    index = json.loads((run.dir.shards / "index.json").read_text())
    shard_tokens = [p["train"]["blocks"] * index["seq_len"] for p in index["paths"]]
    for name in run.topology.modules:
        users = [e for e in second.applied if e.path in run.topology.paths_of_module(name)]
        before, after = store.read_module(1, name), store.read_module(2, name)
        for param in before:
            if not users:
                torch.testing.assert_close(after[param], before[param], rtol=0, atol=0)
                continue
            weight = {p: shard_tokens[p] for p in {e.path for e in users}}
            private = len(run.topology.paths_of_module(name)) == 1
            mean = sum(weight[e.path] * (e.private_factor if private else e.factor) * deltas[e.key][f"{name}/{param}"]
                       for e in users) / sum(weight.values())
            torch.testing.assert_close(after[param], before[param] - mean, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # three processes start (the launcher and two ranks): ~15 s of the fast suite's 2 minutes
def test_torchrun_two_ranks_give_the_same_pseudo_gradient_as_one_process(tiny, tmp_path):
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [])
    coordinator = run.coordinator(clock)
    coordinator.tick()
    task = coordinator.tasks[task_key(0, 0)]
    single = train_task(run.setup, task)  # one process over the whole batch (writes nothing)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "DIPACO_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           "-m", "dipaco", "--", "island", "--config", str(run.dir.config), "--run", str(run.dir.root),
           "--pull", "--path", "0", "--name", "ddp", "--max-tasks", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not result_exists(run.store, round=1, path=0, attempt=0):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the torchrun island did not report"
            coordinator.tick()
            time.sleep(0.2)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    tensors, meta = read_result(run.store, round=1, path=0, attempt=0)
    assert meta.data_parallel_ranks == 2 and meta.tokens == single.meta.tokens
    assert tensors.keys() == single.pseudo_gradient.keys()
    for key, expected in single.pseudo_gradient.items():
        torch.testing.assert_close(tensors[key], expected, rtol=1e-4, atol=2e-6)


def test_an_island_reusing_its_path_model_trains_like_a_freshly_built_one(tiny, tmp_path):
    """Tasks of several paths run one after another by one island (one model, reused) give, bit for bit,
    the pseudo-gradients, inner states and losses that each task gives on a freshly built island."""
    run = make_run(tiny, tmp_path / "run", [])
    for path in (0, 3, 1):
        task = Task.open(path=path, base=0, step_offset=0, inner_from=None)
        reused = train_task(run.setup, task)
        fresh = train_task(island_setup(run.config, run.dir), task)
        assert list(reused.pseudo_gradient) == list(fresh.pseudo_gradient)
        for key, expected in fresh.pseudo_gradient.items():
            torch.testing.assert_close(reused.pseudo_gradient[key], expected, rtol=0, atol=0)
        assert reused.carried.steps == fresh.carried.steps and reused.carried.adam.keys() == fresh.carried.adam.keys()
        for key, expected in fresh.carried.adam.items():
            torch.testing.assert_close(reused.carried.adam[key], expected, rtol=0, atol=0)
        assert reused.meta.losses == fresh.meta.losses and reused.meta.val_loss_start == fresh.meta.val_loss_start


@pytest.mark.slow
def test_a_compiled_island_trains_like_an_eager_one(tiny, tmp_path):
    """`hardware.compile` changes how the path model runs, not what it computes (up to float rounding,
    which AdamW can amplify where a gradient is near zero: compared as a relative norm)."""
    task = Task.open(path=2, base=0, step_offset=0, inner_from=None)
    eager = train_task(make_run(tiny, tmp_path / "eager", []).setup, task)
    compiled = train_task(make_run(tiny, tmp_path / "compiled", ["hardware.compile=true"]).setup, task)
    assert compiled.meta.losses == pytest.approx(eager.meta.losses, rel=1e-4)
    assert compiled.pseudo_gradient.keys() == eager.pseudo_gradient.keys()
    difference = torch.cat([(compiled.pseudo_gradient[k] - d).flatten() for k, d in eager.pseudo_gradient.items()])
    size = torch.cat([d.flatten() for d in eager.pseudo_gradient.values()])
    assert difference.norm() < 1e-2 * size.norm()


def test_an_async_run_applies_as_many_results_as_sync_and_discards_none_at_its_end(tiny, straight, tmp_path):
    # quorum 0.5 and no grace: rounds close without the slow island's path 0, so versions outrun rounds;
    # the run still ends only when every path has had run.rounds results applied (sync's rounds x
    # paths), no new task is handed out once that is covered, and the last commit waits for path 0's
    # task in flight instead of cutting it off
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [*PLAIN, "rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0",
                                            "rounds.max_staleness=8", "rounds.staleness_power=1.0", "store.keep_versions=0"])
    store, coordinator = run.store, run.coordinator(clock)
    slow, fast = run.island("slow", clock, pinned=[0]), run.island("fast", clock, pinned=[1, 2, 3])
    for turn in range(400):
        if coordinator.tick():
            break
        fast.poll()
        slow.poll() if turn % 8 == 7 else slow.heartbeat()  # path 0 reports every 8th turn
        clock.t += 0.5
    assert coordinator.done and store.state()["finished"]
    rounds, n_paths = run.config.run.rounds, run.topology.n_paths
    straight_applied = [e.path for m in manifests(straight.store, rounds) for e in m.applied]
    assert sorted(straight_applied) == sorted(list(range(n_paths)) * rounds)  # sync: rounds x paths
    written = manifests(store, coordinator.committed)
    assert coordinator.committed > rounds  # async closed rounds on a quorum: more versions ...
    applied = [e for m in written for e in m.applied]
    assert sorted(e.path for e in applied) == sorted(straight_applied)  # ... the same work applied
    assert not any(m.dropped for m in written)
    assert any(e.staleness > 0 for e in applied if e.path == 0)
    assert 0 in [e.path for e in written[-1].applied]  # the last commit took path 0's task in flight
    # every result any island finished was applied: nothing was trained for nothing
    finished = {(base, path, attempt) for base in range(coordinator.committed) for path in range(n_paths)
                for attempt in range(3) if result_exists(store, round=base + 1, path=path, attempt=attempt)}
    assert finished == {(e.base, e.path, e.attempt) for e in applied}
    assert fast.poll() is False and not coordinator.tasks  # nothing left to do: the islands stop


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_an_island_counts_its_schedule_on_from_the_warm_start_under_wsd(tiny, tmp_path, monkeypatch, schedule):
    """Under `inner.schedule: wsd` an island's inner steps continue the warm start's schedule (steps
    P + step_offset + i of P + rounds x H, P the warm start's steps); under cosine they are the paths' own."""
    import dipaco.optim.inner as inner_mod

    run = make_run(tiny, tmp_path / "run", [f"inner.schedule={schedule}", f"warm_start.fraction={7 / (7 + 4 * 3 * 4)!r}",
                                                  "run.rounds=3", "outer.decay=keep"])  # 7 warm-start steps
    seen = []
    real = inner_mod.lr_at
    monkeypatch.setattr(inner_mod, "lr_at", lambda step, **kw: seen.append((step, kw["total_steps"])) or real(step, **kw))
    H = run.config.inner.steps
    train_task(run.setup, Task.open(path=1, base=0, step_offset=H, inner_from=None))  # the path's second task
    after = 7 if schedule == "wsd" else 0
    assert seen == [(after + H + i, after + 3 * H) for i in range(H)]


def test_with_continue_optimizer_every_paths_first_task_continues_the_warm_starts_adamw(tiny, tmp_path):
    """`warm_start.continue_optimizer`: version 0 comes with the warm start's AdamW state in the store (one
    file), every path's first task is handed it, and the island's AdamW goes on from its step counts."""
    from dipaco.optim.dense import train_dense
    from dipaco.store.board import read_inner, warm_start_inner_ref

    overrides = ["hardware.device=cpu", f"warm_start.fraction={3 / (3 + 4 * 2 * 4)!r}",  # 3 warm-start steps
                 "warm_start.continue_optimizer=true"]
    run = RunDir(tmp_path / "run")
    for part in ("tokenizer", "routing", "shards"):
        shutil.copytree(tiny.root / part, run.root / part)
    config = load_config(TINY, overrides)
    save_config(config, run.config)
    factory = PathFactory(config, run)
    batches = factory.reader.iter_batches(None, "train", batch_size=config.inner.batch_size, seed=0)
    train_dense(factory.spec, batches, steps=3, inner=config.inner, seed=0, device=torch.device("cpu"),
                precision="fp32", out=run.pretrain, save_optimizer=True)
    start_or_resume_store(factory)
    setup = island_setup(config, run)
    saved, meta = read_inner(setup.store, warm_start_inner_ref())
    assert set(meta["step"].values()) == {3}
    coordinator = Coordinator(setup.store, setup.topology, settings=CoordinatorSettings.from_config(config),
                              sizes=factory.path_sizes, clock=Clock())
    assert {state.inner for state in coordinator.paths.values()} == {warm_start_inner_ref()}
    coordinator.tick()
    task = next(t for t in coordinator.tasks.values() if t.path == 2)
    assert task.inner_from == warm_start_inner_ref()
    out = train_task(setup, task)
    assert set(out.carried.steps.values()) == {3 + config.inner.steps}
    # without the setting, the paths start a fresh AdamW as before
    plain = make_run(tiny, tmp_path / "plain", [])
    assert {s.inner for s in plain.coordinator(Clock()).paths.values()} == {None}


def test_outer_decay_average_makes_the_rounds_in_the_inner_decay_plain_averages(tiny, tmp_path):
    """`outer.decay: average`: round 1 (path steps 0-3, before decay_from = 4) takes Nesterov and keeps its
    momentum; round 2 (steps 4-7, in the decay) is the shard-weighted average of its results, written out
    here in numpy from the shard sizes and the uploaded pseudo-gradients, with no momentum written."""
    import numpy as np

    from dipaco.store.board import read_result

    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["inner.schedule=wsd", "outer.lr=0.7", "outer.momentum=0.9",
                                            "outer.rescale_by_paths=false", "outer.decay=average", "store.keep_versions=0"])
    H = run.config.inner.steps
    coordinator = Coordinator(run.store, run.topology,
                              settings=replace(CoordinatorSettings.from_config(run.config), inner_steps=H, decay_from=H),
                              sizes=PathFactory(run.config, run.dir).path_sizes, clock=clock)
    drive(coordinator, [run.island(f"i{k}", clock) for k in range(2)], clock)
    assert (coordinator.last_stats.round, coordinator.last_stats.outer_step) == (2, "average")  # train.json says so
    store, topology = run.store, run.topology
    shard = PathFactory(run.config, run.dir).path_sizes.shard_tokens
    for name in topology.modules:
        assert store.read_outer_state(1, name)  # Nesterov's momentum after round 1 ...
        assert store.read_outer_state(2, name) is None  # ... none after the averaged round 2
        before, after = store.read_module(1, name), store.read_module(2, name)
        paths = topology.paths_of_module(name)
        total = sum(shard[p] for p in paths)
        for key, theta in before.items():
            expected = theta.double().numpy().copy()
            for entry in read_manifest(store, 2).applied:
                if entry.path in paths:
                    delta, _ = read_result(store, round=2, path=entry.path, attempt=entry.attempt)
                    expected -= shard[entry.path] / total * delta[f"{name}/{key}"].double().numpy()
            np.testing.assert_allclose(after[key].double().numpy(), expected, rtol=0, atol=1e-6)


def test_a_finished_run_goes_on_when_run_rounds_grows(straight, tmp_path):
    """Issue 29, item 4: `dipaco train run.rounds=3` on a finished 2-round run failed with "every island
    process has exited": state.json kept `finished`, on which islands stop. Now the coordinator of the longer
    run takes `finished` back before any island looks, and the run trains its third round."""
    root = tmp_path / "run"
    shutil.copytree(straight.dir.root, root)
    assert run_finished(ModuleStore(str(root / "store")))
    config = load_config(TINY, ["hardware.device=cpu", "run.rounds=3"])
    save_config(config, RunDir(root).config)
    run = TinyRun(dir=RunDir(root), config=config, setup=island_setup(config, RunDir(root)))
    clock = Clock()
    coordinator = run.coordinator(clock)
    assert not run_finished(run.store), "islands would stop before the new rounds"
    assert run.store.current_round() == 2
    drive(coordinator, [run.island(f"i{k}", clock) for k in range(2)], clock)
    assert run.store.current_round() == 3 and run_finished(run.store)
    assert [sorted(e.path for e in m.applied) for m in manifests(run.store, 3)] == [[0, 1, 2, 3]] * 3
