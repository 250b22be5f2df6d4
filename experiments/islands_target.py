"""Can the real-process goodput target be reached on the demo grid? The simulator's answer, before any run.

    python experiments/islands_target.py               # writes experiments/results/islands-target.{json,md,png}
    python experiments/islands_target.py --seeds 10    # fewer failure draws per point (faster, noisier)

The target (issue 9): "with the demo grid, at the failure rate where sync goodput is <= 50%, async
goodput >= 88%". This sweeps the failure rate of `bench/bench_islands.py`'s setting on the simulator
(bench/islands_prediction.py's mapping: one-chip learners pinned to the demo grid's paths on the demo's
own topology, the real round policy, restart-style failures, a checkpoint every step, restart R =
0.15 T, the run's length in results per path) for
- N = 4 learners (the 2x2 grid) and N = 8 (`topology.replicas=2`: 8 paths, every module shared by 4);
- H = 25 and 100 inner steps per task;
- two machine profiles: "measured" (the last benchmark's fitted per-task overhead 13.5 s, speed sigma
  0.275, a step of 1.656 s: bench/results/islands.md) and "low" (overhead 1 s, sigma 0.05);
- run lengths of 2 (the benchmark's) and 8 results per path.
For each it bisects the failure rate (MTBF in task times T) at which sync goodput is 50% and reports
async goodput there, next to
- the lead's bound: each island loses a fraction f of its own time to its failures (down time and
  redone steps), async <= g0a (1 - f), and a sync round waits at most for every island's delay,
  sync >= g0s (1 - N f); so sync <= 50% needs f >= (1 - 0.5 / g0s) / N and async <= g0a (1 - (1 - 0.5 /
  g0s) / N) (87.5% g0 for N = 4, 93.75% g0 for N = 8);
- f_own, an island's own loss at that MTBF M in the simulator's failure model (Poisson failures, also
  while restarting; back R after its last failure; half a step redone per failure): the fraction of
  time up is exp(-R / M), so f_own = 1 - exp(-R / M) (1 - T / (2 H M)), and the own-failure bound
  async <= g0a (1 - f_own);
g0s, g0a the failure-free sync / async goodputs of the same setting.
Part B: H = 100, the low profile, with longer restarts (R = 0.15 to 8 T: rarer, longer failures, where
a sync round's wait for one island is largest against the island's own loss): N = 8 for a run of 8
results per path and for a run with no length (100 T of training, goodput over the whole horizon, the
paper's and `dipaco simulate`'s setting), and N = 16 (`topology.replicas=4`) with no length.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.islands_prediction as prediction  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.model.topology import Topology  # noqa: E402

log = logging.getLogger("experiments.islands_target")
CONFIG = ROOT / "configs" / "demo.yaml"
ASYNC = ["rounds.mode=async", "rounds.quorum=0.5", "rounds.max_staleness=2"]  # bench/bench_islands.py's
PARAMETERS = 1_328_256  # a demo path model
STEP_SECONDS = 41.4 / 25  # the last benchmark's step (bench/results/islands.md: T = 41.4 s for 25 steps)
PROFILES = {  # per-task overhead seconds, speed sigma
    "measured": {"overhead": 13.46, "sigma": 0.275},
    "low": {"overhead": 1.0, "sigma": 0.05},
}
RESTART_TASKS = 0.15
LONG_RESTARTS = [0.15, 0.5, 1.0, 2.0, 4.0, 8.0]  # part B: restart R in task times
NO_LENGTH_TASKS = 100.0  # part B: a run with no length trains this many task times
MTBF_TASKS = [None, 16.0, 8.0, 4.0, 2.0, 1.0, 0.7, 0.5, 0.35, 0.25]
TARGET_SYNC = 0.5
HORIZON_RUNS = 80  # simulated task times per result per path (a run that has not ended by then is an error)


@dataclasses.dataclass(frozen=True)
class Case:
    learners: int  # = paths: 4 (replicas 1) or 8 (replicas 2)
    inner_steps: int
    profile: str
    rounds: int | None  # results per path (the run's length); None: NO_LENGTH_TASKS task times, no length
    restart_tasks: float = RESTART_TASKS

    @property
    def task_seconds(self) -> float:
        return self.inner_steps * STEP_SECONDS

    def label(self) -> str:
        length = "no length" if self.rounds is None else f"{self.rounds} rounds"
        return f"N={self.learners}, H={self.inner_steps}, {self.profile}, {length}, R={self.restart_tasks:g}T"


def topology_and_outer(learners: int, *, grace: float):
    replicas = learners // 4
    config = load_config(CONFIG, [f"topology.replicas={replicas}", *ASYNC, f"rounds.grace_seconds={grace:.1f}"])
    return Topology.from_config(config.topology, n_layers=config.model.n_layers), config.outer


def goodput(case: Case, *, mode: str, mtbf_tasks: float | None, seeds: int) -> float:
    task = case.task_seconds
    topology, outer = topology_and_outer(case.learners, grace=task / 5)  # the benchmark's grace: T / 5
    profile = PROFILES[case.profile]
    settings = prediction.island_settings(
        outer=outer, learners=case.learners, task_seconds=task, inner_steps=case.inner_steps,
        restart_seconds=case.restart_tasks * task, checkpoint_steps=1, overhead=profile["overhead"],
        sigma=profile["sigma"], mtbf_tasks=mtbf_tasks, parameters=PARAMETERS,
        horizon_tasks=NO_LENGTH_TASKS if case.rounds is None else HORIZON_RUNS * case.rounds)
    return prediction.simulated_goodput(settings, mode=mode, topology=topology, rounds=case.rounds, seeds=seeds)


def sync_at_half(case: Case, *, seeds: int) -> float | None:
    """The MTBF (task times) at which sync goodput is 50% (bisection on log MTBF), None if it is below
    50% without failures."""
    if goodput(case, mode="sync", mtbf_tasks=None, seeds=seeds) <= TARGET_SYNC:
        return None
    return prediction.mtbf_where(lambda mtbf: goodput(case, mode="sync", mtbf_tasks=mtbf, seeds=seeds), TARGET_SYNC,
                                 low=0.1, high=256.0, steps=14)  # sync at MTBF low is below 50%, at high above


def own_loss(case: Case, mtbf_tasks: float) -> float:
    """f_own: the fraction of an island's time its own failures cost (down, and half a step redone each)."""
    up = math.exp(-case.restart_tasks / mtbf_tasks)
    return 1 - up * (1 - 1 / (2 * case.inner_steps * mtbf_tasks))


