"""A straggler's path moves (`dipaco.rounds.moves`, issue 38.2): the rule alone on hand-made speeds and
tasks, then the simulator with one island 3x slower, with the rule and without it."""

import dataclasses

import pytest

from dipaco.config import RoundsConfig, SimulateConfig
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask
from dipaco.rounds.moves import PathMoves
from dipaco.rounds.policy import RoundPolicy
from dipaco.simulate.diloco import RoundsSimulation, island_name, replica_topology
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.settings import Settings


def measured(speeds: dict[str, float], *, margin: float = 1.0) -> PathMoves:
    """A rule whose islands ran 10-step tasks at `speeds` steps per second."""
    moves = PathMoves(margin=margin)
    for name, speed in speeds.items():
        moves.measure(name, steps=10, seconds=10 / speed)
    return moves


def task(path: int, steps_done: int = 0, base: int = 0) -> OpenTask:
    return OpenTask(key=f"p{path}", path=path, base=base, steps_done=steps_done)


FAST = {"a": 1.0, "b": 1.0, "c": 1.0}


def test_speeds_are_a_running_estimate_and_slow_means_below_the_others_median_by_the_margin():
    moves = PathMoves(margin=1.0)
    moves.measure("s", steps=10, seconds=10.0)  # 1 step/s
    moves.measure("s", steps=10, seconds=40.0)  # 0.25 step/s: half weight each
    assert moves.speeds["s"] == pytest.approx(0.5 * 0.25 + 0.5 * 1.0)
    moves.measure("s", steps=0, seconds=5.0)  # nothing trained, or no time: not a measurement
    moves.measure(None, steps=10, seconds=5.0)
    moves.measure("s", steps=10, seconds=float("nan"))
    moves.measure("s", steps=10, seconds=float("inf"))
    assert moves.speeds == {"s": pytest.approx(0.625)}
    assert not moves.slow("s")  # nobody to compare with
    moves.measure("a", steps=10, seconds=10.0)
    assert not moves.slow("s")  # one other island is not enough to tell
    moves.measure("b", steps=10, seconds=10.0)
    assert not moves.slow("s")  # 0.625 x (1 + 1.0) >= 1.0: within the margin
    assert measured({**FAST, "s": 0.49}).slow("s") and not measured({**FAST, "s": 0.51}).slow("s")
    assert measured({**FAST, "s": 0.7}, margin=0.4).slow("s")
    assert not measured({**FAST, "s": 0.1}, margin=0.0).slow("s")  # 0 = off
    with pytest.raises(ValueError, match="rounds.move_margin must be >= 0"):
        PathMoves(margin=-1.0)


def test_within_the_margin_nobody_moves_and_the_assignment_is_the_usual_one():
    open_tasks = [task(0, 10), task(1, 30), task(2, 30)]
    idle = [IdleIsland("s", last_path=0), IdleIsland("a", last_path=1), IdleIsland("b", last_path=2)]
    usual = [("p1", "a"), ("p2", "b"), ("p0", "s")]
    near = measured({"a": 1.0, "b": 1.0, "c": 1.0, "s": 0.6})  # 1.67x slower, the margin allows 2x
    assert sorted(near.assign(open_tasks, idle)) == sorted(usual)
    off = measured({"a": 1.0, "b": 1.0, "c": 1.0, "s": 0.1}, margin=0.0)
    assert sorted(off.assign(open_tasks, idle)) == sorted(usual)
    sync = PathMoves(margin=1.0, enabled=False)
    for name, speed in {"a": 1.0, "b": 1.0, "c": 1.0, "s": 0.1}.items():
        sync.measure(name, steps=10, seconds=10 / speed)
    assert sorted(sync.assign(open_tasks, idle)) == sorted(usual)


def test_a_slow_islands_path_behind_swaps_with_the_fast_path_furthest_ahead():
    moves = measured({**FAST, "s": 0.3})
    open_tasks = [task(0, 10), task(1, 20), task(2, 40), task(3, 30)]
    idle = [IdleIsland("s", last_path=0), IdleIsland("a", last_path=1), IdleIsland("b", last_path=2),
            IdleIsland("c", last_path=3)]
    # path 0 (10 steps) goes to b, whose path 2 is furthest ahead (40), and s takes path 2; a and c keep theirs
    assert sorted(moves.assign(open_tasks, idle)) == [("p0", "b"), ("p1", "a"), ("p2", "s"), ("p3", "c")]
    # a free fast island (nothing of its own open) takes the path first; s takes the path furthest ahead left
    free = [IdleIsland("s", last_path=0), IdleIsland("a", last_path=1), IdleIsland("c", last_path=7)]
    assert sorted(moves.assign(open_tasks[:3], free)) == [("p0", "c"), ("p1", "a"), ("p2", "s")]


