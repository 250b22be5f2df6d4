"""Decoupled islands with the real coordinator and islands (in one process, a fake clock): inner
checkpoints, tasks always from the newest versions, paths that train on without waiting for a commit,
paced islands, replica islands (cut and cancelled tasks: test_decoupled_cuts.py)."""

import time

import pytest
import torch
from test_coordinator import PLAIN, Clock, TinyRun, drive, make_run, manifests

from dipaco.islands.island.checkpoint import InnerCheckpoint
from dipaco.islands.island.faults import no_faults
from dipaco.islands.island.polling import IslandWorker
from dipaco.islands.island.training import rebase_on_chain
from dipaco.store.board import read_result


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


class FailInTask:
    """A `die` fault that falls due at the `at`-th check inside a task (before inner step `at` − 1),
    once; the island comes back `return_after` seconds later."""

    mode = "die"

    def __init__(self, at: int, return_after: float):
        self.at, self.return_after, self.failures, self.checks = at, return_after, 0, 0
        self.island: IslandWorker | None = None

    def due(self) -> bool:
        if self.failures or self.island is None or self.island.status != "training":
            return False
        self.checks += 1
        return self.checks >= self.at

    def fail(self) -> float:
        self.failures += 1
        return self.return_after


def killed_in_round_two(tiny, tmp_path, overrides: list[str], monkeypatch):
    """Sync, fixed seeds, one island: a run never killed, and the same run whose island dies at the 4th check
    of its first round-2 task and comes back 2 s later to resume from its inner checkpoint. Returns (straight,
    killed, the island, every inner checkpoint the killed run saved)."""
    overrides = [*overrides, "resilience.checkpoint_steps=2", "resilience.heartbeat_timeout=10"]
    clock = Clock()
    straight = make_run(tiny, tmp_path / "straight", overrides)
    drive(straight.coordinator(clock), [straight.island("a", clock)], clock)

    saved: list[InnerCheckpoint] = []
    save = InnerCheckpoint.save
    monkeypatch.setattr(InnerCheckpoint, "save", lambda self, path: (saved.append(self), save(self, path))[1])
    clock = Clock()
    killed = make_run(tiny, tmp_path / "killed", overrides)
    fault = FailInTask(at=killed.topology.n_paths * killed.config.inner.steps + 4, return_after=2.0)
    island = killed.island("a", clock, faults=fault)
    fault.island = island
    drive(killed.coordinator(clock), [island], clock)
    assert fault.failures == 1 and len(island.resumed) == 1 and island.resumed[0][1] == 2
    return straight, killed, island, saved


def assert_same_last_modules(run: TinyRun, other: TinyRun) -> None:
    """Every module of the last version is bit-identical in both runs."""
    rounds = run.config.run.rounds
    for name in run.topology.modules:
        for param, value in run.store.read_module(rounds, name).items():
            assert torch.equal(value, other.store.read_module(rounds, name)[param]), (name, param)


def modules_of(run: TinyRun, round: int) -> dict[str, dict[str, torch.Tensor]]:
    return {name: run.store.read_module(round, name) for name in run.topology.modules}


def test_an_island_killed_mid_task_resumes_from_its_inner_checkpoint(tiny, tmp_path):
    """Sync, fixed seeds: the island dies after 3 of 4 inner steps (checkpoint after 2), comes back,
    is handed the same task, resumes after step 2, and the run's modules equal an uninterrupted run's."""
    overrides = ["resilience.checkpoint_steps=2", "resilience.heartbeat_timeout=10"]
    clock = Clock()
    straight = make_run(tiny, tmp_path / "straight", overrides)
    drive(straight.coordinator(clock), [straight.island("a", clock)], clock)

    clock = Clock()
    killed = make_run(tiny, tmp_path / "killed", overrides)
    fault = FailInTask(at=4, return_after=2.0)
    island = killed.island("a", clock, faults=fault)
    fault.island = island
    drive(killed.coordinator(clock), [island], clock)

    assert fault.failures == 1
    assert len(island.resumed) == 1 and island.resumed[0][1] == 2  # resumed after 2 of its 4 steps
    assert not (killed.dir.root / "islands" / "a.safetensors").exists()  # removed once the result was in
    rounds = killed.config.run.rounds
    for name, tensors in modules_of(killed, rounds).items():
        for param, value in tensors.items():
            torch.testing.assert_close(value, modules_of(straight, rounds)[name][param], rtol=0, atol=0)
    resumed_key = island.resumed[0][0]
    entry = next(e for m in manifests(killed.store, rounds) for e in m.applied if e.key == resumed_key)
    assert entry.attempt == 1  # the same task, handed back to the restarted island as its next attempt


