"""A path goes back to the island that trained it last (`dipaco.rounds.holds`, issue 35.1): the hold rule alone
on hand-made tasks and islands (held for a live holder, released after the grace, on death, on a cut, on a
straggler move), then a tiny sync run, one island per path, in which the coordinator sees each result
before its island's next heartbeat says it is idle (the race that moved paths in the 100-round runs)."""

import dataclasses

import pytest

from dipaco.config import RoundsConfig
from dipaco.rounds import tasks
from dipaco.rounds.holds import HOLD_BEATS, HOLD_FRACTION, PathHolds, hold_grace
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask, Result
from dipaco.rounds.policy import RoundPolicy

GRID = Grid(n_paths=3, modules={"m0": (0, 1, 2)})


def task(path: int, holder: str | None = None, steps_done: int = 10) -> OpenTask:
    return OpenTask(key=f"p{path}", path=path, base=1, steps_done=steps_done, holder=holder)


def idle(*names: str) -> list[IdleIsland]:
    return [IdleIsland(name=n, last_path=int(n[1:])) for n in names]


def policy(mode: str = "sync", *, beat_seconds: float = 1.0, median: float | None = None) -> RoundPolicy:
    """A policy whose median task time is `median` seconds (None: no task timed yet)."""
    p = RoundPolicy(GRID, RoundsConfig(mode=mode), beat_seconds=beat_seconds)
    if median is not None:
        p.received(Result(key="timed", path=0, base=0, tokens=1, arrived=100.0 + median, started=100.0))
        p.pending.clear()
    return p


def test_the_grace_is_a_fraction_of_the_median_task_time_and_at_least_a_few_heartbeats():
    assert hold_grace(median=20.0, beat_seconds=1.0) == HOLD_FRACTION * 20.0 == 10.0
    assert hold_grace(median=2.0, beat_seconds=1.0) == HOLD_BEATS * 1.0 == 3.0
    assert hold_grace(median=None, beat_seconds=0.5) == 1.5
    with pytest.raises(ValueError, match="heartbeat_seconds must be >= 0, got -1"):
        PathHolds(beat_seconds=-1)


def test_a_task_is_held_for_its_live_holder_then_released_after_the_grace():
    """p1's holder i1 is not idle yet: i2 (idle, its own path taken) does not take p1 until the grace
    (half the median task time, 10 s) has passed since the hold began; i1, idle within it, takes it."""
    p = policy(median=20.0)
    open_ = [task(0, "i0"), task(1, "i1"), task(2, "i2")]
    assert p.assign(open_, idle("i0", "i2"), now=50.0) == [("p0", "i0"), ("p2", "i2")]
    assert p.next_release() == 60.0
    rest = [task(1, "i1")]
    assert p.assign(rest, idle("i3"), now=59.9) == []  # i3 is free, the task still waits for i1
    assert p.assign(rest, idle("i1", "i3"), now=59.9) == [("p1", "i1")]
    assert p.next_release() is None

    late = policy(median=20.0)
    assert late.assign(rest, idle("i3"), now=50.0) == []
    assert late.assign(rest, idle("i3"), now=60.0) == [("p1", "i3")]  # past the grace: the path moves


def test_a_holder_that_is_dead_cut_or_training_another_task_is_not_waited_for():
    """The board names a dead holder, one back as another incarnation, or a cut one as `away`; one training
    another path's task (`busy`) will not ask for work soon."""
    p = policy(median=20.0)
    assert p.assign([task(1, "i1")], idle("i3"), now=50.0, away={"i1"}) == [("p1", "i3")]
    assert p.assign([task(1, "i1")], idle("i3"), now=50.0, busy={"i1": 30}) == [("p1", "i3")]
    assert p.assign([task(1, "i1")], idle("i3"), now=50.0, busy={"i2": 30}) == []


def test_a_slow_holders_path_is_not_held_the_straggler_rule_moves_it():
    """Async, i1 measured 3x slower than the others: its path goes to an idle fast island at once; a path
    whose holder runs at the others' speed is held."""
    p = policy("async", median=20.0)
    for name, seconds in {"i0": 10.0, "i1": 30.0, "i2": 10.0, "i3": 10.0}.items():
        p.measured(name, steps=10, seconds=seconds)
    assert p.moves.slow("i1") and not p.moves.slow("i2")
    assert p.assign([task(1, "i1"), task(2, "i2")], idle("i3"), now=50.0) == [("p1", "i3")]


def test_a_path_without_a_holder_is_not_held_and_the_first_assignment_is_by_name():
    p = policy(median=None)
    first = [OpenTask(key=f"p{k}", path=k, base=0) for k in range(3)]
    islands = [IdleIsland(name=n) for n in ("c", "a", "b")]
    assert p.assign(first, islands, now=0.0) == [("p0", "a"), ("p1", "b"), ("p2", "c")]
    assert p.assign([task(1, None)], idle("i3"), now=0.0) == [("p1", "i3")]  # its state is in the store
    assert p.assign([task(1, "i1")], idle("i3")) == [("p1", "i3")]  # no clock given: no hold


def test_an_island_whose_own_path_is_open_is_not_given_another_path_while_a_free_island_is_idle():
    """p0 (no holder) comes first; i1's own path p1 is open too, i5's (p5) is not: i5 takes p0, i1 keeps p1."""
    decisions = tasks.assign([task(0, steps_done=0), task(1)], idle("i1", "i5"))
    assert decisions == [("p0", "i5"), ("p1", "i1")]


