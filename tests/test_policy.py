"""The round policy (`dipaco.rounds`) on its own: events in, decisions out, a clock it is given."""

import pytest

from dipaco.config import RoundsConfig, TopologyConfig
from dipaco.model.topology import Topology
from dipaco.rounds.inputs import Grid, IdleIsland, OpenTask, Result, Running
from dipaco.rounds.policy import RoundPolicy
from dipaco.rounds.staleness import staleness_weight

ASYNC = RoundsConfig(mode="async", quorum=0.5, grace_fraction=1.0, grace_seconds=10.0, max_staleness=2,
                     staleness_power=1.0)  # a grace window of one task time, at most 10 s


def grid(**topology) -> Grid:
    return Grid.of(Topology.from_config(TopologyConfig(levels=[2, 2], **{"private_embeddings": False, **topology}), n_layers=4))


def result(path: int, base: int, *, arrived: float = 0.0, started: float | None = None, tokens: int = 100) -> Result:
    return Result(key=f"p{path}-b{base}", path=path, base=base, tokens=tokens, arrived=arrived, started=started)


def test_private_modules_do_not_force_sync():
    """With every block and the embeddings private, a round still closes on the shared modules' quorum."""
    g = grid(private_blocks=[0, 1, 2, 3], private_embeddings=True)
    assert g.shared == [], "every module is private here"
    shared_too = grid(private_blocks=[1, 3])  # level modules shared by 2 paths, plus private blocks
    assert any(len(paths) == 1 for paths in shared_too.modules.values()) and shared_too.shared
    policy = RoundPolicy(shared_too, ASYNC)
    policy.received(result(0, 0))
    policy.received(result(3, 0))  # paths 0 and 3 cover every shared module once; 1 and 2 are missing
    assert policy.close_due(0.0)  # nothing of 1 and 2 is running: no grace to wait for
    plan = policy.plan()
    private_of_1 = [m for m, paths in shared_too.modules.items() if paths == (1,)]
    assert private_of_1 and all(plan.modules[m] == () for m in private_of_1)  # carried over, not waited for
    only_private = RoundPolicy(g, ASYNC)
    only_private.received(result(2, 0))
    assert only_private.close_due(0.0)


def test_sync_waits_for_every_path_and_applies_each_with_weight_one():
    policy = RoundPolicy(grid(private_blocks=[1]), RoundsConfig(mode="sync"))
    for path in (0, 1, 2):
        policy.received(result(path, 0))
    assert not policy.close_due(1e9)
    policy.received(result(3, 0))
    assert policy.close_due(0.0)
    plan = policy.plan()
    assert {c.factor for cs in plan.modules.values() for c in cs} == {1.0}
    assert all(len(cs) == len(policy.grid.modules[m]) for m, cs in plan.modules.items())


def test_staleness_is_per_module_and_the_rescale_counts_paths_through_the_module():
    g = grid(private_blocks=[1])
    policy = RoundPolicy(g, ASYNC, committed=3, applied=[(3, 0)])
    policy.received(result(0, 1))  # two versions old for the shared modules
    policy.received(result(1, 3))
    plan = policy.plan()
    verdict = next(v for v in plan.verdicts if v.path == 0)
    assert verdict.staleness == 2 and verdict.factor == pytest.approx(1 / 3)
    private = next(m for m, paths in g.modules.items() if paths == (0,))
    (own,) = plan.modules[private]
    assert own.staleness == 1 and own.factor == pytest.approx(0.5)  # one own result applied since (round 3)
    assert plan.paths_through[private] == 1 and plan.paths_through["embeddings"] == 4
    policy.received(result(2, 0))
    assert next(v for v in policy.plan().verdicts if v.path == 2).factor is None  # 3 > max_staleness: dropped


