"""The simulator's prediction for bench/bench_islands.py's runs: `dipaco simulate`'s rounds (the real round
policy on a virtual clock) with the benchmark's islands, task time, failures, restart time and checkpoints.

    python bench/bench_islands.py --predict     # adds the column to bench/results/islands.{json,md}

How the measured settings map onto a simulation (`dipaco.simulate.diloco.RoundsSimulation`, one learner
per path of the demo grid, pinned to it, on the demo's own topology, `rounds` = the run's length):
- a learner is one island of one chip; chip_mtbi = the islands' MTBF, so it fails as a Poisson process
  of mean MTBF (the real islands draw their next failure from their return: no failure while down);
- learner_failure = restart: back after R, resuming from the checkpoint every `resilience.checkpoint_steps`;
- step = T / inner.steps, T the failure-free sync run's mean task seconds (inner loop);
- speed sigma = the standard deviation of log task seconds over the failure-free runs' results
  (the shared cores' variation);
- the per-task overhead o (loading modules, validation, uploads, the islands' and the coordinator's
  polling, the outer step) is the simulator's transfer time (download + upload over the link), **fitted**
  so the simulated failure-free sync goodput equals the measured one; every other figure is a prediction;
- a straggler run (island-0 F times slower) has no counterpart (the simulator's speeds are random per
  task), so it gets no prediction.
Goodput = useful chip-seconds / (learners × the time of the last commit), as `train.json`'s from the
first heartbeat; the mean over `SEEDS` failure draws.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from dipaco.config import RoundsConfig, SimulateConfig, load_config
from dipaco.model.topology import Topology
from dipaco.simulate.diloco import RoundsSimulation
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.settings import Settings

SEEDS = 50
NO_FAILURES_HOURS = 1e12  # a chip MTBI that never fails within a run
HORIZON_RUNS = 25  # simulated task times per result per path: a run must end before (an error otherwise)


def simulated_goodput(settings: Settings, *, mode: str, topology: Topology, rounds: int | None,
                      seeds: int = SEEDS) -> float:
    """Mean goodput over `seeds` failure draws of one run of `rounds` results per path (None: no length,
    training to the horizon, whose whole length is allocated)."""
    values = []
    for seed in range(seeds):
        sim = dataclasses.replace(settings.sim, seed=seed)
        run = RoundsSimulation(dataclasses.replace(settings, sim=sim),
                               FailureModel(chip_mtbi_hours=sim.chip_mtbi_hours, speed_sigma=sim.speed_sigma, seed=seed),
                               mode=mode, topology=topology, rounds=rounds)
        ledger = run.run()
        if rounds is None:
            values.append(ledger.goodput)
            continue
        if not run.syncer.policy.done:
            raise RuntimeError(f"the simulated {mode} run did not apply its {rounds} results per path within "
                               f"{sim.horizon_hours:.3g} h")
        values.append(ledger.useful / (sim.learners * run.rounds[-1].time))
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


def _settings(out: dict, *, overhead: float, sigma: float, mtbf_tasks: float | None) -> Settings:
    b = out["budget"]
    config = load_config(b["config"], [o for o in b["overrides"] if o.startswith(("rounds.", "topology."))]
                         + b["async_overrides"])
    task = b["task_seconds"]
    return island_settings(closing=config.rounds, learners=b["islands"], task_seconds=task,
                           inner_steps=b["inner_steps_per_task"], restart_seconds=b["restart_tasks"] * task,
                           checkpoint_steps=b["checkpoint_steps"], overhead=overhead, sigma=sigma,
                           mtbf_tasks=mtbf_tasks, parameters=b["path_parameters"], horizon_tasks=HORIZON_RUNS * b["rounds"])


def _topology(out: dict) -> Topology:
    config = load_config(out["budget"]["config"], [o for o in out["budget"]["overrides"] if o.startswith("topology.")])
    return Topology.from_config(config.topology, n_layers=config.model.n_layers)


def fit_overhead(out: dict, *, sigma: float, topology: Topology) -> float:
    """Per-task overhead seconds o that make the simulated failure-free sync goodput the measured one."""
    target = next(g["goodput"] for g in out["goodput"] if g["run"] == "sync")
    rounds = out["budget"]["rounds"]
    low, high = 0.0, out["budget"]["task_seconds"]
    for _ in range(30):  # goodput falls as o grows: bisection
        mid = (low + high) / 2
        at = _settings(out, overhead=mid, sigma=sigma, mtbf_tasks=None)
        if simulated_goodput(at, mode="sync", topology=topology, rounds=rounds) > target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def mtbf_for_sync(out: dict, *, target: float, seeds: int = 20) -> float:
    """The MTBF (task times) at which the simulator predicts sync goodput `target` for this run's settings,
    from its failure-free runs (the fitted overhead and the measured speed sigma): bisection on log MTBF."""
    topology = _topology(out)
    sigma = speed_sigma(out)
    overhead = fit_overhead(out, sigma=sigma, topology=topology)

    def sync_goodput(mtbf: float) -> float:
        at = _settings(out, overhead=overhead, sigma=sigma, mtbf_tasks=mtbf)
        return simulated_goodput(at, mode="sync", topology=topology, rounds=out["budget"]["rounds"], seeds=seeds)

    return mtbf_where(sync_goodput, target, low=0.2, high=64.0, steps=12)


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


def speed_sigma(out: dict) -> float:
    """Standard deviation of log task seconds over the failure-free runs' applied results."""
    logs = [math.log(s) for name in ("sync", "async") for s in out["runs"].get(name, {}).get("task_seconds_each", [])
            if s > 0]
    return statistics.pstdev(logs) if len(logs) > 1 else 0.0


def predict_rows(out: dict) -> dict:
    """{"settings": one line, "overhead_seconds", "speed_sigma", "runs": [{"run", "goodput", "fitted"}]}."""
    b = out["budget"]
    topology = _topology(out)
    if b["islands"] != topology.n_paths:
        return {"settings": f"not predicted: the simulator pins one learner per path ({topology.n_paths}), the "
                            f"benchmark ran {b['islands']} islands", "runs": []}
    sigma = speed_sigma(out)
    overhead = fit_overhead(out, sigma=sigma, topology=topology)
    runs = []
    for g in out["goodput"]:
        if "slower" in g["fault"]:
            continue
        at = _settings(out, overhead=overhead, sigma=sigma, mtbf_tasks=g.get("mtbf_tasks"))
        runs.append({"run": g["run"], "goodput": simulated_goodput(at, mode=g["mode"], topology=topology,
                                                                   rounds=b["rounds"]),
                     "fitted": g["run"] == "sync"})
    task = b["task_seconds"]
    return {"settings": (f"{b['islands']} learners of one chip pinned to the demo grid's paths, task {task:.1f}s "
                         f"({b['inner_steps_per_task']} steps), restart {b['restart_tasks'] * task:.1f}s, checkpoint "
                         f"every {b['checkpoint_steps']} steps, per-task overhead {overhead:.2f}s (fitted to the "
                         f"failure-free sync goodput), speed sigma {sigma:.3f} (from the failure-free runs' task "
                         f"times), mean of {SEEDS} failure draws (bench/islands_prediction.py)"),
            "overhead_seconds": overhead, "speed_sigma": sigma, "runs": runs}