# --- a tiny sync run, one island per path, the coordinator ahead of the islands' heartbeats ----------------
def test_every_path_stays_on_its_island_and_uploads_its_inner_state_only_with_its_last_task(tiny_routed, tmp_path,
                                                                                            monkeypatch):
    """configs/tiny.yaml (4 paths), 4 islands, 4 sync rounds, no inner checkpoints. The coordinator ticks right
    after each result is pushed, before that island's heartbeat says it is idle; the islands poll in
    reverse order, so the island that finishes a round last is i0 and path 0's task is open while i1..i3
    are idle. Read back from the result metadata: each path trained by one island from its first task to
    its last; the islands' own store clients counted inner-state bytes up equal to the sizes (os.stat) of
    the last tasks' carried-state files, and no island read an inner state but the run's first (the warm
    start's, for each path's first task)."""
    from tiny_runs import Clock, make_run

    from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
    from dipaco.islands.island import polling
    from dipaco.islands.island.polling import IslandWorker
    from dipaco.pipeline.context import PathFactory
    from dipaco.store.board import inner_ref, read_result_meta, warm_start_inner_ref
    from dipaco.store.module_store import ModuleStore
    from dipaco.store.traffic import ByteCounts

    rounds = 4
    run = make_run(tiny_routed, tmp_path / "run", [f"run.rounds={rounds}", "store.keep_versions=0"])
    n = run.topology.n_paths
    assert n == 4 and run.config.resilience.inner_checkpoint_every == 0
    clock, url = Clock(), str(run.dir.store)
    coordinator = Coordinator(ModuleStore(url), run.topology, settings=CoordinatorSettings.from_config(run.config),
                              sizes=PathFactory(run.config, run.dir).path_sizes, clock=clock)
    islands = [IslandWorker(dataclasses.replace(run.setup, store=ModuleStore(url)), name=f"i{k}", clock=clock)
               for k in range(n)]
    real_push = polling.push_result

    def push_then_tick(*args, **kwargs):
        pushed = real_push(*args, **kwargs)
        coordinator.tick()  # the coordinator sees the result before the island's idle heartbeat
        return pushed

    monkeypatch.setattr(polling, "push_result", push_then_tick)
    for _ in range(200):
        if coordinator.tick():
            break
        for island in reversed(islands):
            island.poll()
        clock.t += 0.5
    else:
        raise AssertionError(f"the run did not end (round {coordinator.committed})")
    for island in islands:
        island.report_traffic()
    for path in range(n):
        metas = [read_result_meta(run.store, round=r, path=path, attempt=0) for r in range(1, rounds + 1)]
        assert [m.island for m in metas] == [f"i{path}"] * rounds, f"path {path} changed island"
        assert [m.inner_upload for m in metas] == [""] * (rounds - 1) + ["last"]
    last = [run.dir.store / inner_ref(path=p, round=rounds, attempt=0) for p in range(n)]
    counts = ByteCounts.total([i.store.traffic.counts() for i in islands])
    assert counts.bytes("up", "inner_state") == sum(f.stat().st_size for f in last) > 0
    warm = run.dir.store / warm_start_inner_ref()  # every path's first task starts from it (if the run has one)
    assert counts.bytes("down", "inner_state") == (n * warm.stat().st_size if warm.exists() else 0)
    assert sum(i.held.handed_off for i in islands) == 0


@pytest.mark.parametrize("expected", [4, 0])
def test_islands_joining_one_by_one_keep_their_first_paths_state_when_the_launcher_said_how_many(tiny_routed,
                                                                                                 tmp_path, expected):
    """4 islands of a 4-path sync run join one per turn. Told that the launcher starts 4 (`expected_islands`, as
    `dipaco train` does), no first task uploads its carried state, only the last tasks; not told (0), the first
    islands to join upload theirs with their first result (fewer islands than paths were alive)."""
    from tiny_runs import Clock, make_run

    from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
    from dipaco.islands.island.polling import IslandWorker
    from dipaco.pipeline.context import PathFactory
    from dipaco.store.board import read_result_meta
    from dipaco.store.module_store import ModuleStore

    rounds = 2
    run = make_run(tiny_routed, tmp_path / "run", [f"run.rounds={rounds}", "store.keep_versions=0"])
    n, clock, url = run.topology.n_paths, Clock(), str(run.dir.store)
    settings = dataclasses.replace(CoordinatorSettings.from_config(run.config), expected_islands=expected)
    coordinator = Coordinator(ModuleStore(url), run.topology, settings=settings,
                              sizes=PathFactory(run.config, run.dir).path_sizes, clock=clock)
    islands = [IslandWorker(dataclasses.replace(run.setup, store=ModuleStore(url)), name=f"i{k}", clock=clock)
               for k in range(n)]
    for turn in range(200):
        if coordinator.tick():
            break
        for island in islands[:turn + 1]:  # island k first polls at turn k
            island.poll()
        clock.t += 0.5
    else:
        raise AssertionError(f"the run did not end (round {coordinator.committed})")
    first = [read_result_meta(run.store, round=1, path=p, attempt=0).inner_upload for p in range(n)]
    last = [read_result_meta(run.store, round=rounds, path=p, attempt=0).inner_upload for p in range(n)]
    assert last == ["last"] * n
    assert (first == [""] * n) == (expected == n), first