def test_a_chained_result_is_stale_for_its_private_modules_only_by_results_its_chain_lacks():
    """Async, round 3: path 0's results a, b (round 1) and c (round 2) were applied since version 0. A result
    from version 0 chained on a and b starts from them: for its private module only c counts (1 stale,
    factor 1/2), for its shared ones the two versions (1/3). One chained on none of them is three results
    stale for its private module, past rounds.max_staleness 2: dropped whole (factor and private factor
    None, no contribution), so nothing reports an update that is not applied."""
    g = grid(private_blocks=[1])
    private = next(m for m, paths in g.modules.items() if paths == (0,))
    applied = [(1, 0, None, "a"), (1, 0, None, "b"), (2, 0, None, "c")]
    policy = RoundPolicy(g, ASYNC, committed=2, applied=applied)
    policy.received(Result(key="d", path=0, base=0, tokens=100, arrived=0.0, chain=frozenset({"a", "b"})))
    plan = policy.plan()
    (verdict,) = plan.verdicts
    assert (verdict.staleness, verdict.private_staleness) == (2, 1)
    assert (verdict.factor, verdict.private_factor) == (pytest.approx(1 / 3), pytest.approx(0.5))
    assert [c.factor for c in plan.modules[private]] == [pytest.approx(0.5)]
    assert [c.factor for c in plan.modules["embeddings"]] == [pytest.approx(1 / 3)]
    policy.withdraw("d")
    policy.received(Result(key="e", path=0, base=0, tokens=100, arrived=0.0))
    plan = policy.plan()
    (verdict,) = plan.verdicts
    assert (verdict.staleness, verdict.private_staleness) == (2, 3)
    assert verdict.factor is None and verdict.private_factor is None and plan.applied == []
    assert all(cs == () for cs in plan.modules.values())


def test_the_grace_window_waits_only_for_paths_expected_in_time():
    g = grid()
    policy = RoundPolicy(g, ASYNC)
    policy.received(result(0, 0, arrived=10.0, started=0.0))  # a task takes 10 s
    policy.received(result(3, 0, arrived=10.0, started=0.0))
    soon = Running(key="p1-b0", path=1, base=0, started=5.0)  # expected at 15 < 10 + grace 10
    late = Running(key="p2-b0", path=2, base=0, started=9.5)  # expected at 19.5 < 20: waited for
    assert not policy.close_due(10.0, running=[soon, late])
    assert policy.close_due(20.0, running=[soon, late])  # the window has passed
    policy2 = RoundPolicy(g, ASYNC)
    policy2.received(result(0, 0, arrived=10.0, started=0.0))
    policy2.received(result(3, 0, arrived=10.0, started=0.0))
    slow = Running(key="p1-b0", path=1, base=0, started=10.0)  # expected at 20, the window's end: waited for
    assert not policy2.close_due(10.0, running=[slow])
    slower = Running(key="p1-b0", path=1, base=0, started=10.5)  # expected at 20.5 > 20: not waited for
    policy3 = RoundPolicy(g, ASYNC)
    for r in (result(0, 0, arrived=10.0, started=0.0), result(3, 0, arrived=10.0, started=0.0)):
        policy3.received(r)
    assert policy3.close_due(10.0, running=[slower])


def test_an_async_path_trains_on_without_waiting_for_a_commit():
    """Async: a path that reported gets its next task at once, from the same version (its island never
    waits); sync: only after a round has applied its result."""
    for config, expected in ((ASYNC, [0, 3]), (RoundsConfig(mode="sync"), [])):
        policy = RoundPolicy(grid(), config, rounds=3)
        policy.received(result(0, 0, arrived=1.0, started=0.0))
        policy.received(result(3, 0, arrived=1.0, started=0.0))
        assert policy.committed == 0 and policy.paths_to_open(busy={1, 2}) == expected, config.mode


def test_idle_islands_do_not_end_the_grace_window():
    """A round waits for the results expected within the window whatever the islands do (none idles in
    async: each trains its path on)."""
    policy = RoundPolicy(grid(), ASYNC)
    policy.received(result(0, 0, arrived=1.0, started=0.0))
    policy.received(result(3, 0, arrived=1.0, started=0.0))
    running = [Running(key="p1-b0", path=1, base=0, started=0.5)]  # expected at 1.5, within the window
    assert not policy.close_due(1.0, running=running, open=[])
    assert policy.close_due(1.0, running=[])  # nothing expected: no wait