def test_a_task_started_afresh_replaces_another_tasks_checkpoint(tiny, tmp_path):
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["resilience.checkpoint_steps=2", "run.rounds=1"])
    fault = FailInTask(at=4, return_after=1000.0)
    a = run.island("a", clock, faults=fault)
    fault.island = a
    coordinator = run.coordinator(clock)
    coordinator.tick()
    a.heartbeat()
    coordinator.tick()
    task = a.next_task()
    assert a.execute(task) is None and (run.dir.root / "islands" / "a.safetensors").exists()
    b = IslandWorker(run.setup, name="a", clock=clock, faults=no_faults())  # a new process with a's name
    assert b.last_path == task.path  # it asks for its checkpointed path first
    other = next(t for t in coordinator.tasks.values() if t.path != task.path)
    assert b.execute(other) is not None and b.resumed == []


def test_a_returning_island_only_gets_tasks_from_the_newest_versions(tiny, tmp_path):
    """Async with two islands for four paths: tasks nobody took when a round closed move to the new
    version, so every hand-out (also to the island coming back from a failure) is based on the newest
    committed version, whose modules are in the store."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0",
                                            "rounds.max_staleness=0", "store.keep_versions=1", "run.rounds=5",
                                            "resilience.heartbeat_timeout=3"])
    coordinator = run.coordinator(clock)
    fault = FailInTask(at=2, return_after=1.0)
    a = run.island("a", clock, faults=fault)
    fault.island = a
    islands = [a, run.island("b", clock)]
    handed_out = []
    for _ in range(400):
        before = {k: t.status for k, t in coordinator.tasks.items()}
        if coordinator.tick():
            break
        for key, task in coordinator.tasks.items():
            if task.status == "assigned" and before.get(key) != "assigned":
                handed_out.append((task.island, task.base, coordinator.committed))
                assert all(run.store.has_module(task.base, m) for m in run.topology.modules_of_path(task.path))
        for island in islands:
            island.poll()
        clock.t += 0.5
    else:
        raise AssertionError("the run did not finish")
    assert fault.failures == 1
    assert len(handed_out) > 8 and all(base == committed for _, base, committed in handed_out)
    assert any(name == "a" for name, _, _ in handed_out[2:])  # a came back and got work


def test_an_island_trains_its_path_on_and_both_results_count_once_for_the_path(tiny, tmp_path):
    """Async, plain averaging: island a (path 0) reports and at once gets path 0's next task from the same
    version (link 1, chained after its first result): it starts from version 0 minus that result's Δ and
    reports the progress of its own steps. Round 1 applies both: in every module through path 0 the update
    is (W0 (Δ1 + Δ2) + Σ others W_q Δ_q) / (W0 + Σ others W_q): path 0 counts once, with both tasks' progress."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [*PLAIN, "rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0",
                                            "outer.weighting=uniform"])
    coordinator = run.coordinator(clock)
    a, b = run.island("a", clock, pinned=[0]), run.island("b", clock, pinned=[1, 2, 3])
    coordinator.tick()
    a.heartbeat(), b.heartbeat()
    coordinator.tick()
    first = a.next_task()
    assert first.path == 0 and first.base == 0 and first.link == 0 and first.chain == ()
    assert a.poll()
    clock.t += 0.5
    coordinator.tick()  # received; path 0 gets its next task at once, before any commit
    second = a.next_task()
    assert coordinator.committed == 0 and second is not None
    assert (second.path, second.base, second.link) == (0, 0, 1) and len(second.chain) == 1
    assert second.step_offset == first.step_offset + run.config.inner.steps
    assert a.poll()
    while coordinator.committed < 1:
        clock.t += 0.5
        coordinator.tick()
        b.poll()
    (round1,) = manifests(run.store, 1)
    ours = [e for e in round1.applied if e.path == 0]
    assert [e.link for e in ours] == [0, 1]
    d = {e.key: read_result(run.store, round=1, path=e.path, attempt=e.attempt, link=e.link)[0] for e in round1.applied}
    for name in run.topology.modules:
        users = [e for e in round1.applied if e.path in run.topology.paths_of_module(name)]
        paths = {e.path for e in users}
        before, after = run.store.read_module(0, name), run.store.read_module(1, name)
        for param in before:
            expected = before[param] - sum(d[e.key][f"{name}/{param}"] for e in users) / len(paths)
            torch.testing.assert_close(after[param], expected, rtol=1e-5, atol=1e-7)
    # the chained task started from version 0 minus the first result's Δ (the island's rebase)
    start = run.store.read_modules(0, run.topology.modules_of_path(0))
    rebase_on_chain(run.store, start, second)
    first_delta = read_result(run.store, round=1, path=0, attempt=0)[0]
    for key, delta in first_delta.items():
        module, _, param = key.partition("/")
        torch.testing.assert_close(start[module][param], run.store.read_module(0, module)[param] - delta)


