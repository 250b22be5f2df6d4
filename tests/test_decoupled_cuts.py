"""Decoupled islands with the real coordinator and islands (in one process, a fake clock): a task that falls
behind is cut and what it trained applied, a task that could no longer be applied is cancelled, a rejected
result is trained again from the newest version."""

from pathlib import Path

import pytest
import torch
from test_coordinator import Clock, drive, make_run, manifests

from dipaco.store.board import result_exists


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


class Meanwhile:
    """A fault clock that never fails: at the `at`-th check inside a task (before inner step `at` − 1)
    it runs `world()` once, so the coordinator and other islands go on while this island trains."""

    mode = "die"

    def __init__(self, at: int, world):
        self.at, self.world, self.checks, self.failures = at, world, 0, 0

    def due(self) -> bool:
        self.checks += 1
        if self.checks == self.at:
            self.world()
        return False



def test_a_task_that_falls_behind_is_cut_and_what_it_trained_is_applied(tiny, tmp_path):
    """Async, max_staleness 1: while the island pinned to path 0 trains its task from version 0, the other
    paths commit version 1. That commit cuts the task (its result can still go into round 2, no later
    one): the island stops at its next look at the board, uploads the steps it trained, and round 2
    applies them weighted by their tokens; path 0 then owes the steps it did not train, and the run
    applies every planned step of every path, dropping nothing."""
    max_staleness = 1
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0",
                                            f"rounds.max_staleness={max_staleness}", "rounds.cut_after=0",
                                            "resilience.heartbeat_timeout=10", "run.rounds=3"])
    coordinator = run.coordinator(clock)
    fast = run.island("fast", clock, pinned=[1, 2, 3])
    seen = {}

    def world() -> None:  # inside slow's task, after 2 of its inner steps
        for _ in range(100):
            slow.heartbeat()  # what its heartbeat thread does meanwhile
            fast.poll()
            clock.t += 0.5
            coordinator.tick()
            if coordinator.committed >= held.base + max_staleness:
                break
        seen["status"] = coordinator.tasks[held.key].status
        seen["cut"] = coordinator.last_stats.cut
        clock.t += run.config.resilience.heartbeat_seconds  # slow's next look at the board is due

    slow = run.island("slow", clock, pinned=[0], faults=Meanwhile(at=3, world=world))
    coordinator.tick()
    slow.heartbeat(), fast.heartbeat()
    coordinator.tick()
    held = slow.next_task()
    assert held.path == 0 and held.base == 0
    meta = slow.execute(held)
    assert seen["status"] == "cut" and seen["cut"] == 1
    steps = run.config.inner.steps
    assert meta is not None and 1 <= meta.steps < steps  # stopped early, reported what it trained
    drive(coordinator, [slow, fast], clock)
    decided = manifests(run.store, coordinator.committed)
    applied = [e for m in decided for e in m.applied]
    cut = next(e for e in applied if e.key == held.key)
    assert cut.steps == meta.steps and cut.staleness == max_staleness
    for path in range(4):  # every planned step applied, the cut result's own steps among path 0's
        assert sum(e.steps for e in applied if e.path == path) == run.config.run.rounds * steps
    assert not any(m.dropped for m in decided)