def test_the_grace_window_adapts_to_the_measured_task_time():
    """The window is rounds.grace_fraction x the median task time (at most rounds.grace_seconds): with
    tasks of 10 s and a fraction of 0.25 the round waits 2.5 s after its quorum, for results expected by then."""
    config = RoundsConfig(mode="async", quorum=0.5, grace_fraction=0.25, grace_seconds=100.0)
    policy = RoundPolicy(grid(), config)
    policy.received(result(0, 0, arrived=10.0, started=0.0))
    policy.received(result(3, 0, arrived=10.0, started=0.0))
    inside = Running(key="p1-b0", path=1, base=0, started=2.0)  # expected at 12 <= 12.5
    outside = Running(key="p2-b0", path=2, base=0, started=3.0)  # expected at 13 > 12.5
    assert not policy.close_due(10.0, running=[inside, outside])  # waits for path 1 only
    assert policy.close_due(10.0, running=[outside])  # no result expected within it: closes at once
    assert policy.grace_deadline() == pytest.approx(12.5)
    capped = RoundPolicy(grid(), RoundsConfig(mode="async", quorum=0.5, grace_fraction=0.25, grace_seconds=1.0))
    capped.received(result(0, 0, arrived=10.0, started=0.0))
    capped.received(result(3, 0, arrived=10.0, started=0.0))
    assert capped.close_due(10.0, running=[inside])  # a 1 s window: path 1, expected at 12, is past it
    assert capped.grace_deadline() == pytest.approx(11.0)


def test_stragglers_are_cut_not_waited_for_and_never_twice():
    """Async, tasks of 10 s: a running task longer than rounds.cut_after median task times is cut at that
    time; one that has run a median task time and is rounds.max_staleness versions behind is cut at once
    (its result can still go into the next round, no later one); a task already cut is not cut again;
    nothing is cut before a task time was measured; sync never cuts."""
    config = RoundsConfig(mode="async", quorum=0.5, max_staleness=2, cut_after=2.0)
    policy = RoundPolicy(grid(), config, committed=3)
    behind = Running("p0-b1", 0, 1, started=100.0)  # 2 versions behind version 3
    fresh = Running("p1-b3", 1, 3, started=100.0)
    assert policy.cut([behind, fresh], now=111.0) == []  # no task time measured yet
    policy.received(result(2, 3, arrived=10.0, started=0.0))  # a task takes 10 s
    assert policy.cut([behind, fresh], now=105.0) == []  # behind, but younger than a task time
    assert policy.cut([behind, fresh], now=111.0) == ["p0-b1"]
    assert policy.cut([Running("p0-b1", 0, 1, started=100.0, cut=True)], now=111.0) == []
    assert policy.next_cut([fresh]) == pytest.approx(120.0)
    assert policy.cut([fresh], now=119.0) == [] and policy.cut([fresh], now=121.0) == ["p1-b3"]
    sync = RoundPolicy(grid(), RoundsConfig(mode="sync"), committed=3)
    assert sync.cut([behind], now=1e9) == [] and sync.next_cut([behind]) is None


def test_the_runs_length_counts_the_steps_applied_a_cut_result_its_own():
    """rounds 2 of 10 steps: 20 steps per path; a result cut after 4 steps counts 4, and the path owes 16."""
    policy = RoundPolicy(grid(), ASYNC, rounds=2, inner_steps=10)
    policy.received(Result(key="p0-b0", path=0, base=0, tokens=40, arrived=1.0, steps=4))
    for path in (1, 2, 3):
        policy.received(result(path, 0))  # whole tasks
    assert [policy.outstanding(p) for p in range(4)] == [16, 10, 10, 10]
    plan = policy.plan()
    policy.commit(plan)
    assert [policy.applied_steps(p) for p in range(4)] == [4, 10, 10, 10] and not policy.done


def test_open_tasks_move_to_the_newest_version_and_lost_ones_are_replaced_in_async():
    policy = RoundPolicy(grid(), ASYNC, committed=2)
    open_tasks = [OpenTask("p0-b1", 0, 1), OpenTask("p1-b2", 1, 2)]
    assert policy.rebase(open_tasks) == [open_tasks[0]]
    assert policy.on_lost(1) == "replace" and policy.on_lost(2) == "retry"
    assert policy.on_lost(1, resumable=True) == "retry"  # back with the task's checkpoint: still its own
    assert RoundPolicy(grid(), RoundsConfig(mode="sync"), committed=2).on_lost(1) == "retry"
    # async keeps the versions a result may still be applied from: committed - max_staleness ... committed
    assert policy.keep_from(keep_rounds=1, bases=[]) == policy.committed - ASYNC.max_staleness
    assert policy.keep_from(keep_rounds=1, bases=[-1]) == -1  # and the base of every task open or running
    assert RoundPolicy(grid(), RoundsConfig(mode="sync"), committed=5).keep_from(keep_rounds=1, bases=[3]) == 3
    assert policy.keep_from(keep_rounds=0, bases=[0]) is None


