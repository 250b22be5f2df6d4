"""bench/bench_islands.py's elastic rows (`--workers W`): async rounds on islands of W worker processes each
(`hardware.workers_per_island`, torchft), every worker failing on its own schedule, against non-elastic data
parallel over the same workers; goodput by work, the row's ceiling and the simulator's prediction beside it.

    python bench/bench_islands.py --workers 2 --mtbf 2.5                   # bench/results/islands-elastic.*
    python bench/bench_islands.py --workers 2 --mtbf 2.5 --seeds 0,1 --keep  # a second seed's island rows
    python bench/bench_islands.py --workers 2 --mtbf 2.5 --rounds 3 --name islands-elastic-smoke

Rows, per seed (`run.seed` of the islands' training; the warm start, routing and shards are every row's):
`async-elastic` (failure-free) and `async-elastic-mtbfM` (each worker fails with MTBF M task times, `faults.mode
die`: it leaves its island's quorum, forgets what it held, is back after R and heals from a live peer; its
island goes on); once, `dp-wW-mtbfM`: bench/data_parallel.py over islands x W workers at the same per-worker
MTBF, each computing its 1/W share of an island's batch (the same tokens per step and compute per worker as the
islands). A paced step of an island's worker takes the pace times its rows over its share at the full island
(alone, a worker of two takes twice as long), so an island's capacity is the same whatever its size.

Ceiling of a failure row: MTBF / (MTBF + R) x the failure-free row's goodput (the workers' up-time alone).
The simulator (`dipaco.simulate`): learners of W chips that answer a chip's failure elastically (the failed
chip's rows of the step in progress trained again, a pause while the lighthouse has not yet counted the dead worker
gone, a shrunk learner's step trained in whole rows on its chips up and so taking longer (the island keeps its
batch, so a path with failures falls behind and the run's end waits for it), the returning worker away until its
island's try in flight ends), the overhead fitted to the failure-free row.

    python bench/bench_islands.py --workers 2 --mtbf 2.5 --predict  # the simulator's column again, from the JSON
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from bench.bench_islands import ASYNC, Row, Setting, data_parallel_row, git_commit, island_row, log, prepare
from bench.islands_applied import applied_tasks
from bench.islands_prediction import (
    SEEDS,
    _settings,
    _topology,
    data_parallel_prediction,
    fit_overhead,
    rows_of,
    simulated_goodput,
)
from bench.islands_run_end import before_the_end, goodput_before_end
from bench.recording import RESULTS, command_line, markdown_table, with_source, write_results
from dipaco.config import load_config
from dipaco.store.module_store import ModuleStore

# the elastic learners' model: a prediction made with another is made again
MODEL = "whole rows, the try in flight, the batch kept, chips failing once back"
ELASTIC_AT_LEAST, DP_AT_MOST = 0.85, 0.30  # the bar: elastic >= 85% where data parallel keeps <= 30%
PERPLEXITY_WITHIN, SIMULATOR_WITHIN = 0.02, 0.05


def elastic_rows(setting: Setting, *, workers: int, mtbf: float, seeds: list[int]) -> list[Row]:
    """The failure-free and failing elastic rows of each seed, then data parallel over the same workers."""
    fault = f"MTBF {mtbf:g}T per worker, restart {setting.restart_tasks:g}T"
    elastic = [f"hardware.workers_per_island={workers}", *ASYNC]
    rows = []
    for seed in seeds:
        tag = "" if seed == 0 else f"-s{seed}"
        on = [*elastic, f"run.seed={seed}"]
        rows += [Row(f"async-elastic{tag}", "async", "none", overrides=on, workers=workers, seed=seed),
                 Row(f"async-elastic-mtbf{mtbf:g}{tag}", "async", fault, mtbf_tasks=mtbf,
                     overrides=[*on, *setting.failures(mtbf)], workers=workers, seed=seed)]
    return rows + [Row(f"dp-w{workers}-mtbf{mtbf:g}", "dp", fault, mtbf_tasks=mtbf, workers=workers)]


def failure_free(rows: dict[str, dict], row: dict) -> dict | None:
    """The failure-free elastic row of `row`'s seed."""
    return next((r for r in rows.values() if r["mode"] == "async" and r.get("mtbf_tasks") is None
                 and r.get("seed", 0) == row.get("seed", 0)), None)