def test_a_running_task_that_can_no_longer_be_applied_is_cancelled(tiny, tmp_path):
    """A task still running when its result could no longer be applied (more than rounds.max_staleness
    behind: its island never looked at the board) is cancelled at the commit: its island stops without
    uploading, and its path trains on from the newest version."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0",
                                            "rounds.max_staleness=0", "rounds.cut_after=0",
                                            "resilience.heartbeat_timeout=10"])
    coordinator = run.coordinator(clock)
    fast = run.island("fast", clock, pinned=[1, 2, 3])
    seen = {}

    def world() -> None:
        while coordinator.committed < 1:
            slow.heartbeat()
            fast.poll()
            clock.t += 0.5
            coordinator.tick()
        seen["status"], seen["cancelled"] = coordinator.tasks[held.key].status, coordinator.last_stats.cancelled
        clock.t += run.config.resilience.heartbeat_seconds

    slow = run.island("slow", clock, pinned=[0], faults=Meanwhile(at=3, world=world))
    coordinator.tick()
    slow.heartbeat(), fast.heartbeat()
    coordinator.tick()
    held = slow.next_task()
    assert slow.execute(held) is None and slow.cancelled == [f"{held.key}#0"]
    assert seen == {"status": "cancelled", "cancelled": 1}
    assert not result_exists(run.store, round=held.round, path=0, attempt=0)  # nothing uploaded
    clock.t += 0.5
    coordinator.tick()
    again = slow.next_task()
    assert again is not None and again.path == 0 and again.base == coordinator.committed


def test_an_island_goes_on_only_while_the_board_could_still_take_its_result():
    """`result_wanted`: open or assigned (any attempt: a late older attempt is taken too) goes on;
    cancelled, lost, received from another attempt, or gone from a board newer than the task stops;
    a board that may predate the task (its round <= the task's base) or none at all says nothing."""
    from dataclasses import replace

    from dipaco.islands.island.cancellation import result_wanted
    from dipaco.store.records import Board, Task

    task = replace(Task.open(path=1, base=3, step_offset=0, inner_from=None), status="assigned", island="a")
    def board(round, *tasks):
        return Board(round=round, tasks={t.key: t for t in tasks}, paths={})
    assert result_wanted(board(3, task), task) and result_wanted(None, task)
    assert result_wanted(board(4, replace(task, status="open", island=None, attempt=1)), task)
    assert result_wanted(board(4, replace(task, island="b", attempt=1)), task)
    for status in ("cancelled", "lost", "received"):
        assert not result_wanted(board(5, replace(task, status=status)), task)
    assert result_wanted(board(3), task)  # written at version 3, maybe before the task existed
    assert not result_wanted(board(4), task)  # a later board without it: nobody will take its result


def test_a_cancelled_task_whose_version_is_gone_is_dropped_not_an_error(tiny, tmp_path):
    """An island that reads its task just before the coordinator cancels it and retention deletes its
    base version fails to read the modules: the board no longer wants the task, so the island drops it
    and asks for work; the same error for a task the board still wants is raised."""
    from dataclasses import replace

    from dipaco.store.board import read_board, write_board
    from dipaco.store.module_store import StoreError

    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["rounds.mode=async", "run.rounds=1"])
    coordinator = run.coordinator(clock)
    island = run.island("a", clock)
    coordinator.tick()
    island.heartbeat()
    coordinator.tick()
    task = island.next_task()
    coordinator.lease.release()  # the coordinator stops: the test writes the board as it would
    run.store.prune_version("modules", task.base)
    with pytest.raises(StoreError):
        island.execute(task)  # still wanted: a store that lost a version is an error
    board = read_board(run.store)
    write_board(run.store, replace(board, round=task.base + 2,
                                   tasks={**board.tasks, task.key: replace(task, status="cancelled")}))
    assert island.execute(task) is None
    assert island.cancelled == [f"{task.key}#0"] and island.status == "idle"


def test_a_result_rejected_after_a_commit_is_trained_again_from_the_newest_version(tiny, tmp_path):
    """Async: while the island pinned to path 1 trains from version 0, the other paths commit version 1.
    Its result is then rejected (a NaN in it): the path's next task starts from version 1, not as another
    attempt from version 0, which would train a result already a version stale."""
    import math

    from safetensors.torch import load_file, save_file

    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0",
                                            "rounds.max_staleness=2", "resilience.heartbeat_timeout=100",
                                            "run.rounds=3"])
    coordinator = run.coordinator(clock)
    fast = run.island("fast", clock, pinned=[0, 2, 3])
    slow = run.island("slow", clock, pinned=[1])
    coordinator.tick()
    slow.heartbeat(), fast.heartbeat()
    coordinator.tick()
    held = slow.next_task()
    assert held.path == 1 and held.base == 0
    drive(coordinator, [fast], clock, until_round=1)
    assert slow.execute(held) is not None
    result = next((Path(run.store.root) / "results" / "round-000001").glob("path-0001*.safetensors"))
    tensors = load_file(result)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], math.nan)
    save_file(tensors, result)
    coordinator.tick()
    assert "NaN" in coordinator.checks.verdicts[(held.key, 0)]
    (again,) = [t for t in coordinator.tasks.values() if t.path == 1 and t.status in ("open", "assigned")]
    assert again.base == coordinator.committed >= 1 and again.key != held.key
    assert again.step_offset == held.step_offset and again.inner_from == held.inner_from
    assert len(coordinator.checks.rejections[again.key]) == 1  # resilience.max_rejections counts on
    drive(coordinator, [slow, fast], clock)
    applied = [e for m in manifests(run.store, coordinator.committed) for e in m.applied]
    assert held.key not in {e.key for e in applied}


def test_a_cut_seen_on_the_board_stays_a_cut_without_reading_it_again():
    """BoardWatch.watch: once a look at the board finds the task cut, every later check raises TaskCut
    (the padding's check and the next step's agree), without another read of the board."""
    from dipaco.islands.island.cancellation import BoardWatch, TaskCut
    from dipaco.store.records import Task

    now, looks = [0.0], []
    board = BoardWatch(None, island="island-0", every=1.0, clock=lambda: now[0])
    board._look = lambda task: (looks.append(task.key), (True, True))[1]
    check = board.watch(Task.open(path=0, base=0, step_offset=0, inner_from=None))
    check()  # not due yet: no look
    now[0] = 1.5
    for _ in range(3):
        with pytest.raises(TaskCut):
            check()
    assert len(looks) == 1