def test_a_cut_islands_path_goes_to_another_idle_island_first():
    """An island whose task was cut (a straggler) loses its claim on the path it trained last, and idle
    islands that were never cut go first; alone, it still takes the task."""
    policy = RoundPolicy(grid(), ASYNC)
    task = [OpenTask(key="p0", path=0, base=3, steps_done=120)]
    assert policy.assign(task, [IdleIsland("a", last_path=0), IdleIsland("b")]) == [("p0", "a")]
    assert policy.assign(task, [IdleIsland("a", last_path=0, was_cut=True), IdleIsland("b")]) == [("p0", "b")]
    assert policy.assign(task, [IdleIsland("a", last_path=0, was_cut=True)]) == [("p0", "a")]
    assert policy.assign(task, [IdleIsland("a", last_path=0, was_cut=True), IdleIsland("b", pinned=(0,))]) == [("p0", "b")]


def test_assignment_prefers_pinned_then_last_path_and_respects_pins():
    policy = RoundPolicy(grid(), ASYNC)
    open_tasks = [OpenTask("p0", 0, 0), OpenTask("p1", 1, 0), OpenTask("p2", 2, 0)]
    idle = [IdleIsland("a"), IdleIsland("b", last_path=1), IdleIsland("c", pinned=(0,))]
    assert sorted(policy.assign(open_tasks, idle)) == [("p0", "c"), ("p1", "b"), ("p2", "a")]
    assert policy.assign(open_tasks, [IdleIsland("d", pinned=(3,))]) == []
    behind = [OpenTask("p0", 0, 1, steps_done=50), OpenTask("p3", 3, 1, steps_done=25)]
    assert policy.assign(behind, [IdleIsland("a")]) == [("p3", "a")]  # the path furthest behind first


def test_the_round_policy_imports_neither_torch_nor_the_store_nor_the_model():
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys, dipaco.rounds\n"
            "for m in pkgutil.iter_modules(dipaco.rounds.__path__): importlib.import_module(f'dipaco.rounds.{m.name}')\n"
            "print(sorted(m for m in ('torch', 'dipaco.store', 'dipaco.model') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_runs_length_is_applied_results_per_path_and_its_end_waits_for_the_last_tasks():
    """rounds=2: a path with its results covered gets no new task; once the tasks in flight cover every
    result still outstanding, the round waits for them past the grace window and any idle island."""
    policy = RoundPolicy(grid(), ASYNC, rounds=2)
    assert [policy.outstanding(p) for p in range(4)] == [2, 2, 2, 2] and not policy.done
    slow = [Running("p1-b0", 1, 0, None), Running("p2-b0", 2, 0, None)]
    policy.received(result(0, 0))
    policy.received(result(3, 0))  # paths 0 and 3 are a quorum of every shared module
    assert not policy.close_due(0.0, running=slow)  # paths 1 and 2 owe 2 results each: the usual grace window
    assert policy.close_due(10.0, running=slow)
    policy.commit(policy.plan())
    assert policy.paths_to_open(busy={1, 2}) == [0, 3]  # (also before the commit: async never waits)
    policy.received(result(0, 1))
    policy.received(result(3, 1))
    assert [policy.outstanding(p) for p in range(4)] == [0, 2, 2, 0]
    assert policy.paths_to_open(busy={1, 2}) == []  # paths 0 and 3 are covered: no more tasks for them
    assert not policy.close_due(20.0, running=slow)  # the grace window waits for their results (still applicable)
    assert policy.close_due(30.0, running=slow)  # paths 1 and 2 will need more tasks: not the end yet
    policy.commit(policy.plan())
    policy.received(result(1, 0, arrived=25.0))
    policy.received(result(2, 0, arrived=30.0))
    assert policy.paths_to_open(busy=set()) == [1, 2]  # each owes one more result
    last = [Running("p1-b2", 1, 2, 25.0), Running("p2-b2", 2, 2, 30.0)]
    # the tasks in flight cover everything outstanding: the end; it waits for both
    assert not policy.close_due(30.0, running=last)
    assert not policy.close_due(500.0, running=last)  # nor does the grace window
    policy.received(result(1, 2, arrived=501.0, started=25.0))
    assert not policy.close_due(501.0, running=last[1:])
    policy.received(result(2, 2, arrived=600.0, started=30.0))
    assert policy.close_due(600.0)
    plan = policy.plan()
    assert [(v.path, v.staleness) for v in plan.applied] == [(1, 2), (1, 0), (2, 2), (2, 0)] and policy.finishes(plan)
    policy.commit(plan)
    assert policy.done and policy.paths_to_open(busy=set()) == []
    assert [policy.applied_results(p) for p in range(4)] == [2, 2, 2, 2]


