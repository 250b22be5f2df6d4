"""The simulator's goodput of the elastic islands benchmark's failure rows against the run's length: over the whole
run and before the run's end (until the first island runs out of work, bench/islands_run_end.py), with the
simulator of bench/islands_elastic.py (its per-task overhead as fitted there), for run.rounds = 20 (the
benchmark's) to 160. A path's steps are sequential and each path has as many as the others, so the run's end waits
for the path that failures set back most; this says how much of the whole run's loss that end is, and how it
shrinks as the run gets longer.

    python experiments/elastic_run_length.py      # experiments/results/elastic-run-length.{json,md} (~3 min)
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.islands_elastic import batch_rows, elastic_settings, failure_free  # noqa: E402
from bench.islands_prediction import _topology, rows_of  # noqa: E402
from bench.islands_run_end import before_the_end, goodput_before_end  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, RESULTS, markdown_table, write_results  # noqa: E402
from dipaco.simulate.diloco import RoundsSimulation  # noqa: E402
from dipaco.simulate.failures import FailureModel  # noqa: E402

FILES, ROUNDS, DRAWS = ("islands-elastic", "islands-elastic-w4"), (20, 40, 80, 160), 20


def simulate(out: dict, settings, *, rounds: int, seed: int) -> tuple[float, float]:
    """(whole-run goodput, goodput before the run's end) of one failure draw at `rounds` of a row's `settings`."""
    at = dataclasses.replace(settings, sim=dataclasses.replace(settings.sim, seed=seed))  # horizon: 25 x the file's
    failures = FailureModel(chip_mtbi_hours=at.sim.chip_mtbi_hours, speed_sigma=at.sim.speed_sigma, seed=seed)
    run = RoundsSimulation(at, failures, mode="async", topology=_topology(out), rounds=rounds, keeps_rows=True,
                           batch_rows=batch_rows(out), keeps_batch=True)
    ledger = run.run()
    end = run.rounds[-1].time
    whole = ledger.useful_work / (at.total_chips * end)
    island = {id(task): name for _, task, name in run.handed}
    results = [{"island": island[id(e[2])], "finished": e[1], "tokens": e[3]} for e in run.trace if e[0] == "result"]
    last = max(r["finished"] for r in results)
    before = before_the_end(results, run_seconds=last)
    rate_before, rate_whole = before["tokens"] / before["seconds"], sum(r["tokens"] for r in results) / last
    return whole, whole * rate_before / rate_whole


def main() -> None:
    lines, record = [], []
    for name in FILES:
        out = json.loads((RESULTS / f"{name}.json").read_text())
        capacity = out["setting"]["capacity_tokens_per_second"]
        failing = [r for r in rows_of(out).values() if r["mode"] == "async" and r.get("mtbf_tasks") is not None]
        row = next(r for r in failing if r.get("seed", 0) == 0)
        measured = statistics.mean(r["goodput"] for r in failing)
        measured_before = statistics.mean(goodput_before_end(r, capacity=capacity) for r in failing)
        reference = failure_free(rows_of(out), row)
        settings = elastic_settings(out, row, overhead=out["prediction"]["overhead_seconds"],
                                    workers=reference["workers"], reference=reference["name"])
        for rounds in ROUNDS:
            draws = [simulate(out, settings, rounds=rounds, seed=seed) for seed in range(DRAWS)]
            whole, before = statistics.mean(d[0] for d in draws), statistics.mean(d[1] for d in draws)
            record.append({"file": name, "workers": row["workers"], "rounds": rounds, "whole": whole,
                           "before_the_end": before})
            lines.append([name, row["workers"], rounds, f"**{whole:.1%}**", f"{before:.1%}",
                          f"{measured:.1%} / {measured_before:.1%}" if rounds == out["setting"]["rounds"] else ""])
            print(lines[-1], flush=True)
    table = markdown_table(["results file", "workers per island", "run.rounds", "simulated goodput, whole run",
                            "simulated, before the run's end", "measured (mean of the seeds): whole / before the end"],
                           lines)
    text = ("# Elastic islands: goodput against the run's length, the simulator's\n\n"
            + __doc__.split("\n\n")[0].replace("\n", " ") + f" Mean of {DRAWS} failure draws of each file's seed-0 "
            "failure row (MTBF 2.5 T per worker, R = 0.15 T).\n\n" + table + "\n")
    write_results("elastic-run-length", {"rows": record, "draws": DRAWS}, text, results_dir=EXPERIMENT_RESULTS)
    print(text)


if __name__ == "__main__":
    main()