def test_a_slow_island_waits_for_a_faster_island_training_a_path_ahead_else_keeps_its_path():
    moves = measured({**FAST, "s": 0.3})
    mine = [task(0, 10)]
    alone = [IdleIsland("s", last_path=0)]
    assert moves.assign(mine, alone, busy={"a": 30, "b": 5}) == []  # a's path is ahead: a takes path 0 next
    assert moves.assign(mine, alone, busy={"b": 5, "c": 10}) == [("p0", "s")]  # nothing ahead: no move
    assert moves.assign(mine, alone, busy={}) == [("p0", "s")]  # the others are done: it keeps its path
    # then a finishes: a takes path 0, s takes a's path
    assert sorted(moves.assign([task(0, 10), task(1, 40)], [*alone, IdleIsland("a", last_path=1)],
                               busy={"b": 30})) == [("p0", "a"), ("p1", "s")]
    # pinned to its path, it is never moved
    pinned = [IdleIsland("s", last_path=0, pinned=(0,))]
    assert moves.assign(mine, pinned, busy={"a": 30}) == [("p0", "s")]


def test_no_ping_pong_a_moved_path_stays_on_the_fast_island_and_equal_paths_do_not_move():
    moves = measured({**FAST, "s": 0.3})
    # after the swap above, a trained path 0 and s path 1; path 0 is open again on a: a keeps it
    assert moves.assign([task(0, 20)], [IdleIsland("a", last_path=0)], busy={"s": 40, "b": 40}) == [("p0", "a")]
    # s's path is not behind any open path: nothing moves, even all idle at once
    even = [task(0, 30), task(1, 30), task(2, 30)]
    idle = [IdleIsland("s", last_path=0), IdleIsland("a", last_path=1), IdleIsland("b", last_path=2)]
    assert sorted(moves.assign(even, idle)) == [("p0", "s"), ("p1", "a"), ("p2", "b")]
    # the rule is deterministic: the same inputs in another order give the same decisions
    assert sorted(moves.assign(even[::-1], idle[::-1])) == sorted(moves.assign(even, idle))


def test_the_policy_measures_and_moves_in_async_only():
    grid = Grid.of(replica_topology(4))
    policy = RoundPolicy(grid, RoundsConfig(mode="async"))
    assert policy.moves.margin == RoundsConfig().move_margin == 1.0 and policy.moves.enabled
    for name, seconds in {"a": 10.0, "b": 10.0, "c": 10.0, "s": 30.0}.items():
        policy.measured(name, steps=10, seconds=seconds)
    idle = [IdleIsland("s", last_path=0), IdleIsland("a", last_path=1)]
    assert sorted(policy.assign([task(0, 10), task(1, 20)], idle)) == [("p0", "a"), ("p1", "s")]
    assert not RoundPolicy(grid, RoundsConfig(mode="sync")).moves.enabled


# --- the simulator: one learner 3x slower -----------------------------------------------------------------
class OneSlow(FailureModel):
    """No failures; learner 0 `slowdown` times slower on every task."""

    def __init__(self, slowdown: float) -> None:
        super().__init__(chip_mtbi_hours=1e12, speed_sigma=0.0, seed=0)
        self.slowdown = slowdown

    def speed_factor(self, learner: int | None = None) -> float:
        return self.slowdown if learner == 0 else 1.0


def simulated(*, slowdown: float, margin: float, pinned: bool = False) -> RoundsSimulation:
    """8 one-chip learners, 20 results of 10 steps of 2 s per path, async, a per-task overhead of ~1.3 s
    (as bench/results/islands.md's fitted one)."""
    sim = SimulateConfig(learners=8, chips_per_learner=1, chip_mtbi_hours=1e12, step_seconds=2.0, speed_sigma=0.0,
                         model_parameters=475_712, parameter_bytes=4.0, link_gbit_per_s=475_712 * 64 / 1.3e9,
                         horizon_hours=10.0)
    settings = Settings(sim=sim, rounds=RoundsConfig(mode="async", move_margin=margin), inner_steps=10)
    run = RoundsSimulation(settings, OneSlow(slowdown), mode="async", rounds=20, pinned=pinned)
    run.run()
    assert run.syncer.policy.done
    return run