def test_an_unreadable_inner_checkpoint_is_an_error_naming_the_file(tmp_path):
    from dipaco.islands.island.checkpoint import InnerCheckpoint

    broken = tmp_path / "a.safetensors"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="a.safetensors"):
        InnerCheckpoint.load(broken)
    assert InnerCheckpoint.load(tmp_path / "none.safetensors") is None


def test_writing_inner_checkpoints_is_not_counted_as_training_time(tiny, tmp_path, monkeypatch):
    """A result's `seconds` are the useful seconds goodput counts (docs/islands.md#goodput): the time an
    island spends writing its inner checkpoints is overhead, like loading modules, so it is left out."""
    from dipaco.islands.island.checkpoint import InnerCheckpoint
    from dipaco.islands.island.training import train_task
    from dipaco.store.records import Task

    write = InnerCheckpoint.save
    writes = []

    def slow_save(self, path):
        writes.append(self.steps)
        time.sleep(0.5)  # 1.5 s for the three writes: several times the four tiny steps' training
        write(self, path)

    monkeypatch.setattr(InnerCheckpoint, "save", slow_save)
    run = make_run(tiny, tmp_path / "run", ["resilience.checkpoint_steps=1", "run.rounds=1"])
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    out = train_task(run.setup, task, checkpoint=run.dir.root / "islands" / "a.safetensors")
    steps = run.config.inner.steps
    assert writes == list(range(1, steps))  # a checkpoint after every step but the last
    assert out.meta.seconds < 0.5 * len(writes)  # the writes took longer than that alone: they are not in it


def test_a_paced_island_pads_each_step_to_the_pace_and_a_failure_cuts_the_padding(tiny, tmp_path, caplog):
    """`faults.step_seconds` (bench/bench_islands.py's pace): every inner step takes the pace, which the
    result's `seconds` count (the paced time is the training time); the compute and padding are logged;
    the island's check runs during the padding, so a failure due there ends the step there."""
    from dipaco.islands.island.faults import IslandFailure
    from dipaco.islands.island.training import train_task
    from dipaco.store.records import Task

    pace = 0.15
    run = make_run(tiny, tmp_path / "run", ["run.rounds=1", f"faults.step_seconds={pace}"])
    steps = run.config.inner.steps
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    with caplog.at_level("INFO", logger="dipaco.islands.island.training"):
        out = train_task(run.setup, task)
    assert steps * pace <= out.meta.seconds < steps * pace + 0.5
    assert f"paced {steps} steps to {pace:g}s x 1" in caplog.text
    started = time.perf_counter()

    def check() -> None:
        if time.perf_counter() - started > 1.5 * pace:  # inside the second step's padding
            raise IslandFailure("injected")

    with pytest.raises(IslandFailure):
        train_task(run.setup, task, check=check)
    assert time.perf_counter() - started < 2 * pace + 0.3