def test_a_dropped_result_leaves_its_path_work_to_do():
    policy = RoundPolicy(grid(), RoundsConfig(mode="async", quorum=0.25, max_staleness=0), rounds=1, committed=1)
    policy.received(result(0, 0))  # one version old, max_staleness 0: the next round drops it
    assert policy.outstanding(0) == 1 and policy.paths_to_open(busy={1, 2, 3}) == [0]
    policy.received(result(1, 1))
    assert policy.outstanding(1) == 0 and 1 not in policy.paths_to_open(busy=set())
    with pytest.raises(ValueError, match="run.rounds"):
        RoundPolicy(grid(), ASYNC, rounds=0)


def test_every_paths_outstanding_results_in_one_pass_match_outstanding():
    policy = RoundPolicy(grid(), ASYNC, rounds=3)
    for path, base in ((0, 0), (1, 0), (3, 0)):
        policy.received(result(path, base))
    for _ in range(3):
        policy.commit(policy.plan())
    for path, base in ((0, 1), (0, 2), (2, 0), (3, 2)):  # path 2's result from version 0 is past max_staleness
        policy.received(result(path, base))
    assert policy.outstanding_all() == [policy.outstanding(p) for p in range(4)] == [0, 2, 3, 1]
    assert RoundPolicy(grid(), ASYNC).outstanding_all() == [None] * 4


def test_a_resumable_task_whose_result_would_be_dropped_is_replaced():
    """An island back with its checkpoint resumes its task only while the result can still be applied:
    once more than rounds.max_staleness versions were committed after its base, the result would be
    dropped whatever happens, so the island gets a task from the newest version instead."""
    config = RoundsConfig(mode="async", quorum=0.5, max_staleness=1)
    policy = RoundPolicy(grid(), config, committed=3)
    assert policy.on_lost(2, resumable=True) == "retry"  # staleness 1 at the next round: applied, weighted
    assert policy.on_lost(1, resumable=True) == "replace"  # staleness >= 2 > max_staleness: would be dropped
    assert staleness_weight(policy.committed - 1, config=config) is None


def test_async_cancels_exactly_the_running_tasks_whose_result_could_no_longer_be_applied():
    """After each commit a running task based on b is cancelled once committed - b >= max_staleness + 1:
    the result it would deliver into the next round is one `plan` drops (checked against `plan` itself)."""
    limit = ASYNC.max_staleness
    policy = RoundPolicy(grid(), ASYNC)
    running = [Running(key=f"p{p}-b0", path=p, base=0, started=0.0) for p in (0, 1)]
    cancelled_at = None
    for _ in range(limit + 1):
        policy.received(result(2, policy.committed))
        policy.received(result(3, policy.committed))
        policy.commit(policy.plan())
        verdicts = []
        for task in running:  # what the next round would do with each running task's result, were it in now
            probe = RoundPolicy(grid(), ASYNC, committed=policy.committed)
            probe.received(Result(key=task.key, path=task.path, base=task.base, tokens=1, arrived=0.0))
            verdicts.append(probe.plan().verdicts[0].factor)
        cancelled = policy.cancel(running)
        assert cancelled == [t.key for t, factor in zip(running, verdicts) if factor is None]
        if cancelled and cancelled_at is None:
            cancelled_at = policy.committed
    assert cancelled_at == limit + 1  # kept through committed - b = max_staleness, cancelled at max_staleness + 1
    boundary = RoundPolicy(grid(), ASYNC, committed=10)
    tasks = [Running(key=f"b{b}", path=0, base=b, started=None) for b in range(10 - limit - 2, 11)]
    cancelled = boundary.cancel(tasks)
    assert cancelled == [t.key for t in tasks if 10 - t.base >= limit + 1]
    assert [10 - t.base for t in tasks if t.key in cancelled] == [limit + 2, limit + 1]  # max_staleness itself stays
    assert boundary.cancel([]) == []


def test_sync_never_cancels():
    policy = RoundPolicy(grid(), RoundsConfig(mode="sync"), committed=5)
    assert policy.cancel([Running(key=f"b{b}", path=0, base=b, started=0.0) for b in range(6)]) == []
    zero = RoundPolicy(grid(), RoundsConfig(mode="async", max_staleness=0), committed=5)
    assert zero.cancel([Running("old", 0, 4, 0.0), Running("new", 1, 5, 0.0)]) == ["old"]
