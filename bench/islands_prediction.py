"""The simulator's prediction for bench/bench_islands.py's rows: `dipaco simulate`'s rounds (the real round
policy on a virtual clock) and its non-elastic data parallel, with the benchmark's islands, pace, task
time, failures, restart time, checkpoints and straggler.

    python bench/bench_islands.py --predict     # adds the column to bench/results/islands.{json,md}

How a measured row maps onto a simulation (`dipaco.simulate`):
- sync / async rows: `RoundsSimulation`, one learner of one chip per path of the grid (the benchmark runs
  one island per path), pinned to it, on the benchmark's own topology, `rounds` = the run's length;
  chip_mtbi = the islands' MTBF, so it fails as a Poisson process of mean MTBF (the real islands draw
  their next failure from their return: no failure while down); learner_failure = restart: back after
  R, resuming from the checkpoint every `resilience.checkpoint_steps` (a failure cuts the step in
  progress, in the simulator as in the paced islands, where it can land in a step's padding);
- step = T / inner.steps, T the failure-free rows' mean task seconds (the pace, and what compute
  exceeded it); speed sigma = the standard deviation of log task seconds over those rows;
- the per-task overhead o (loading modules, validation, uploads, the islands' and the coordinator's
  polling, the outer step, the islands' checkpoint writes) is the simulator's transfer time (download +
  upload over the link), **fitted** so the simulated failure-free sync goodput equals the measured
  one; every other figure is a prediction;
- straggler rows: learner 0 runs `slowdown` times slower on every task; sync: pinned to path 0 (the real
  island-0 is not pinned, but keeps the path it trained last); async: learners unpinned, so the straggler
  rule (`rounds.move_margin`, from the row's overrides; `dipaco.rounds.moves`) moves its path and a move
  costs the carried state's download;
- data-parallel rows: `simulate_data_parallel` (non-elastic) over the islands' count of one-chip
  learners, step = the row's mean surviving step, restart R, the same checkpoint interval, for the
  row's measured wall-clock (a job without an end).
Goodput by work = the applied results' work (chip-seconds at nominal speed: a straggler's slow steps count
their nominal time) / (learners × the time of the last commit), as `train.json`'s from the first heartbeat
(data parallel: over its horizon); the mean over `SEEDS` failure draws.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from dipaco.config import RoundsConfig, SimulateConfig, load_config
from dipaco.model.topology import Topology
from dipaco.simulate.data_parallel import simulate_data_parallel
from dipaco.simulate.diloco import RoundsSimulation
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.settings import Settings

SEEDS = 50
NO_FAILURES_HOURS = 1e12  # a chip MTBI that never fails within a run
HORIZON_RUNS = 25  # simulated task times per result per path: a run must end before (an error otherwise)


class OneSlowLearner(FailureModel):
    """The failure model with learner 0 `slowdown` times slower on every task (a straggler)."""

    def __init__(self, *, slowdown: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slowdown = slowdown

    def speed_factor(self, learner: int | None = None) -> float:
        return super().speed_factor(learner) * (self.slowdown if learner == 0 else 1.0)


def simulated_goodput(settings: Settings, *, mode: str, topology: Topology, rounds: int | None,
                      seeds: int = SEEDS, slowdown: float = 1.0, pinned: bool = True, keeps_rows: bool = False,
                      batch_rows: int = 0, keeps_batch: bool = False) -> float:
    """Mean goodput over `seeds` failure draws of one run of `rounds` results per path (None: no length,
    training to the horizon, whose whole length is allocated); `slowdown` > 1 slows learner 0; `pinned`
    False: learners take any path the policy assigns (a straggler's path moves); `keeps_rows`: an elastic learner
    loses only the failed chip's share of the step in progress; `batch_rows`: ... and splits a step's whole rows
    over its chips up; `keeps_batch`: ... and trains the whole batch on them (its steps take longer)."""
    values = []
    for seed in range(seeds):
        sim = dataclasses.replace(settings.sim, seed=seed)
        model = dict(chip_mtbi_hours=sim.chip_mtbi_hours, speed_sigma=sim.speed_sigma, seed=seed)
        failures = OneSlowLearner(slowdown=slowdown, **model) if slowdown > 1 else FailureModel(**model)
        run = RoundsSimulation(dataclasses.replace(settings, sim=sim), failures, mode=mode, topology=topology,
                               rounds=rounds, pinned=pinned, keeps_rows=keeps_rows, batch_rows=batch_rows,
                               keeps_batch=keeps_batch)
        ledger = run.run()
        if rounds is None:
            values.append(ledger.goodput)
            continue
        if not run.syncer.policy.done:
            raise RuntimeError(f"the simulated {mode} run did not apply its {rounds} results per path within "
                               f"{sim.horizon_hours:.3g} h")
        values.append(ledger.useful_work / (settings.total_chips * run.rounds[-1].time))  # by work
    return statistics.mean(values)


def simulated_data_parallel(settings: Settings, *, seeds: int = SEEDS) -> float:
    """Mean goodput of non-elastic data parallel over all learners' chips, to the settings' horizon."""
    values = []
    for seed in range(seeds):
        sim = dataclasses.replace(settings.sim, seed=seed)
        failures = FailureModel(chip_mtbi_hours=sim.chip_mtbi_hours, speed_sigma=0.0, seed=seed)
        values.append(simulate_data_parallel(dataclasses.replace(settings, sim=sim), failures, elastic=False).goodput)
    return statistics.mean(values)


def island_settings(*, closing: RoundsConfig, learners: int, task_seconds: float, inner_steps: int, restart_seconds: float,
                    checkpoint_steps: int, overhead: float, sigma: float, mtbf_tasks: float | None,
                    parameters: int, horizon_tasks: float = 1000.0) -> Settings:
    """One-chip learners (islands) of a real run on the simulator's clock: tasks of `task_seconds` in
    `inner_steps` steps, a per-task overhead of `overhead` seconds (as the transfer time: a float32
    pseudo-gradient up and float32 modules down), failures every `mtbf_tasks` task times (None: none),
    back after `restart_seconds`, resuming from a checkpoint every `checkpoint_steps` steps; simulated for
    at most `horizon_tasks` task times (a run must end before: fewer make failure-heavy runs faster)."""
    transfer_bits = parameters * (32 + 32)  # a float32 pseudo-gradient up, float32 modules down
    sim = SimulateConfig(
        learners=learners, chips_per_learner=1,
        chip_mtbi_hours=NO_FAILURES_HOURS if mtbf_tasks is None else mtbf_tasks * task_seconds / 3600,
        restart_seconds=restart_seconds, learner_failure="restart",
        checkpoint_interval=max(1, checkpoint_steps), step_seconds=task_seconds / inner_steps,
        speed_sigma=sigma, model_parameters=parameters, parameter_bytes=4.0,
        link_gbit_per_s=transfer_bits / (max(overhead, 1e-6) * 1e9), horizon_hours=horizon_tasks * task_seconds / 3600)
    return Settings(sim=sim, rounds=closing, inner_steps=inner_steps)


def rows_of(out: dict) -> dict[str, dict]:
    return {r["name"]: r for r in out.get("rows", [])}


FAILURE_FREE = ("sync", "async")  # the failure-free rows of bench/bench_islands.py


def task_seconds(out: dict, names: tuple[str, ...] = FAILURE_FREE) -> float:
    """T: the failure-free rows' mean applied task seconds (the pace, and what compute exceeded it)."""
    each = [s for name in names for s in rows_of(out).get(name, {}).get("task_seconds_each", [])]
    return statistics.mean(each) if each else out["setting"]["task_seconds"]


def speed_sigma(out: dict, names: tuple[str, ...] = FAILURE_FREE) -> float:
    """Standard deviation of log task seconds over the failure-free rows' applied results."""
    logs = [math.log(s) for name in names for s in rows_of(out).get(name, {}).get("task_seconds_each", [])
            if s > 0]
    return statistics.pstdev(logs) if len(logs) > 1 else 0.0


def _config(out: dict, extra: list[str] = ()):
    s = out["setting"]
    return load_config(s["config"], [o for o in s["common"] if o.startswith(("rounds.", "topology."))] + list(extra))


def _topology(out: dict) -> Topology:
    config = _config(out)
    return Topology.from_config(config.topology, n_layers=config.model.n_layers)


def _settings(out: dict, *, overhead: float, sigma: float, mtbf_tasks: float | None, horizon_tasks: float | None = None,
              step_seconds: float | None = None, learners: int | None = None,
              names: tuple[str, ...] = FAILURE_FREE) -> Settings:
    s = out["setting"]
    task = task_seconds(out, names)
    if step_seconds is not None:  # data parallel: its own step
        task = step_seconds * s["inner_steps"]
    return island_settings(closing=_config(out, s["async"]).rounds, learners=learners or s["islands"], task_seconds=task,
                           inner_steps=s["inner_steps"], restart_seconds=s["restart_tasks"] * s["task_seconds"],
                           checkpoint_steps=s["checkpoint_steps"], overhead=overhead, sigma=sigma,
                           mtbf_tasks=None if mtbf_tasks is None else mtbf_tasks * s["task_seconds"] / task,
                           parameters=s["path_parameters"],
                           horizon_tasks=horizon_tasks or HORIZON_RUNS * s["rounds"])


def fit_overhead(out: dict, *, sigma: float, topology: Topology, steps: int = 20, row: str = "sync",
                 settings_of=None) -> float:
    """Per-task overhead seconds o that make the simulated goodput of the failure-free row `row` (default sync)
    the measured one; `settings_of(o)`: the simulator's settings at o (default `_settings`)."""
    target = rows_of(out)[row]["goodput"]
    mode = rows_of(out)[row]["mode"]
    rounds = out["setting"]["rounds"]
    settings_of = settings_of or (lambda o: _settings(out, overhead=o, sigma=sigma, mtbf_tasks=None))
    low, high = 0.0, task_seconds(out)
    for _ in range(steps):  # goodput falls as o grows: bisection
        mid = (low + high) / 2
        at = settings_of(mid)
        if simulated_goodput(at, mode=mode, topology=topology, rounds=rounds) > target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def mtbf_where(goodput_at, target: float, *, low: float, high: float, steps: int) -> float:
    """The MTBF (task times) in [low, high] at which `goodput_at(mtbf)`, rising with the MTBF, crosses
    `target`: `steps` bisections on log MTBF."""
    for _ in range(steps):
        middle = math.sqrt(low * high)
        if goodput_at(middle) > target:
            high = middle
        else:
            low = middle
    return math.sqrt(low * high)


def mtbf_for_sync(out: dict, *, target: float, seeds: int = 20) -> float:
    """The MTBF (task times) at which the simulator predicts sync goodput `target` for these settings,
    from the failure-free rows (the fitted overhead and the measured speed sigma)."""
    topology, sigma = _topology(out), speed_sigma(out)
    overhead = fit_overhead(out, sigma=sigma, topology=topology)

    def sync_goodput(mtbf: float) -> float:
        at = _settings(out, overhead=overhead, sigma=sigma, mtbf_tasks=mtbf)
        return simulated_goodput(at, mode="sync", topology=topology, rounds=out["setting"]["rounds"], seeds=seeds)

    return mtbf_where(sync_goodput, target, low=0.1, high=64.0, steps=12)


def mtbf_for_data_parallel(out: dict, *, target: float, seeds: int = 20) -> float:
    """The MTBF (task times) at which the simulator predicts data-parallel goodput `target` over the
    failure-free job's length (rounds x T), at the pace."""
    s = out["setting"]

    def dp_goodput(mtbf: float) -> float:
        at = _settings(out, overhead=0.0, sigma=0.0, mtbf_tasks=mtbf, horizon_tasks=s["rounds"],
                       step_seconds=s["step_seconds"])
        return simulated_data_parallel(at, seeds=seeds)

    return mtbf_where(dp_goodput, target, low=0.1, high=64.0, steps=12)


def data_parallel_prediction(out: dict, row: dict, *, learners: int | None = None,
                             names: tuple[str, ...] = FAILURE_FREE) -> float:
    """The simulator's goodput of a measured data-parallel row: `learners` one-chip learners (default the
    islands' count) as one non-elastic job, its mean surviving step, for the row's wall-clock."""
    s, ledger = out["setting"], row["ledger"]
    step = ledger["useful"] / ledger["steps"] if ledger["steps"] else s["step_seconds"]
    at = _settings(out, overhead=0.0, sigma=0.0, mtbf_tasks=row["mtbf_tasks"], step_seconds=step, names=names,
                   learners=learners, horizon_tasks=row["run_seconds"] / (step * s["inner_steps"]))
    return simulated_data_parallel(at)


def predict_rows(out: dict) -> dict:
    """{"settings": one line, "overhead_seconds", "speed_sigma", "runs": [{"run", "goodput", "fitted"}]};
    a row predicted before with the same inputs keeps its prediction (`out["prediction"]`)."""
    rows = rows_of(out)
    if "sync" not in rows:
        return {"settings": "not predicted: no failure-free sync row to fit the overhead to", "runs": []}
    s = out["setting"]
    topology, sigma = _topology(out), speed_sigma(out)
    if s["islands"] != topology.n_paths:
        return {"settings": f"not predicted: the simulator pins one learner per path ({topology.n_paths}), the "
                            f"benchmark ran {s['islands']} islands", "runs": []}
    before = out.get("prediction") or {}
    same_fit = before.get("fitted_to") == [rows["sync"]["goodput"], sigma, task_seconds(out)]
    overhead = before["overhead_seconds"] if same_fit else fit_overhead(out, sigma=sigma, topology=topology)
    known = {p["run"]: p for p in before.get("runs", [])} if same_fit else {}
    runs = []
    for name, row in rows.items():
        inputs = [row.get("mtbf_tasks"), row.get("slowdown", 1.0), row.get("run_seconds") if row["mode"] == "dp" else None]
        moves = row["mode"] == "async" and row.get("slowdown", 1.0) > 1  # the straggler rule moves its path
        margin = _config(out, row.get("overrides", [])).rounds.move_margin if moves else None
        inputs += [margin] if moves else []
        if name in known and known[name].get("inputs") == inputs:
            runs.append(known[name])
            continue
        if row["mode"] == "dp":
            goodput = data_parallel_prediction(out, row)
        else:
            at = _settings(out, overhead=overhead, sigma=sigma, mtbf_tasks=row.get("mtbf_tasks"),
                           horizon_tasks=HORIZON_RUNS * s["rounds"] * row.get("slowdown", 1.0))
            if moves:
                at = dataclasses.replace(at, rounds=dataclasses.replace(at.rounds, move_margin=margin))
            goodput = simulated_goodput(at, mode=row["mode"], topology=topology, rounds=s["rounds"],
                                        slowdown=row.get("slowdown", 1.0), pinned=not moves)
        runs.append({"run": name, "goodput": goodput, "fitted": name == "sync", "inputs": inputs})
    task = task_seconds(out)
    return {"settings": (f"{s['islands']} learners of one chip pinned to the grid's paths, task {task:.2f}s "
                         f"({s['inner_steps']} steps), restart {s['restart_tasks'] * s['task_seconds']:.1f}s, checkpoint "
                         f"every {s['checkpoint_steps']} steps, per-task overhead {overhead:.2f}s (fitted to the "
                         f"failure-free sync goodput), speed sigma {sigma:.3f} (from the failure-free rows' task "
                         f"times); data parallel: {s['islands']} one-chip learners as one non-elastic job over the "
                         f"row's wall-clock; mean of {SEEDS} failure draws (bench/islands_prediction.py)"),
            "overhead_seconds": overhead, "speed_sigma": sigma, "fitted_to": [rows["sync"]["goodput"], sigma, task],
            "runs": runs}