def test_a_paced_task_cut_during_its_padding_reports_the_steps_it_trained(tiny, tmp_path):
    """A cut seen while a step is being padded (the board's look falls in the padding) ends the padding
    and then the batches: the island reports the steps it trained instead of failing."""
    from dipaco.islands.island.cancellation import TaskCut
    from dipaco.islands.island.training import train_task
    from dipaco.store.records import Task

    pace = 0.15
    run = make_run(tiny, tmp_path / "run", ["run.rounds=1", f"faults.step_seconds={pace}"])
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    started: list[float] = []  # the first look, at the first step (the set-up before it is not counted)

    def check() -> None:  # a cut stays a cut (as BoardWatch.watch's)
        if not started:
            started.append(time.perf_counter())
        if time.perf_counter() - started[0] > 1.5 * pace:  # inside the second step's padding
            raise TaskCut("cut by the coordinator")

    out = train_task(run.setup, task, check=check)
    assert 2 <= len(out.meta.losses) < run.config.inner.steps


REPLICAS = ["topology.replicas=2"]


@pytest.fixture(scope="module")
def tiny_replicas(tmp_path_factory):
    """configs/tiny.yaml with `topology.replicas=2` routed and sharded: the 2x2 grid's 4 routed paths,
    2 replica paths each (8 paths, every grid module shared by 4), as bench/bench_islands.py --replicas 2."""
    from cli_helpers import TINY

    from dipaco.config import load_config
    from dipaco.run_dir import RunDir
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard

    run = RunDir(tmp_path_factory.mktemp("tiny-replicas"))
    config = load_config(TINY, REPLICAS)
    route(config, run)
    shard(config, run)
    return run


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_replica_islands_per_routed_path_train_every_path_and_none_idles(tiny_replicas, tmp_path, mode):
    """Replicas 2 on the 2x2 grid, 8 unpinned islands (the benchmark's N = 8): the run applies
    run.rounds results for each of the 8 paths (sync: all 8 in every round), and after every
    coordinator pass no live island is idle while a task is open (its path, or another, could train)."""
    from test_coordinator import manifests as read_manifests

    from dipaco.store.records import task_key

    async_ = ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0", "rounds.max_staleness=2"]
    run = make_run(tiny_replicas, tmp_path / "run", [*REPLICAS, "resilience.heartbeat_timeout=10",
                                                     *(async_ if mode == "async" else [])])
    # 8 paths; a grid module is shared by the 4 paths through it, the embeddings by all 8
    assert run.topology.n_paths == 8
    assert {len(run.topology.paths_of_module(m)) for m in run.topology.modules} == {4, 8}
    clock = Clock()
    coordinator = run.coordinator(clock)
    islands = [run.island(f"i{n}", clock) for n in range(8)]
    for _ in range(400):
        if coordinator.tick():
            break
        open_tasks = [t for t in coordinator.tasks.values() if t.status == "open"]
        assigned = {t.island for t in coordinator.tasks.values() if t.status == "assigned"}
        idle = [i.name for i in islands if i.status == "idle" and i.down_until is None and i.name not in assigned
                and i.name in coordinator.seen]
        assert not (open_tasks and idle), f"{idle} idle while {[t.key for t in open_tasks]} are open"
        if mode == "async":  # a path that reported trains on at once: none waits for a commit
            flying = {t.path for t in coordinator.tasks.values() if t.status in ("open", "assigned", "cut")}
            owing = {p for p in range(8) if (coordinator.policy.outstanding(p) or 0) > 0}
            assert owing <= flying, f"paths {sorted(owing - flying)} wait for a commit (round {coordinator.committed})"
        for island in islands:
            island.poll()
        clock.t += 0.5
    else:
        raise AssertionError(f"the run did not finish (round {coordinator.committed})")
    rounds = run.config.run.rounds
    applied = [e for m in read_manifests(run.store, coordinator.committed) for e in m.applied]
    for path in range(8):
        assert sum(e.steps for e in applied if e.path == path) == rounds * run.config.inner.steps
    if mode == "sync":
        assert sorted(e.path for e in applied) == sorted(list(range(8)) * rounds)
        assert coordinator.committed == rounds
        for r, manifest in enumerate(read_manifests(run.store, rounds), start=1):
            assert sorted(e.key for e in manifest.applied) == [task_key(p, r - 1) for p in range(8)]
    assert sum(i.tasks_done for i in islands) >= 8 * rounds
