"""The simulator's learners of dipaco's elastic islands (`dipaco/simulate/learner.py`, `keeps_rows`, `batch_rows`,
`keeps_batch`): the failed chip's rows trained again, a shrunk learner's slower steps in whole rows, each chip
failing on its own and never while down."""

from __future__ import annotations

import pytest
from test_simulate import hand_settings

from dipaco.simulate.clock import EventQueue
from dipaco.simulate.diloco import RoundsSimulation
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.learner import Learner, Work


def test_a_learner_that_keeps_its_batch_trains_the_failed_chips_rows_again_and_takes_longer_shrunk():
    """2 chips, 8 rows, a task of 20 s in steps of 2 s: a chip fails 1 s into the third step (its half of that
    second lost and trained again) and is back 4 s later, the other training the whole batch at half speed
    meanwhile; the task ends 2.5 s late with the whole task's chip-seconds, 1 chip-second lost. Without
    `keeps_batch` it ends on time with the shrunk chip-seconds."""
    def run(keeps_batch: bool) -> tuple[list, list, Work]:
        done, lost, queue = [], [], EventQueue()
        learner = Learner(0, 2, response="elastic", restart_seconds=4.0, reconfigure_seconds=0.0, checkpoint_steps=1,
                          queue=queue, on_done=lambda _, work: done.append((queue.now, work.chip_seconds)),
                          on_lost=lost.append, keeps_rows=True, batch_rows=8, keeps_batch=keeps_batch)
        work = Work(seconds=20.0, step=2.0)
        learner.give(work)
        queue.at(5.0, learner.fail)
        queue.run(100.0)
        return done, lost, work

    done, lost, work = run(keeps_batch=True)
    # 5 s at full speed, half a second of it lost: 4.5; 4 s at half speed: 6.5; the 13.5 s left at full speed
    assert done == [(pytest.approx(22.5), pytest.approx(40.0))] and lost == [pytest.approx(1.0)]
    assert work.done == 20.0
    done, lost, _ = run(keeps_batch=False)
    assert done == [(pytest.approx(20.0), pytest.approx(35.0))] and lost == [pytest.approx(1.0)]  # 40 - 1 - 4 s x 1


def test_a_learner_that_keeps_its_batch_stops_with_no_chip_up_and_goes_on_when_one_is_back():
    done, queue = [], EventQueue()
    learner = Learner(0, 2, response="elastic", restart_seconds=3.0, reconfigure_seconds=0.0, checkpoint_steps=1,
                      queue=queue, on_done=lambda _, work: done.append((queue.now, work.chip_seconds)),
                      on_lost=lambda _: None, keeps_rows=True, batch_rows=8, keeps_batch=True)
    learner.give(Work(seconds=10.0, step=2.0))
    queue.at(4.0, learner.fail)  # at a step's end: nothing lost
    queue.at(4.0, learner.fail)  # both chips down until 7 s, then both back
    queue.run(100.0)
    assert done == [(pytest.approx(13.0), pytest.approx(20.0))]  # 4 s, 3 s stopped, the 6 s left


def test_an_elastic_islands_chips_fail_one_by_one_and_never_while_down():
    """With `keeps_batch`, each chip of a learner fails on its own stream, again only once it is back: its gaps are
    at least the time down and, over many failures, the MTBI plus it on the mean; the simulation fails each
    learner as many times as its chips' streams say, with no chip failing while down (chips up never below 0)."""
    model = FailureModel(chip_mtbi_hours=50 / 3600, speed_sigma=0.0, seed=3)
    times = model.chip_failure_times(0, 1, down_seconds=4.0)
    first = [next(times) for _ in range(4000)]
    gaps = [b - a for a, b in zip(first, first[1:])]
    assert min(gaps) >= 4.0 and sum(gaps) / len(gaps) == pytest.approx(54.0, rel=0.05)

    settings = hand_settings(horizon_hours=12000 / 3600, inner_steps=10, learners=2, chips_per_learner=2,
                             chip_mtbi_hours=50 / 3600, restart_seconds=4.0, reconfigure_seconds=0.0,
                             learner_failure="elastic")
    sim = RoundsSimulation(settings, FailureModel(chip_mtbi_hours=50 / 3600, speed_sigma=0.0, seed=1), mode="async",
                           keeps_rows=True, batch_rows=8, keeps_batch=True)
    low = []
    for learner in sim.learners:  # record the chips up at every failure
        fail = learner.fail
        learner.fail = lambda fail=fail, learner=learner: (low.append(learner.up_chips), fail())[1]
    sim.run()
    expected = 2 * 2 * 12000 / 54.0  # chips x horizon / (MTBI + down); 960 if they failed while down
    assert sum(x.failures for x in sim.learners) == pytest.approx(expected, rel=0.04) and min(low) >= 1


def test_a_shrunk_elastic_learner_with_whole_rows_works_at_its_busiest_chips_pace():
    """8 rows over 3 of 4 chips: the busiest chip takes 3 rows, so a step takes 3/2 of a full step and the learner
    does 8/3 chips' worth of work, not 3; without `batch_rows`, the chips up; a whole or an empty learner as is."""
    def learner(rows: int) -> Learner:
        return Learner(0, 4, response="elastic", restart_seconds=3.0, reconfigure_seconds=0.0, checkpoint_steps=1,
                       queue=EventQueue(), on_done=lambda *_: None, on_lost=lambda _: None, keeps_rows=True,
                       batch_rows=rows)

    shrunk = learner(8)
    shrunk.up_chips = 3
    assert shrunk.working_chips() == pytest.approx(8 / 3)
    shrunk.give(Work(seconds=100.0, step=2.0))
    shrunk.queue.now = 6.0
    shrunk.finish_horizon()
    assert shrunk.work.chip_seconds == pytest.approx(6.0 * 8 / 3)  # what the learner booked
    continuous = learner(0)
    continuous.up_chips = 3
    assert continuous.working_chips() == 3
    for up in (4, 2, 1, 0):
        shrunk.up_chips = up
        assert shrunk.working_chips() == {4: 4, 2: 2, 1: 1, 0: 0}[up]
