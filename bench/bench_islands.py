"""Benchmark: goodput of non-elastic data parallel, sync rounds and async rounds side by side, as real
processes paced to a fixed step time, with failures and with a straggler; the simulator's prediction beside.

    python bench/bench_islands.py                         # every row: bench/results/islands.{json,md} (~2.5 h)
    python bench/bench_islands.py --rounds 3 --step-seconds 1 --name islands-smoke   # a short check (~15 min)
    python bench/bench_islands.py --keep                  # only the rows the results file lacks (resume)
    python bench/bench_islands.py --only sync-slow,async-slow   # these rows again, the others kept
    python bench/bench_islands.py --mtbf 1,1.5            # failure rates in task times (default: auto)
    python bench/bench_islands.py --predict               # the simulator's column again, from the JSON
    python bench/bench_islands.py --markdown-only         # re-render the markdown from the JSON
    python bench/bench_islands.py --recompute-goodput     # goodput by work from what the JSON records
    python bench/bench_islands.py --bandwidth 1e5 1e6     # goodput against each island's store bandwidth (islands_bandwidth.py)
    python bench/bench_islands.py --workers 2 --mtbf 2.5  # elastic islands against data parallel (islands_elastic.py)

Every row is real processes on this machine. The island rows are `dipaco train` (a coordinator and 8
pull-based island processes of one thread over a local store) of the demo's recipe (dense warm start
of half the run, routing on its features, wsd, DiLoCo's outer step, path-private embeddings: the
defaults) on the 2x2 grid with `topology.replicas=2` (8 paths), at the reduced model size of
experiments/recipe_search.py (width 64, sequences of 128 tokens), `run.rounds` results per path of
`inner.steps` 10 steps of batch 8, then the routed held-out perplexity (`dipaco eval`, prefix routing).

**Paced** (`faults.step_seconds`, dipaco/islands/island/pacing.py): every inner step is padded by
sleeping to the pace p (2 s by default), so 8 one-thread islands on 2 cores never compete for them and
wall-clock means what it would on 8 machines; a task takes T = 10 p. Each island logs its compute and
padding per task (the `paced ...` line of runs/bench-islands/NAME/ROW/logs/island-*.log), and each
row records them summed over its tasks (`pace`: compute under p on every step shows the pace held), and
how busy the cores were (bench/cpu_load.py: the whole machine's and this benchmark's processes' share
of the 2 cores, mean and max over 1-s windows).

**Rows**, one invocation, one after the other: failure-free sync and async; at each failure rate,
non-elastic data parallel (bench/data_parallel.py: 8 paced workers, one synchronous step at a time,
any worker's failure stops everyone until it is back, all restart from the last checkpoint), sync and
async; and island-0 3x slower (`faults.slowdown`), sync and async. Failures are the islands' own
(`faults.mode=die`: an island loses what it had in memory, is back after R = 0.15 T and resumes its
task from its inner checkpoint, written every step; per island exponential with mean MTBF, in task
times T; a failure can land in a step's padding, which it then cuts). The default failure rates are
picked by the simulator fitted to the failure-free rows: where data parallel's goodput is 30% and
where sync's is 60% (`--mtbf` to give them).

**Goodput** is by work (docs/islands.md#goodput, the simulator's definition): the applied tokens (islands:
of the results committed rounds applied; data parallel: of its surviving steps, all workers) / (the
run's seconds x the islands' failure-free capacity, islands x tokens per step / the pace p), where the
run's seconds are from the first heartbeat to the last commit (data parallel: its wall-clock; it runs for
as long as the failure-free job takes, rounds x T, as a job without an end). A straggler's slow steps
count their nominal work, not their seconds. It equals train.json's (`dipaco.store.goodput`, which knows
the pace). **Goodput by time** beside it, as measured before: islands: the inner-loop seconds of the
applied results (compute and padding) / (islands x the run's seconds); data parallel: the seconds of its
surviving steps / its wall-clock. **Applied tokens per second**: the applied tokens / the same seconds.
**The simulator's prediction** (bench/islands_prediction.py) beside each row; the per-task overhead is
fitted to the failure-free sync row (marked fitted).

Runs live in runs/bench-islands/NAME/<row>; the results file is written after every row, so a run cut
short keeps what it measured (`--keep` resumes). `bench/islands_report.py` renders the table and the checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_load import CoreSampler  # noqa: E402
from bench.data_parallel import run_data_parallel  # noqa: E402
from bench.islands_applied import (  # noqa: E402
    applied_rate,
    applied_tasks,
    manifests,
    pace_from_logs,
    resumed_tasks,
    tasks_by_island,
    worker_failures,
    worker_heals,
    worker_time,
)
from bench.islands_goodput import recompute  # noqa: E402
from bench.islands_report import evaluate_checks, markdown  # noqa: E402
from bench.islands_run_end import before_the_end  # noqa: E402
from bench.recording import RESULTS, git_commit, with_source, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.store.board import read_heartbeats  # noqa: E402
from dipaco.store.module_store import ModuleStore  # noqa: E402

CONFIG = ROOT / "configs" / "demo.yaml"
WORK = ROOT / "runs" / "bench-islands"
REDUCED = ["sharding.seq_len=128", "model.hidden_size=64"]  # experiments/recipe_search.py's reduced model
ASYNC = ["rounds.mode=async"]  # the product's defaults: quorum, adaptive grace window, cutting, staleness


@dataclass(frozen=True)
class Setting:
    """What one invocation measures (the command line's options)."""

    replicas: int = 2  # topology.replicas: 4 x replicas paths, one island each
    rounds: int = 20  # run.rounds: results applied per path
    inner_steps: int = 10  # inner.steps H (the demo's)
    step_seconds: float = 2.0  # the pace p: every inner step padded to it (faults.step_seconds)
    checkpoint_steps: int = 1  # resilience.checkpoint_steps, and data parallel's checkpoint interval
    restart_tasks: float = 0.15  # restart time R in task times T
    mtbf_tasks: tuple[float, ...] | None = None  # failure rates (MTBF per island in T); None: picked by the simulator
    dp_target: float = 0.30  # auto rates: where the simulator predicts this data-parallel goodput ...
    sync_target: float = 0.60  # ... and this sync goodput
    slowdown: float = 3.0  # the straggler rows' island-0
    straggler: bool = True
    name: str = "islands"  # bench/results/NAME.{json,md}, runs/bench-islands/NAME

    @property
    def islands(self) -> int:
        return 4 * self.replicas

    @property
    def task_seconds(self) -> float:
        """T: a task's paced inner loop."""
        return self.inner_steps * self.step_seconds

    def capacity(self, *, tokens_per_step: int) -> float:
        """The islands' failure-free tokens per second: each trains `tokens_per_step` tokens a pace p."""
        return self.islands * tokens_per_step / self.step_seconds

    @property
    def prepare(self) -> list[str]:
        """What the routed, sharded and warm-started base depends on (the warm start's length is a share
        of the run's steps, so rounds and H too)."""
        return [*REDUCED, f"topology.replicas={self.replicas}", f"run.rounds={self.rounds}",
                f"inner.steps={self.inner_steps}", "hardware.precision=fp32"]

    @property
    def common(self) -> list[str]:
        return [*self.prepare, f"hardware.islands={self.islands}", "hardware.threads_per_island=1",
                "eval.baselines=false", "eval.modes=[prefix]", "store.keep_versions=0",
                f"resilience.checkpoint_steps={self.checkpoint_steps}", f"faults.step_seconds={self.step_seconds:g}",
                "resilience.heartbeat_seconds=0.5", f"resilience.heartbeat_timeout={self.task_seconds / 2:g}"]

    def failures(self, mtbf_tasks: float) -> list[str]:
        t = self.task_seconds
        return [f"faults.mtbf={mtbf_tasks * t:g}", f"faults.return_after={self.restart_tasks * t:g}", "faults.mode=die"]

    @property
    def base_dir(self) -> Path:
        digest = hashlib.sha256(" ".join(self.prepare).encode()).hexdigest()[:8]
        return WORK / f"base-{digest}"

    @property
    def work(self) -> Path:
        return WORK / self.name


@dataclass(frozen=True)
class Row:
    """One run to make: its name, mode (dp, sync, async), fault and overrides."""

    name: str
    mode: str
    fault: str
    mtbf_tasks: float | None = None
    slowdown: float = 1.0
    overrides: list[str] = field(default_factory=list)
    workers: int = 1  # workers per island (hardware.workers_per_island; > 1: elastic islands); data parallel: per island
    seed: int = 0  # run.seed of the islands' training (the warm start, routing and shards are every row's)


def failure_free_rows(setting: Setting) -> list[Row]:
    return [Row("sync", "sync", "none"), Row("async", "async", "none", overrides=[*ASYNC])]


def failure_rows(setting: Setting, mtbf: float) -> list[Row]:
    fault = f"MTBF {mtbf:g}T, restart {setting.restart_tasks:g}T"
    failures = setting.failures(mtbf)
    return [Row(f"dp-mtbf{mtbf:g}", "dp", fault, mtbf_tasks=mtbf),
            Row(f"sync-mtbf{mtbf:g}", "sync", fault, mtbf_tasks=mtbf, overrides=failures),
            Row(f"async-mtbf{mtbf:g}", "async", fault, mtbf_tasks=mtbf, overrides=[*ASYNC, *failures])]


def straggler_rows(setting: Setting) -> list[Row]:
    slow = [f"faults.slowdown={setting.slowdown:g}"]
    fault = f"island-0 {setting.slowdown:g}x slower"
    return [Row("sync-slow", "sync", fault, slowdown=setting.slowdown, overrides=slow),
            Row("async-slow", "async", fault, slowdown=setting.slowdown, overrides=[*ASYNC, *slow])]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # this tree's code


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dipaco(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"dipaco {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def prepare(setting: Setting) -> RunDir:
    """The warm start, routing and shards every row copies (made once per `Setting.prepare`)."""
    base = RunDir(setting.base_dir)
    if not (base.shards / "index.json").exists():
        log(f"warm start, routing and sharding the bundled corpus into {base.root}")
        options = ["--config", str(CONFIG), "--run", str(base.root), *setting.prepare]
        if load_config(CONFIG, setting.prepare).pretrain_steps:
            dipaco("pretrain", *options)
        dipaco("route", *options)
        dipaco("shard", *options)
    return base


def tokens_per_step(setting: Setting) -> int:
    """Tokens an island (or a data-parallel worker) trains per inner step: inner.batch_size x seq_len."""
    config = load_config(CONFIG, setting.common)
    return config.inner.batch_size * config.sharding.seq_len


def path_parameters(setting: Setting, base: RunDir) -> int:
    from dipaco.model.path_model import count_parameters
    from dipaco.pipeline.context import PathFactory

    return count_parameters(PathFactory(load_config(CONFIG, setting.common), base).new_model())


def data_parallel_batch(setting: Setting, workers_per_island: int) -> list[str]:
    """Data parallel over an elastic island's workers: each worker computes its share of the island's batch, as
    the island's workers do (the same tokens per step in all, the same compute per worker)."""
    if workers_per_island == 1:
        return []
    batch = load_config(CONFIG, setting.common).inner.batch_size
    if batch % workers_per_island:
        raise SystemExit(f"inner.batch_size {batch} does not split over {workers_per_island} workers per island")
    return [f"inner.batch_size={batch // workers_per_island}"]


# --- one row ------------------------------------------------------------------------------------------------
def train_args(setting: Setting, run: Path, row: Row) -> list[str]:
    """The arguments of an island row's `dipaco train` and `dipaco eval` (after the subcommand)."""
    return ["--config", str(CONFIG), "--run", str(run), *setting.common, *row.overrides]


def island_row(setting: Setting, base: RunDir, row: Row) -> dict:
    """`dipaco train` then `dipaco eval` of one row; its figures (goodput from train.json)."""
    run = RunDir(setting.work / row.name)
    if run.root.exists():
        shutil.rmtree(run.root)
    for part in ("tokenizer", "pretrain", "routing", "shards"):
        if (base.root / part).exists():
            shutil.copytree(base.root / part, run.root / part)
    args = train_args(setting, run.root, row)
    log(f"{row.name}: training ({' '.join(row.overrides) or 'defaults'})")
    started = time.perf_counter()
    with CoreSampler() as cores:
        dipaco("train", *args)
    wall = time.perf_counter() - started
    dipaco("eval", *args)
    summary = json.loads(run.train_summary.read_text())
    evaluation = json.loads(run.eval_results.read_text())
    perplexity = next(m["perplexity"] for m in evaluation["models"] if m["model"].startswith("DiPaCo"))
    store = ModuleStore(str(run.store))
    tasks = applied_tasks(store)
    good = summary["goodput"]
    seconds = good["island_seconds"] / setting.islands  # first heartbeat to last commit
    rate = applied_rate(tasks, seconds=seconds)
    figures = {
        **asdict(row), "perplexity": perplexity, "wall_seconds": wall, "run_seconds": seconds,
        "goodput": rate["applied_tokens"] / (seconds * setting.capacity(tokens_per_step=tokens_per_step(setting))),
        "goodput_by_time": good["goodput_by_time"], "train_goodput": good["goodput"],
        "useful_island_seconds": good["useful_island_seconds"],
        "island_seconds": good["island_seconds"], "applied_tasks": len(tasks),
        "stale_applied": sum(1 for t in tasks if t["staleness"] > 0),
        "dropped_tasks": sum(len(m.dropped) for m in manifests(store)),
        "before_the_end": before_the_end(tasks, run_seconds=seconds),  # until the first island ran out of work
        "worker_heals": worker_heals(run.logs) if row.workers > 1 else None,
        "worker_time": worker_time(run.logs) if row.workers > 1 else None,  # seconds by kind, every worker
        "resumed_tasks": resumed_tasks(run.logs) if row.workers > 1 else None,  # from the island's checkpoint
        "injected_failures": (worker_failures(run.logs) if row.workers > 1
                              else sum(beat.failures for beat in read_heartbeats(store).values())),
        # bytes as the islands measured them at the store (train.json's `traffic`), per applied result, by kind
        "bytes_per_result": {f"{d}_{k}": cell["bytes"] / max(1, len(tasks))
                             for d, kinds in summary["traffic"]["by_role"]["island"].items() for k, cell in kinds.items()},
        "traffic_up_bytes": summary["traffic"]["up_bytes"], "traffic_down_bytes": summary["traffic"]["down_bytes"],
        **rate,
        "task_seconds_each": [t["seconds"] for t in tasks],
        "tasks_by_island": tasks_by_island(tasks),
        "pace": pace_from_logs(sorted(run.logs.glob("island-*.log"))),
        "cores": cores.summary(),
    }
    log(f"{row.name}: goodput {figures['goodput']:.1%}, perplexity {perplexity:.2f}, "
        f"{figures['tokens_per_second']:.0f} applied tokens/s, {wall:.0f}s, {figures['injected_failures']} failures, "
        f"cores busy {cores.summary()['machine_busy_mean']:.0%} (ours {cores.summary()['ours_busy_mean']:.0%})")
    return figures


def data_parallel_row(setting: Setting, base: RunDir, row: Row) -> dict:
    """bench/data_parallel.py's job at this row's failure rate, for the failure-free job's length."""
    t = setting.task_seconds
    out = setting.work / row.name
    if out.exists():
        shutil.rmtree(out)
    workers = setting.islands * row.workers
    log(f"{row.name}: data parallel, {workers} workers, MTBF {row.mtbf_tasks * t:g}s")
    started = time.perf_counter()
    with CoreSampler() as cores:
        result = run_data_parallel(config=str(CONFIG), run=str(base.root),
                                   overrides=[*setting.common, *data_parallel_batch(setting, row.workers)],
                                   workers=workers, steps=setting.rounds * setting.inner_steps,
                                   horizon=setting.rounds * t, step_seconds=setting.step_seconds,
                                   mtbf=row.mtbf_tasks * t, return_after=setting.restart_tasks * t,
                                   checkpoint_steps=setting.checkpoint_steps, out=out, env=ENV)
    wall = time.perf_counter() - started
    ledger = result["ledger"]
    applied = result["tokens_per_second"] * ledger["wall"]
    figures = {
        **asdict(row), "perplexity": None, "wall_seconds": wall, "run_seconds": ledger["wall"],
        "goodput": applied / (ledger["wall"] * setting.capacity(tokens_per_step=tokens_per_step(setting))),
        "goodput_by_time": result["goodput"], "useful_island_seconds": ledger["useful"] * setting.islands,
        "island_seconds": ledger["wall"] * setting.islands, "injected_failures": ledger["failures"], "dp_workers": workers,
        "restarts": ledger["restarts"], "steps": ledger["steps"], "ledger": ledger,
        "applied_tokens": applied, "tokens_per_second": result["tokens_per_second"],
        "pace": {**result["pace"], "tasks": None}, "cores": cores.summary(),
        "train_loss_first_last": [result["loss_first"][:1], result["loss_last"][-1:]],
    }
    log(f"{row.name}: goodput {figures['goodput']:.1%}, {ledger['failures']} failures, {ledger['restarts']} restarts, "
        f"{ledger['steps']} steps kept in {ledger['wall']:.0f}s")
    return figures


# --- the invocation -----------------------------------------------------------------------------------------
def rows_to_run(setting: Setting, rates: tuple[float, ...]) -> list[Row]:
    rows = [row for mtbf in rates for row in failure_rows(setting, mtbf)]
    return rows + (straggler_rows(setting) if setting.straggler else [])


def main(setting: Setting, *, only: set[str], keep: bool) -> None:
    started = time.perf_counter()
    path = RESULTS / f"{setting.name}.json"
    previous = json.loads(path.read_text()) if (keep or only) and path.exists() else {}
    if previous and previous.get("setting", {}).get("prepare") != setting.prepare:
        raise SystemExit(f"{path} was measured with {previous['setting'].get('prepare')}, not {setting.prepare}: "
                         f"another --name, or run without --keep / --only")
    rows: dict[str, dict] = {r["name"]: r for r in previous.get("rows", [])}
    base = prepare(setting)
    out = {"setting": {**asdict(setting), "prepare": setting.prepare, "common": setting.common,
                       "async": [*ASYNC], "islands": setting.islands,
                       "task_seconds": setting.task_seconds, "path_parameters": path_parameters(setting, base),
                       "tokens_per_step": tokens_per_step(setting),
                       "capacity_tokens_per_second": setting.capacity(tokens_per_step=tokens_per_step(setting)),
                       "config": "configs/demo.yaml"},
           "rows": [], "seconds_before": previous.get("total_seconds", 0.0)}

    def wanted(name: str) -> bool:
        return (name in only) if only else not (keep and name in rows)

    def run(row: Row) -> None:
        if not wanted(row.name):
            return
        rows[row.name] = {**(data_parallel_row if row.mode == "dp" else island_row)(setting, base, row),
                          "commit": git_commit()}
        record()

    def record() -> None:
        out["rows"] = list(rows.values())
        out["total_seconds"] = out["seconds_before"] + time.perf_counter() - started
        recompute(out)  # rows kept from a results file measured before goodput by work too
        add_predictions(out)
        out["checks"] = evaluate_checks(out)
        write_results(setting.name, out, markdown(out))

    for row in failure_free_rows(setting):
        run(row)
    rates = setting.mtbf_tasks or tuple(previous.get("setting", {}).get("rates") or ())
    if not rates:
        out["rows"] = list(rows.values())
        rates = pick_rates(out, setting)
    out["setting"]["rates"] = list(rates)
    for row in rows_to_run(setting, rates):
        run(row)
    record()
    print(path.with_suffix(".md").read_text())


def pick_rates(out: dict, setting: Setting) -> tuple[float, ...]:
    """The MTBFs (task times, 2 significant digits) where the simulator, fitted to the failure-free rows,
    predicts `setting.dp_target` data-parallel and `setting.sync_target` sync goodput."""
    from bench.islands_prediction import mtbf_for_data_parallel, mtbf_for_sync

    dp = float(f"{mtbf_for_data_parallel(out, target=setting.dp_target):.2g}")
    sync = float(f"{mtbf_for_sync(out, target=setting.sync_target):.2g}")
    log(f"the simulator predicts data-parallel goodput {setting.dp_target:.0%} at MTBF {dp:g} T and sync "
        f"{setting.sync_target:.0%} at {sync:g} T")
    out["setting"]["picked"] = {"dp_target": setting.dp_target, "dp_mtbf_tasks": dp,
                                "sync_target": setting.sync_target, "sync_mtbf_tasks": sync}
    return tuple(sorted({dp, sync}, reverse=True))


def add_predictions(out: dict) -> None:
    """The simulator's goodput for each row's settings (bench/islands_prediction.py), in place."""
    from bench.islands_prediction import predict_rows

    out["prediction"] = predict_rows(out)


if __name__ == "__main__":
    from bench.islands_args import setting_from

    SETTING, ARGS = setting_from(sys.argv[1:])
    RESULT = RESULTS / f"{SETTING.name}.json"
    if ARGS.workers > 1 and (ARGS.markdown_only or ARGS.predict):
        from bench.islands_elastic import rerender

        print(rerender(SETTING, predict=ARGS.predict))
    elif ARGS.markdown_only or ARGS.predict or ARGS.recompute_goodput:
        record = json.loads(RESULT.read_text())
        if ARGS.recompute_goodput:
            recompute(record)
        if ARGS.predict or ARGS.recompute_goodput:
            add_predictions(record)
            record["checks"] = evaluate_checks(record)
            RESULT.write_text(json.dumps(record, indent=1) + "\n")
            RESULT.with_suffix(".md").write_text(with_source(record, markdown(record)))
        print(with_source(record, markdown(record)))
    elif ARGS.workers > 1:
        from bench.islands_elastic import main as elastic_main

        elastic_main(SETTING, workers=ARGS.workers, mtbf=SETTING.mtbf_tasks[0],
                     seeds=[int(x) for x in ARGS.seeds.split(",") if x.strip()],
                     only={name.strip() for name in ARGS.only.split(",") if name.strip()}, keep=ARGS.keep)
    elif ARGS.bandwidth is not None:
        from bench.islands_bandwidth import DEFAULT_VARIANTS, check_variants
        from bench.islands_bandwidth import main as bandwidth_main

        bandwidth_main(SETTING, bandwidths=ARGS.bandwidth, variants=check_variants(ARGS.variants or list(DEFAULT_VARIANTS)),
                       keep=ARGS.keep)
    else:
        only = {name.strip() for name in ARGS.only.split(",") if name.strip()}
        main(SETTING, only=only, keep=ARGS.keep)