def goodput(run: RoundsSimulation) -> float:
    """Applied work (steps x nominal step) / (learners x the last commit's time), from the round log."""
    steps = sum(v.steps or 10 for log in run.rounds for v in log.plan.applied)
    return steps * 2.0 / (8 * run.rounds[-1].time)


def test_the_simulated_3x_straggler_with_the_rule_reaches_most_of_the_capacity_left():
    free = goodput(simulated(slowdown=1.0, margin=1.0))
    stuck = simulated(slowdown=3.0, margin=0.0)
    moved = simulated(slowdown=3.0, margin=1.0)
    capacity = free * 22 / 24  # 7 islands at full speed and one at a third
    assert not stuck.handoffs and goodput(stuck) < 0.5 * capacity  # its path sets the run's end
    assert goodput(moved) >= 0.85 * capacity
    # paths rotated through the slow learner: several paths trained on it, each move handed its state off
    on_slow = {task.path for _, task, island in moved.handed if island == island_name(0)}
    assert len(on_slow) >= 3 and len(moved.handoffs) >= len(on_slow)
    assert all(frm != to for _, _, frm, to in moved.handoffs)
    handoff = moved.settings.handoff_bytes
    results = sum(1 for event in moved.trace if event[0] == "result")
    assert moved.bytes_moved == pytest.approx(len(moved.handed) * moved.settings.download_bytes
                                              + results * moved.settings.upload_bytes + len(moved.handoffs) * handoff)
    # every step of every path applied exactly once: 20 results x 10 steps per path
    for path in range(8):
        assert sum(v.steps or 10 for log in moved.rounds for v in log.plan.applied if v.path == path) == 200
    # pinned learners, the rule on: nothing can move (the replica benchmark's old model)
    assert goodput(simulated(slowdown=3.0, margin=1.0, pinned=True)) == pytest.approx(goodput(stuck))


# --- a tiny async run: one island slowed, its path moved mid-run ------------------------------------------
def test_a_slow_islands_path_moves_mid_run_and_every_result_is_applied_once(tiny_routed, tmp_path):
    """configs/tiny.yaml (4 paths), async, 4 islands; i0 takes every step 4x as long (faults.slowdown, paced
    to 0.02 s) and polls every third turn of the fake clock. Read back from the manifests: no result
    applied twice, none dropped, every step of every path applied; i0's first path moved to a fast
    island and i0 trained another; the moved carried state went through the store (kind inner_state)."""
    from tiny_runs import Clock, make_run

    from dipaco.islands.island.polling import IslandWorker
    from dipaco.store.board import read_manifest

    rounds = 4
    run = make_run(tiny_routed, tmp_path / "run", [f"run.rounds={rounds}", "rounds.mode=async", "rounds.quorum=0.5",
                                                   "rounds.grace_seconds=0", "rounds.max_staleness=8",
                                                   "faults.step_seconds=0.02", "resilience.heartbeat_timeout=10"])
    assert run.topology.n_paths == 4 and run.config.rounds.move_margin == 1.0
    clock = Clock()
    coordinator = run.coordinator(clock)
    slow = IslandWorker(dataclasses.replace(run.setup, slowdown=4.0), name="i0", clock=clock)
    islands = [slow, *(run.island(f"i{k}", clock) for k in range(1, 4))]
    for turn in range(600):
        if coordinator.tick():
            break
        for island in islands:
            if island is not slow or turn % 3 == 0:
                island.poll()
        clock.t += 0.5
    else:
        raise AssertionError(f"the run did not end (round {coordinator.committed})")
    entries = [e for r in range(1, coordinator.committed + 1) for e in read_manifest(run.store, r).applied]
    dropped = [e for r in range(1, coordinator.committed + 1) for e in read_manifest(run.store, r).dropped]
    assert not dropped
    keys = [(e.key, e.attempt) for e in entries]
    assert len(keys) == len(set(keys)) and len({e.key for e in entries}) == len(entries)  # none applied twice
    steps = run.config.inner.steps
    for path in range(4):  # every planned step applied (cut results count the steps they trained)
        assert sum(e.steps for e in entries if e.path == path) == rounds * steps
    assert len(entries) == sum(i.tasks_done for i in islands)  # every result an island pushed was applied
    first = min((e for e in entries if e.island == "i0"), key=lambda e: e.base)
    later = {e.island for e in entries if e.path == first.path and e.base > first.base}
    assert later - {"i0"}, "i0's first path never moved to another island"
    assert len({e.path for e in entries if e.island == "i0"}) >= 2  # i0 trained another path
    handed = sum(i.held.handed_off for i in islands)
    assert handed > 0 and run.store.traffic.counts().bytes("up", "inner_state") >= handed