def ceiling(setting: dict, rows: dict[str, dict], row: dict) -> float | None:
    """MTBF / (MTBF + R) x the failure-free row's goodput: what the workers' up-time alone leaves."""
    reference = failure_free(rows, row)
    if reference is None or row.get("mtbf_tasks") is None or row["mode"] == "dp":
        return None
    m = row["mtbf_tasks"]
    return m / (m + setting["restart_tasks"]) * reference["goodput"]


def evaluate_checks(out: dict) -> list[dict]:
    """The issue's checks on the rows measured so far: [{"check", "verdict", "detail"}]."""
    rows, s = rows_of(out), out["setting"]
    failing = [r for r in rows.values() if r["mode"] == "async" and r.get("mtbf_tasks") is not None]
    dp = [r for r in rows.values() if r["mode"] == "dp"]
    checks = []

    def add(name: str, verdict: bool | None, detail: str) -> None:
        checks.append({"check": name, "verdict": "not measured" if verdict is None else "met" if verdict else "missed",
                       "detail": detail})

    harsh = [(d, [r for r in failing if r["mtbf_tasks"] == d["mtbf_tasks"]]) for d in dp if d["goodput"] <= DP_AT_MOST]
    harsh = [(d, rs) for d, rs in harsh if rs]
    mean = {id(d): statistics.mean(r["goodput"] for r in rs) for d, rs in harsh}
    add(f"async with elastic islands >= {ELASTIC_AT_LEAST:.0%} where data parallel keeps <= {DP_AT_MOST:.0%}",
        all(mean[id(d)] >= ELASTIC_AT_LEAST for d, _ in harsh) if harsh else None,
        "; ".join(f"MTBF {d['mtbf_tasks']:g}T per worker: data parallel {d['goodput']:.1%}, elastic async "
                  f"{mean[id(d)]:.1%} (mean of {len(rs)} seed(s); ceiling "
                  f"{statistics.mean(ceiling(s, rows, r) or 0 for r in rs):.1%}{mean_before_end(s, rs)})"
                  for d, rs in harsh)
        or "no data-parallel row at <= 30% with its elastic rows")
    costs = [(r, r["perplexity"] / failure_free(rows, r)["perplexity"] - 1) for r in failing
             if failure_free(rows, r) and r.get("perplexity") and failure_free(rows, r).get("perplexity")]
    add(f"perplexity of each failure row within {PERPLEXITY_WITHIN:.0%} of its failure-free row (mean of seeds)",
        statistics.mean(c for _, c in costs) <= PERPLEXITY_WITHIN if costs else None,
        "; ".join(f"{r['name']}: {r['perplexity']:.2f} ({100 * c:+.2f}%)" for r, c in costs)
        + (f"; mean {100 * statistics.mean(c for _, c in costs):+.2f}%" if costs else "rows missing"))
    predicted = {p["run"]: p for p in out.get("prediction", {}).get("runs", [])}
    gaps = {n: rows[n]["goodput"] - p["goodput"] for n, p in predicted.items() if n in rows and not p.get("fitted")}
    worst = max(gaps, key=lambda n: abs(gaps[n])) if gaps else None
    add(f"simulator within {SIMULATOR_WITHIN * 100:.0f} points of every row",
        all(abs(g) <= SIMULATOR_WITHIN for g in gaps.values()) if gaps else None,
        f"largest gap {worst}: measured {rows[worst]['goodput']:.1%}, simulated {predicted[worst]['goodput']:.1%} "
        f"({100 * gaps[worst]:+.1f} points)" if worst else "no prediction")
    return checks