def study(case: Case, *, seeds: int, sweep: bool = True) -> dict:
    g0s = goodput(case, mode="sync", mtbf_tasks=None, seeds=seeds)
    g0a = goodput(case, mode="async", mtbf_tasks=None, seeds=seeds)
    points = [{"mtbf_tasks": None, "sync": g0s, "async": g0a}]
    for mtbf in MTBF_TASKS[1:] if sweep else ():
        points.append({"mtbf_tasks": mtbf, "sync": goodput(case, mode="sync", mtbf_tasks=mtbf, seeds=seeds),
                       "async": goodput(case, mode="async", mtbf_tasks=mtbf, seeds=seeds)})
    mtbf = sync_at_half(case, seeds=seeds)
    row = {**dataclasses.asdict(case), "task_seconds": case.task_seconds, **PROFILES[case.profile],
           "g0_sync": g0s, "g0_async": g0a, "sweep": points, "mtbf_tasks_sync_50": mtbf}
    if mtbf is not None:
        n = case.learners
        row["sync_at_point"] = goodput(case, mode="sync", mtbf_tasks=mtbf, seeds=seeds)
        row["async_at_point"] = goodput(case, mode="async", mtbf_tasks=mtbf, seeds=seeds)
        row["f_lead_needs"] = (1 - TARGET_SYNC / g0s) / n
        row["bound_lead"] = g0a * (1 - row["f_lead_needs"])
        row["f_own"] = own_loss(case, mtbf)
        row["bound_own"] = g0a * (1 - row["f_own"])
    log.info("%s: g0 sync %.3f async %.3f; sync 50%% at MTBF %s T, async there %s", case.label(), g0s, g0a,
             "-" if mtbf is None else f"{mtbf:.3f}", "-" if mtbf is None else f"{row['async_at_point']:.3f}")
    return row


