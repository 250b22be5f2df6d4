"""The simulator's goodput of elastic async islands of W workers, at the per-worker MTBF where non-elastic data
parallel over all 8 x W workers keeps 30%, in bench/bench_islands.py's setting (8 paths, T = 20 s in 10 steps,
R = 0.15 T), with the per-task overhead fitted to the measured elastic rows (2.14 s, bench/results/islands-elastic.md)
or to the one-process islands (1.31 s, bench/results/islands.md); a join pause of 0.25 s per failure; the learners
keep their batch of 8 rows (a shrunk island's steps take longer, in whole rows) and each worker fails again only
once back, as the benchmark's elastic prediction does.

    python experiments/elastic_projection.py      # experiments/results/elastic-projection.{json,md} (~5 min)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.islands_prediction import island_settings, mtbf_where, simulated_data_parallel, simulated_goodput  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.model.topology import Topology  # noqa: E402

SETTING = ["sharding.seq_len=128", "model.hidden_size=64", "topology.replicas=2", "run.rounds=20", "inner.steps=10",
           "rounds.mode=async"]
TASK, RESTART, ISLANDS, PARAMETERS, SEEDS, BATCH = 20.0, 3.0, 8, 475_712, 10, 8  # BATCH: rows of an island's step
OVERHEADS = {"elastic islands (measured 2.14 s)": 2.14, "one-process islands (measured 1.31 s)": 1.31}


def project(workers: int, overhead: float, rounds, topology) -> dict:
    def data_parallel(mtbf: float) -> float:
        at = island_settings(closing=rounds, learners=ISLANDS * workers, task_seconds=TASK, inner_steps=10,
                             restart_seconds=RESTART, checkpoint_steps=1, overhead=0, sigma=0, mtbf_tasks=mtbf,
                             parameters=PARAMETERS, horizon_tasks=20)
        return simulated_data_parallel(at, seeds=SEEDS)

    mtbf = mtbf_where(data_parallel, 0.30, low=0.5, high=64, steps=8)
    at = island_settings(closing=rounds, learners=ISLANDS, task_seconds=TASK, inner_steps=10, restart_seconds=RESTART,
                         checkpoint_steps=1, overhead=overhead, sigma=0, mtbf_tasks=mtbf, parameters=PARAMETERS,
                         horizon_tasks=500)
    at = dataclasses.replace(at, sim=dataclasses.replace(at.sim, chips_per_learner=workers, learner_failure="elastic",
                                                         reconfigure_seconds=0.125))
    free = dataclasses.replace(at, sim=dataclasses.replace(at.sim, chip_mtbi_hours=1e12))
    islands = dict(keeps_rows=True, batch_rows=BATCH, keeps_batch=True)  # dipaco's elastic islands (docs/simulate.md)
    failure_free = simulated_goodput(free, mode="async", topology=topology, rounds=20, seeds=2, **islands)
    elastic = simulated_goodput(at, mode="async", topology=topology, rounds=20, seeds=SEEDS, **islands)
    return {"workers": workers, "overhead": overhead, "mtbf_tasks": mtbf, "failure_free": failure_free,
            "elastic": elastic, "ceiling": mtbf / (mtbf + RESTART / TASK) * failure_free}


def main() -> None:
    config = load_config(ROOT / "configs" / "demo.yaml", SETTING)
    topology = Topology.from_config(config.topology, n_layers=config.model.n_layers)
    rows = [{"overheads": name, **project(w, o, config.rounds, topology)}
            for name, o in OVERHEADS.items() for w in (2, 4, 8)]
    table = markdown_table(["per-task overhead", "workers per island", "MTBF where data parallel keeps 30% (T)",
                            "failure-free", "elastic async", "ceiling"],
                           [[r["overheads"], r["workers"], f"{r['mtbf_tasks']:.2f}", f"{r['failure_free']:.1%}",
                             f"**{r['elastic']:.1%}**", f"{r['ceiling']:.1%}"] for r in rows])
    text = ("# Elastic islands of more workers: the simulator's projection\n\n" + __doc__.split("\n\n")[0].replace("\n", " ")
            + f" Mean of {SEEDS} failure draws.\n\n" + table + "\n")
    write_results("elastic-projection", {"rows": rows}, text, results_dir=EXPERIMENT_RESULTS)
    print(text)


if __name__ == "__main__":
    main()