def mean_before_end(setting: dict, rows: list[dict]) -> str:
    """"; before the run's end X%" over `rows` where every one has it, else ""."""
    values = [goodput_before_end(r, capacity=setting.get("capacity_tokens_per_second", 0.0)) for r in rows]
    return "" if not values or None in values else f"; before the run's end {statistics.mean(values):.1%}"


def join_pause(out: dict, row: dict) -> float:
    """The simulator's pause of a shrinking island at a worker's leave and at its return, half each of the pause
    a death costs: its survivors ask for the next quorum when the step in flight ends, a uniform time u in (0, p)
    after the death, and wait until the lighthouse counts the dead worker gone, L = `resilience.worker_lost_seconds`
    after its last heartbeat: E[max(0, L - u)] = L^2 / 2p (L <= p), else L - p / 2."""
    config = load_config(out["setting"]["config"], [*out["setting"]["common"], *row.get("overrides", [])])
    lost, pace = config.resilience.worker_lost_seconds, out["setting"]["step_seconds"]
    return (lost * lost / (2 * pace) if lost <= pace else lost - pace / 2) / 2


def try_paces(rows: int, workers: int, members: int) -> list[float]:
    """The tries of one inner step of `rows` rows on an island of `workers` with `members` in its quorum, in paces:
    each member takes at most its share at the full island, ceil(rows / workers), a pace's work; the last try the
    rows left, split in whole rows (`elastic.rows_left`)."""
    share, left, tries = -(-rows // workers), rows, []
    while left > 0:
        taken = min(left, members * share)
        tries.append(-(-taken // members) / share)
        left -= taken
    return tries


def rejoin_wait(out: dict, workers: int) -> float:
    """How much longer than R a worker is away: it joins at the next try of its island of W - 1, at a random time
    in the try in flight, whose rest lasts E[L^2] / 2 E[L] over the tries of a step (`try_paces`)."""
    tries = try_paces(batch_rows(out), workers, workers - 1)
    return out["setting"]["step_seconds"] * sum(t * t for t in tries) / (2 * sum(tries))


def batch_rows(out: dict) -> int:
    """The rows of an island's inner step (`inner.batch_size`)."""
    return load_config(out["setting"]["config"], out["setting"]["common"]).inner.batch_size


def elastic_settings(out: dict, row: dict, *, overhead: float, workers: int, reference: str) -> object:
    """The simulator's settings of an elastic row: learners of `workers` chips, the join pause and the rejoin wait,
    the per-task `overhead`, the step time of the failure-free row `reference`."""
    at = _settings(out, overhead=overhead, sigma=0.0, mtbf_tasks=row.get("mtbf_tasks"), names=(reference,))
    return dataclasses.replace(at, sim=dataclasses.replace(at.sim, chips_per_learner=workers, learner_failure="elastic",
                                                           reconfigure_seconds=join_pause(out, row),
                                                           restart_seconds=at.sim.restart_seconds
                                                           + rejoin_wait(out, workers)))


def predict_rows(out: dict) -> dict:
    """The simulator's goodput for every row, the overhead fitted to the seed-0 failure-free elastic row."""
    rows, s = rows_of(out), out["setting"]
    reference = next((n for n, r in rows.items() if r["mode"] == "async" and r.get("mtbf_tasks") is None), None)
    if reference is None:
        return {"settings": "not predicted: no failure-free elastic row to fit the overhead to", "runs": []}
    workers, names, topology = rows[reference]["workers"], (reference,), _topology(out)

    def elastic(overhead: float, row: dict) -> object:
        return elastic_settings(out, row, overhead=overhead, workers=workers, reference=reference)

    before = out.get("prediction") or {}
    same_fit = before.get("fitted_to") == [reference, rows[reference]["goodput"]] and before.get("model") == MODEL
    overhead = before["overhead_seconds"] if same_fit else fit_overhead(
        out, sigma=0.0, topology=topology, row=reference, settings_of=lambda o: elastic(o, rows[reference]))
    known = {p["run"]: p for p in before.get("runs", [])} if same_fit else {}
    runs = []
    for name, row in rows.items():
        inputs = [row.get("mtbf_tasks"), row.get("overrides"), row.get("run_seconds") if row["mode"] == "dp" else None]
        if name in known and known[name].get("inputs") == inputs:  # `known` only from a prediction of this MODEL
            runs.append(known[name])
            continue
        if row["mode"] == "dp":
            goodput = data_parallel_prediction(out, row, learners=s["islands"] * row["workers"], names=names)
        else:
            goodput = simulated_goodput(elastic(overhead, row), mode="async", topology=topology,
                                        rounds=s["rounds"], keeps_rows=True, batch_rows=batch_rows(out),
                                        keeps_batch=True)
        runs.append({"run": name, "goodput": goodput, "fitted": name == reference, "inputs": inputs})
    return {"settings": (f"{s['islands']} learners of {workers} chips, elastic (each chip failing on its own, again "
                         f"only once back; the failed chip's rows of the step in progress trained again, "
                         f"the wait for the lighthouse to count it gone, L^2 / 2p, half when a worker leaves and half "
                         f"when it returns; a shrunk learner trains a step's {batch_rows(out)} rows in whole rows on its "
                         f"chips up, its steps taking longer; a returning chip away R + the rest of its island's try in "
                         f"flight, "
                         f"{rejoin_wait(out, workers):.2f}s on average), per-task overhead "
                         f"{overhead:.2f}s fitted to {reference}, simulator at {MODEL}; data "
                         f"parallel: {s['islands'] * workers} one-chip learners as one non-elastic job; mean of {SEEDS} "
                         "failure draws (bench/islands_elastic.py)"), "overhead_seconds": overhead, "runs": runs,
            "fitted_to": [reference, rows[reference]["goodput"]], "model": MODEL}


def table(out: dict) -> str:
    rows, s = rows_of(out), out["setting"]
    predicted = {p["run"]: p for p in out.get("prediction", {}).get("runs", [])}
    lines = []
    for name, r in rows.items():
        p, top, ref = predicted.get(name), ceiling(s, rows, r), failure_free(rows, r)
        perplexity = "—" if r.get("perplexity") is None else f"{r['perplexity']:.2f}" + (
            f" ({100 * (r['perplexity'] / ref['perplexity'] - 1):+.2f}%)" if ref and ref is not r else "")
        cores = r.get("cores", {})
        heals = "" if r.get("worker_heals") is None else f" ({r['worker_heals']} heals" + (
            f", {r['resumed_tasks']} tasks resumed)" if r.get("resumed_tasks") is not None else ")")
        lines.append([name, r["mode"], r.get("dp_workers") or f"{s['islands']} x {r['workers']}", r["fault"],
                      f"{r.get('injected_failures', 0)}{heals}", f"**{r['goodput']:.1%}**", before_end(s, r),
                      "—" if top is None else f"{top:.1%}",
                      "—" if p is None else f"{p['goodput']:.1%}" + (" (fitted)" if p.get("fitted") else ""),
                      perplexity, f"{r['tokens_per_second']:,.0f}", f"{r['run_seconds']:.0f}s",
                      f"{cores.get('ours_busy_mean', 0):.0%} / {cores.get('ours_busy_max', 0):.0%}; "
                      f"machine {cores.get('machine_busy_mean', 0):.0%}"])
    return markdown_table(["row", "mode", "workers", "fault", "failures (workers' heals, tasks resumed from a checkpoint)",
                           "goodput (by work)", "before the run's end (its share of the run)", "ceiling",
                           "simulator", "perplexity (vs failure-free, same seed)", "applied tokens/s", "run",
                           "cores: ours mean / max; machine mean"], lines)


def before_end(setting: dict, row: dict) -> str:
    """The table's cell: goodput before the run's end and the share of the run it covers."""
    value = goodput_before_end(row, capacity=setting["capacity_tokens_per_second"])
    return "—" if value is None else f"{value:.1%} ({row['before_the_end']['cut_share']:.0%})"


def fill_before_the_end(out: dict, setting: Setting) -> list[str]:
    """Rows measured before `before_the_end` was recorded get it from their run's store where it is still on this
    machine (`runs/bench-islands/NAME/ROW/store`); returns the rows filled."""
    filled = []
    for row in out["rows"]:
        store = setting.work / row["name"] / "store"
        if row["mode"] != "dp" and row.get("before_the_end") is None and store.exists():
            row["before_the_end"] = before_the_end(applied_tasks(ModuleStore(str(store))), run_seconds=row["run_seconds"])
            row["before_the_end_from"] = f"the run's store, read at commit {git_commit()}"
            filled.append(row["name"])
    return filled


TIME_HEADERS = {"steps": "inner steps", "sync": "all-reduce (committed)", "idle": "no rows in a try",
                "failed": "tries that failed",
                "quorum": "waiting for a quorum", "heal": "healing", "between": "between tasks", "seal": "sealing",
                "down": "down (away, rejoin)"}


def time_table(out: dict) -> str | None:
    """Where the workers' wall time went, per elastic row: each kind's share of the workers' seconds summed."""
    rows = [r for r in rows_of(out).values() if r.get("worker_time")]
    if not rows:
        return None
    lines = []
    for r in rows:
        spent = r["worker_time"]
        total = sum(spent.values())
        lines.append([r["name"], f"{total:,.0f}", *(f"{spent.get(kind, 0.0) / total:.1%}" for kind in TIME_HEADERS)])
    return markdown_table(["row", "worker-seconds", *TIME_HEADERS.values()], lines)


def markdown(out: dict) -> str:
    s, times = out["setting"], time_table(out)
    return "\n".join([
        "# Elastic islands against non-elastic data parallel over the same workers, paced real processes", "",
        f"{s['islands']} islands of {s['workers']} workers (hardware.workers_per_island, torchft, one thread each) "
        f"on the 2x2 grid with topology.replicas={s['replicas']}, width 64, sequences of 128 tokens, {s['rounds']} "
        f"rounds of {s['inner_steps']} inner steps of batch 8 (split over an island's workers), async rounds; every "
        f"step paced to {s['step_seconds']:g} s at the full island, a task T = {s['task_seconds']:g} s; failures "
        f"per worker, back after R = {s['restart_tasks']:g} T. Capacity: {s['islands']} x tokens per step / the "
        f"pace = {s['capacity_tokens_per_second']:,.0f} tokens/s for every row. Whole benchmark "
        f"{out.get('total_seconds', 0) / 3600:.2f} h.", "",
        table(out), "",
        "Goodput by work (docs/islands.md#goodput): applied tokens / (the run's seconds x the capacity). Ceiling: "
        "MTBF / (MTBF + R) x the failure-free row's goodput of the same seed. Perplexity: routed (prefix) on the "
        "held-out documents. Cores: this benchmark's processes' share of the 2 cores over the row (mean / busiest "
        "1-s window) and the whole machine's mean. Before the run's end (bench/islands_run_end.py): the work applied "
        "until the first island ran out of work (the tasks in flight then, the share of their time done) over that "
        "time x the capacity, and that time's share of the run; the rest of the run waits for the paths still "
        "training.", "",
        *(["## Where the workers' time went", "",
            times, "",
            "Each worker's wall seconds from its start to the run's end by kind of round, from the last `elastic worker "
            "time` line of its log (dipaco/islands/island/elastic_time.py), summed over the row's workers. Inner "
            "steps: compute and the padding to the pace, up to the all-reduce; all-reduce (committed): beyond the "
            "all-reduce's usual cost, which the pace covers, a wait for a slower member (one healing, or late); no "
            "rows in a try: a member of a shrunk island with no rows left for it in a step's last try waits for the "
            "others' (a column of zeros in a file measured before it was counted apart); "
            "tries that failed: the all-reduce of a try a member died in (its survivors keep the rows they computed) "
            "and a round a death cut short; waiting for a quorum: the lighthouse's, a shrinking island's until the "
            "dead worker is counted gone; healing: a returning worker's quorum, its state fetched from a peer; down: "
            "away after an injected death (R), and the rejoin.", ""] if times else []),
        "## Checks (issue 38)", "",
        markdown_table(["check", "verdict", "measured"], [[c["check"], c["verdict"], c["detail"]]
                                                         for c in out.get("checks", [])]),
        "", "Simulator: " + out.get("prediction", {}).get("settings", "not run") + (
            f" (predicted again from the rows, at commit {out['prediction']['predicted_at']}: "
            f"`{out['prediction']['predicted_by']}`)" if out.get("prediction", {}).get("predicted_at") else ""),
    ]) + "\n"


def rerender(setting: Setting, *, predict: bool) -> str:
    """The results file of `setting` rendered again (its measured rows and their source unchanged), with
    `predict` the simulator's column and the checks made again by this checkout's simulator, and rows without goodput
    before the run's end given it from their runs still on this machine; returns the markdown."""
    if setting.name == "islands":
        setting = dataclasses.replace(setting, name="islands-elastic")
    path = RESULTS / f"{setting.name}.json"
    out = json.loads(path.read_text())
    filled = fill_before_the_end(out, setting)
    if predict:
        out["prediction"] = {**predict_rows(out), "predicted_at": git_commit(), "predicted_by": command_line()}
    if filled or predict:
        out["checks"] = evaluate_checks(out)
        path.write_text(json.dumps(out, indent=1) + "\n")
    text = with_source(out, markdown(out))
    path.with_suffix(".md").write_text(text)
    return text


def record(name: str, out: dict) -> None:
    out["prediction"] = predict_rows(out)
    out["checks"] = evaluate_checks(out)
    write_results(name, out, markdown(out))


def main(setting: Setting, *, workers: int, mtbf: float, seeds: list[int], only: set[str], keep: bool) -> None:
    """Run the rows (the results file's kept with `keep`; `only` these again), writing the results after each."""
    started = time.perf_counter()
    if setting.name == "islands":
        setting = dataclasses.replace(setting, name="islands-elastic")
    path = RESULTS / f"{setting.name}.json"
    previous = json.loads(path.read_text()) if (keep or only) and path.exists() else {}
    rows = {r["name"]: r for r in previous.get("rows", [])}
    base = prepare(setting)
    from bench.bench_islands import path_parameters, tokens_per_step

    out = {"setting": {**dataclasses.asdict(setting), "workers": workers, "prepare": setting.prepare,
                       "common": setting.common, "async": [*ASYNC], "islands": setting.islands,
                       "task_seconds": setting.task_seconds, "path_parameters": path_parameters(setting, base),
                       "tokens_per_step": tokens_per_step(setting), "config": "configs/demo.yaml",
                       "capacity_tokens_per_second": setting.capacity(tokens_per_step=tokens_per_step(setting))},
           "rows": []}
    for row in elastic_rows(setting, workers=workers, mtbf=mtbf, seeds=seeds):
        if (row.name not in only) if only else (keep and row.name in rows):
            continue
        log(f"{row.name}: {row.fault}, {workers} workers per island")
        measure = data_parallel_row if row.mode == "dp" else island_row
        rows[row.name] = {**measure(setting, base, row), "commit": git_commit()}
        out["rows"], out["total_seconds"] = list(rows.values()), previous.get("total_seconds", 0.0) + time.perf_counter() - started
        record(setting.name, out)
    out["rows"], out["total_seconds"] = list(rows.values()), previous.get("total_seconds", 0.0) + time.perf_counter() - started
    record(setting.name, out)
    print(path.with_suffix(".md").read_text())