def g0_needed(n: int, target: float = 0.88) -> dict:
    """The failure-free goodput (sync = async = g0) each bound needs for async >= target at sync = 50%."""
    # lead's: g0 - (g0 - 0.5) / n >= t  ->  g0 >= (t - 0.5 / n) n / (n - 1); tight: n g0 / (n + 2 g0 - 1) >= t
    lead = (target - 0.5 / n) * n / (n - 1)
    tight = target * (n - 1) / (n - 2 * target)
    return {"learners": n, "lead": lead, "tight": tight,
            "async_max_lead": 1 - 1 / (2 * n), "async_max_tight": n / (n + 1)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["rounds"], r["inner_steps"], r["profile"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels) // 2, figsize=(4 * len(panels) // 2, 7.5), sharey=True, squeeze=False)
    for ax, (rounds, steps, profile) in zip(axes.flat, panels):
        for r in rows:
            if (r["rounds"], r["inner_steps"], r["profile"]) != (rounds, steps, profile):
                continue
            points = [(1 / s["mtbf_tasks"], s) for s in r["sweep"] if s["mtbf_tasks"] is not None]
            color = "tab:blue" if r["learners"] == 4 else "tab:red"
            for mode, style in (("sync", "--"), ("async", "-")):
                ax.plot([0.0, *[x for x, _ in points]], [100 * r["sweep"][0][mode], *[100 * s[mode] for _, s in points]],
                        style, color=color, marker="o", markersize=3, label=f"N={r['learners']} {mode}")
        ax.axhline(88, color="gray", lw=0.8, ls=":")
        ax.axhline(50, color="gray", lw=0.8, ls=":")
        ax.set_title(f"H={steps}, {profile}, {rounds} rounds", fontsize=9)
        ax.set_xlabel("failures per island per task time (T / MTBF)")
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("goodput (%)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Simulated goodput vs failure rate on the demo grid (restart-style islands, R = 0.15 T)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _point_cells(r: dict) -> list[str]:
    point = r["mtbf_tasks_sync_50"]
    if point is None:
        return ["sync < 50% without failures", "", "", "", "", ""]
    return [f"{point:.2f} T", f"{r['async_at_point']:.1%}", f"{r['f_lead_needs']:.3f}", f"{r['f_own']:.3f}",
            f"{r['bound_lead']:.1%}", f"{r['bound_own']:.1%}"]


POINT_HEADERS = ["MTBF where sync = 50%", "async there", "f the lead's bound needs", "f_own there",
                 "lead's bound", "own-failure bound"]


def markdown(results: dict) -> str:
    lines = [
        "# Can async reach 88% where sync is at 50%? The simulator on the demo grid",
        "",
        f"bench/islands_prediction.py's mapping (one-chip learners pinned to the demo grid's paths, the real round "
        f"policy, restart-style failures, a checkpoint every step, async {' '.join(ASYNC)} grace T/5), step "
        f"{STEP_SECONDS:.3f} s, mean of {results['seeds']} failure draws per point. Profiles: "
        + "; ".join(f"{k}: per-task overhead {v['overhead']} s, speed sigma {v['sigma']}" for k, v in PROFILES.items())
        + ". N = 8 is `topology.replicas=2` (8 paths, every grid module shared by 4 of them). Bounds: "
        "experiments/islands_target.py's docstring.",
        "",
        f"## A. Restart R = {RESTART_TASKS} T (bench/bench_islands.py's failure model): async where sync is 50%",
        "",
    ]
    rows = [[r["learners"], r["inner_steps"], r["profile"], r["rounds"], f"{r['task_seconds']:.0f}s",
             f"{r['g0_sync']:.1%}", f"{r['g0_async']:.1%}", *_point_cells(r)] for r in results["cases"]]
    lines += [markdown_table(["N", "H", "profile", "rounds", "T", "g0 sync", "g0 async", *POINT_HEADERS], rows), ""]
    rows = [[r["learners"], r["restart_tasks"], f"none ({results['no_length_tasks']:g} T)" if r["rounds"] is None
             else r["rounds"], f"{r['g0_sync']:.1%}",
             f"{r['g0_async']:.1%}", *_point_cells(r)] for r in results["restarts"]]
    lines += ["## B. Longer restarts: H = 100, low profile; N = 16 is `topology.replicas=4`", "",
              markdown_table(["N", "R", "run length (results per path)", "g0 sync", "g0 async", *POINT_HEADERS], rows), ""]
    rows = [[g["learners"], f"{g['async_max_lead']:.1%}", f"{g['async_max_tight']:.1%}", _needed(g["lead"]),
             _needed(g["tight"])] for g in results["g0_needed"]]
    lines += ["## What the lead's premises allow (sync = async = g0 without failures)", "",
              "Lead's: sync >= g0 (1 - N f). Tight: the same premise with the delays added per round, "
              "sync >= g0 / (1 + N x), async <= g0 / (1 + x).", "",
              markdown_table(["N", "async at sync 50%, g0 = 100% (lead's)", "(tight)", "g0 needed for 88% (lead's)",
                              "(tight)"], rows), ""]
    lines += [f"## A. Goodput sync / async vs MTBF (plot: {results['plot']})", ""]
    rows = [[r["learners"], r["inner_steps"], r["profile"], r["rounds"],
             *[f"{s['sync']:.0%} / {s['async']:.0%}" for s in r["sweep"]]] for r in results["cases"]]
    lines += [markdown_table(["N", "H", "profile", "rounds", *["none" if m is None else f"{m:g} T" for m in MTBF_TASKS]], rows), ""]
    return "\n".join(lines)


def _needed(g0: float) -> str:
    return f"{g0:.1%}" if g0 <= 1 else f"unreachable ({g0:.1%} > 100%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=30, help="failure draws averaged per point")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    started = time.perf_counter()
    cases = [Case(n, h, p, r) for r, n, h, p in itertools.product((2, 8), (4, 8), (25, 100), PROFILES)]
    rows = [study(case, seeds=args.seeds) for case in cases]
    restarts = [study(Case(n, 100, "low", rounds, restart), seeds=args.seeds, sweep=False)
                for n, rounds in ((8, 8), (8, None), (16, None)) for restart in LONG_RESTARTS]
    png = EXPERIMENT_RESULTS / "islands-target.png"
    results = {"seeds": args.seeds, "step_seconds": STEP_SECONDS, "restart_tasks": RESTART_TASKS,
               "async_overrides": ASYNC, "profiles": PROFILES, "cases": rows, "restarts": restarts,
               "no_length_tasks": NO_LENGTH_TASKS,
               "g0_needed": [g0_needed(n) for n in (4, 8, 16)], "plot": png.name,
               "seconds": time.perf_counter() - started}
    write_results("islands-target", results, markdown(results), results_dir=EXPERIMENT_RESULTS)
    plot(rows, png)
    print(markdown(results))


if __name__ == "__main__":
    main()
