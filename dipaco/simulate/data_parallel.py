"""Data parallel over every chip of every learner, as one job: `elastic=False` stops the whole job on
any chip failure (restart, roll back to the last checkpoint); `elastic=True` goes on with fewer chips
after a re-configuration pause (`dipaco.simulate.learner` has both). The gradients of each step cross
every site's link (`Settings.data_parallel_step_bytes`)."""

from __future__ import annotations

import math

from dipaco.simulate.clock import EventQueue
from dipaco.simulate.failures import FailureModel, schedule_failures
from dipaco.simulate.learner import Learner, Work
from dipaco.simulate.ledger import Ledger
from dipaco.simulate.settings import Settings


def simulate_data_parallel(settings: Settings, failures: FailureModel, *, elastic: bool) -> Ledger:
    sim = settings.sim
    queue = EventQueue()
    ledger = Ledger(chips=settings.total_chips, horizon=settings.horizon)

    def never_done(learner: Learner, work: Work) -> None:
        raise AssertionError("a data-parallel job has no end")

    def lost(chip_seconds: float) -> None:
        ledger.lost += chip_seconds

    job = Learner(0, settings.total_chips, response="elastic" if elastic else "restart",
                  restart_seconds=sim.restart_seconds, reconfigure_seconds=sim.reconfigure_seconds,
                  checkpoint_steps=sim.checkpoint_interval, queue=queue, on_done=never_done, on_lost=lost)
    job.give(Work(seconds=math.inf, step=sim.step_seconds))
    schedule_failures(queue, failures.failure_times(0, settings.total_chips), job.fail, until=settings.horizon)
    queue.run(settings.horizon)
    work = job.finish_horizon()
    partial = (work.done - work.complete_steps()) * job.up_chips  # the step cut by the horizon
    ledger.useful += work.chip_seconds - partial
    ledger.useful_work = ledger.useful  # the job's steps run at nominal speed
    ledger.lost += partial
    steps_computed = (ledger.useful + ledger.lost) / settings.total_chips / sim.step_seconds
    ledger.bytes_per_link = steps_computed * settings.data_parallel_step_bytes
    return ledger
