"""Benchmark: goodput and perplexity of sync vs async rounds under restart-style failures and a straggler,
and (with --compression) bytes per island per round with compressed pseudo-gradients.

    python bench/bench_islands.py                  # writes bench/results/islands.{json,md}
    python bench/bench_islands.py --compression    # also part (a), three more runs
    python bench/bench_islands.py --markdown-only  # re-render the tables from bench/results/islands.json
    python bench/bench_islands.py --predict        # (re)compute the simulator's column from the JSON
    BENCH_MTBF_TASKS=1 BENCH_STRAGGLER=0 python bench/bench_islands.py   # one failure rate, no straggler runs

Each run is a real `dipaco train` (coordinator + pull-based island processes over a local store) of the
demo grid (2x2 paths, the demo's warm start, 25 inner steps of batch 4, fp32, plain-averaging outer
step), then routed held-out perplexity (`dipaco eval`). Goodput is docs/islands.md#goodput's: the
inner-loop seconds of the results committed rounds applied (a resumed task counts the steps before its
checkpoint once; checkpoint writes are not counted) / (islands x seconds from the first heartbeat to
the last commit), from `train.json`.

(b) Failures as the paper models them: an island fails (its process keeps its disk), is back after a
    restart time R and resumes its task from its last inner checkpoint (`train.checkpoint_steps`, every
    step by default: ~T/25, the paper's ~T/20); failures per island are exponential with mean MTBF
    (`train.fail_mtbf`, `train.fail_mode=die`). MTBF and R are in units of the task time T measured by
    the failure-free sync run, so the settings mean the same on a loaded machine. The defaults are the
    paper's learner (150k chips at a one-year chip MTBI: MTBF ~1T, restart ~0.15T) and twice its rate.
    For each failure rate, sync and async run side by side (one after the other, in this invocation).
(c) A straggler: island-0 runs `train.slowdown`x slower, sync vs async (`BENCH_STRAGGLER=0` skips it).
(a) outer.compression none / int8 / int4 (--compression): bytes each island uploads and downloads per
    task, next to what data-parallel training would send for the same inner steps (a float32 gradient
    each way per step), and the perplexity each compression costs.
Next to each measured goodput: the simulator's prediction for the same settings
(bench/islands_prediction.py: `dipaco simulate`'s rounds, driven by the same round policy).

Budget: by default `BENCH_ISLANDS=4` island processes of one thread each, one per path (the
simulator's mapping needs one learner per path), on whatever cores there are, and `BENCH_ROUNDS=2`;
the results are written after every run, so a run cut short keeps what was measured.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import RESULTS, with_source, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.store.board import read_heartbeats, read_manifest, read_result_meta  # noqa: E402
from dipaco.store.module_store import ModuleStore  # noqa: E402

CONFIG = ROOT / "configs" / "demo.yaml"
# Random init and TF-IDF routing, as before the demo's warm start (goodput does not depend on it, and its
# dense pretraining takes longer than the runs on a loaded machine); BENCH_WARM_START=1 uses the demo's.
BASE = [] if os.environ.get("BENCH_WARM_START") == "1" else ["pretrain.steps=0", "routing.featurizer=tfidf"]
WORK = ROOT / "runs" / "bench-islands"
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
ISLANDS = int(os.environ.get("BENCH_ISLANDS", "4"))  # one island per path of the demo grid, as the paper's learners
CHECKPOINT_STEPS = int(os.environ.get("BENCH_CHECKPOINT_STEPS", "1"))  # of the demo's 25 inner steps (paper: ~T/20)
STRAGGLER = os.environ.get("BENCH_STRAGGLER", "1") != "0"  # the sync / async runs with island-0 3x slower
COMMON = [*BASE, f"train.rounds={ROUNDS}", "outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false",
          "eval.baselines=false", "eval.modes=[prefix]", f"train.islands={ISLANDS}", "train.threads_per_island=1", "train.keep_rounds=0",
          "train.precision=fp32", "eval.precision=fp32", "inner.batch_size=4",
          f"train.checkpoint_steps={CHECKPOINT_STEPS}"]
ASYNC = ["outer.mode=async", "outer.quorum=0.5", "outer.max_staleness=2"]


# The failure model, from the paper's setting (docs/islands.md#benchmark): a learner of 150k chips at a
# per-chip MTBI of one year fails every 210 s, ~1 task time T of 200 s, and is back after a 30 s
# restart (docs/simulate.md's fit), 0.15 T, resuming from a checkpoint taken every ~T/20.
RESTART_TASKS = float(os.environ.get("BENCH_RESTART_TASKS", "0.15"))  # restart time R, in task times T
FAILURE_RATES = [float(x) for x in os.environ.get("BENCH_MTBF_TASKS", "0.5,1").split(",")]  # MTBF per island, in T
SLOWDOWN = 3.0


def failure_overrides(task_seconds: float, mtbf_tasks: float) -> list[str]:
    """Restart-style failures scaled to the measured task time T: each island fails on average every
    mtbf_tasks x T of its up-time, is back after R = RESTART_TASKS x T and resumes from its inner
    checkpoint; a silent island's task is handed on after T / 2."""
    t = max(task_seconds, 2.0)
    return [f"train.fail_mtbf={mtbf_tasks * t:.1f}", f"train.return_after={RESTART_TASKS * t:.1f}",
            "train.fail_mode=die", f"train.heartbeat_timeout={t / 2:.1f}", "train.heartbeat_seconds=0.5"]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dipaco(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"dipaco {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def prepare() -> RunDir:
    base = RunDir(WORK / "base")
    if not (base.shards / "index.json").exists():
        log("warm start, routing and sharding the bundled corpus (demo config)")
        if load_config(CONFIG, BASE).pretrain.steps:  # the demo's dense warm start; its model also routes (base-model)
            dipaco("pretrain", "--config", str(CONFIG), "--run", str(base.root), *BASE)
        dipaco("route", "--config", str(CONFIG), "--run", str(base.root), *BASE)
        dipaco("shard", "--config", str(CONFIG), "--run", str(base.root), *BASE)
    return base


def train_and_eval(base: RunDir, name: str, overrides: list[str]) -> dict:
    run = RunDir(WORK / name)
    if run.root.exists():
        shutil.rmtree(run.root)
    for part in ("tokenizer", "pretrain", "routing", "shards"):
        if (base.root / part).exists():
            shutil.copytree(base.root / part, run.root / part)
    args = ["--config", str(CONFIG), "--run", str(run.root), *COMMON, *overrides]
    log(f"{name}: training ({' '.join(overrides) or 'defaults'})")
    started = time.perf_counter()
    dipaco("train", *args)
    wall = time.perf_counter() - started
    dipaco("eval", *args)
    summary = json.loads(run.train_summary.read_text())
    evaluation = json.loads(run.eval_results.read_text())
    perplexity = next(m["perplexity"] for m in evaluation["models"] if m["model"].startswith("DiPaCo"))
    config = load_config(run.config)
    store = ModuleStore(str(run.store))
    tasks = _applied_tasks(store)
    failures = sum(beat.failures for beat in read_heartbeats(store).values())
    n = max(1, len(tasks))
    row = {
        "name": name, "overrides": overrides, "perplexity": perplexity, "wall_seconds": wall,
        "goodput": summary.get("goodput", {}).get("goodput"), "rounds": config.train.rounds,
        "applied_tasks": len(tasks), "stale_applied": sum(1 for t in tasks if t["staleness"] > 0),
        "dropped_tasks": sum(len(m.dropped) for m in _manifests(store)),
        "injected_failures": failures,
        "pseudo_gradient_bytes_up": sum(t["bytes"] for t in tasks) / n,
        "inner_state_bytes_up": sum(t["bytes_up_inner"] for t in tasks) / n,
        "module_bytes_down": sum(t["bytes_down_modules"] for t in tasks) / n,
        "inner_state_bytes_down": sum(t["bytes_down_inner"] for t in tasks) / n,
        "inner_steps": config.inner.steps,
        "task_seconds": sum(t["seconds"] for t in tasks) / n,
        "task_seconds_each": [t["seconds"] for t in tasks],
        "useful_island_seconds": summary.get("goodput", {}).get("useful_island_seconds"),
        "island_seconds": summary.get("goodput", {}).get("island_seconds"),
        "tasks_by_island": _tasks_by_island(store),
    }
    log(f"{name}: perplexity {perplexity:.2f}, goodput {row['goodput']:.2f}, {wall:.0f}s, "
        f"{row['pseudo_gradient_bytes_up'] / 1e3:.1f} kB pseudo-gradient per island-round, "
        f"{failures} injected failures")
    return row


def _applied_tasks(store: ModuleStore) -> list[dict]:
    """Every applied result's manifest entry, with the bytes its island moved besides the pseudo-gradient."""
    tasks = []
    for manifest in _manifests(store):
        for entry in manifest.applied:
            meta = read_result_meta(store, round=entry.base + 1, path=entry.path, attempt=entry.attempt)
            tasks.append({**entry.to_json(), "bytes_up_inner": meta.bytes_up_inner,
                          "bytes_down_modules": meta.bytes_down_modules, "bytes_down_inner": meta.bytes_down_inner})
    return tasks


def _tasks_by_island(store: ModuleStore) -> dict[str, int]:
    """Applied results per island (fast islands take more tasks)."""
    counts: dict[str, int] = {}
    for manifest in _manifests(store):
        for entry in manifest.applied:
            island = read_result_meta(store, round=entry.base + 1, path=entry.path, attempt=entry.attempt).island
            counts[island] = counts.get(island, 0) + 1
    return dict(sorted(counts.items()))


def _manifests(store: ModuleStore) -> list:
    return [m for m in (read_manifest(store, r) for r in range(1, store.current_round() + 1)) if m is not None]


def path_parameters(base: RunDir) -> int:
    from dipaco.model.path_model import count_parameters
    from dipaco.stages.context import PathFactory

    return count_parameters(PathFactory(load_config(CONFIG), base).new_model())


def main() -> None:
    started = time.perf_counter()
    base = prepare()
    params = path_parameters(base)
    rows = {"sync": train_and_eval(base, "sync", [])}
    task_seconds = rows["sync"]["task_seconds"]
    grace = [f"outer.grace_seconds={task_seconds / 5:.1f}"]  # at most T / 5 (adaptive below it: dipaco.islands.policy)
    out = {"budget": {}, "goodput": [], "compression": [], "runs": rows}
    settings: dict[str, list[str]] = {}
    steps = rows["sync"]["inner_steps"]

    def record(name: str, mode: str, fault: str, mtbf: float | None = None) -> None:
        """Add the run's row and write the results so far (a run cut short keeps what was measured)."""
        out["goodput"].append({**_goodput_row(rows, name, mode, fault), "mtbf_tasks": mtbf})
        out["budget"] = {
            "config": "configs/demo.yaml", "overrides": COMMON, "islands": ISLANDS, "rounds": ROUNDS,
            "failure_settings": settings, "async_overrides": ASYNC + grace, "task_seconds": task_seconds,
            "checkpoint_steps": CHECKPOINT_STEPS, "restart_tasks": RESTART_TASKS, "slowdown": SLOWDOWN,
            "path_parameters": params, "inner_steps_per_task": steps, "seconds": time.perf_counter() - started}
        write_results("islands", out, markdown(out))

    record("sync", "sync", "none")
    rows["async"] = train_and_eval(base, "async", [*ASYNC, *grace])
    record("async", "async", "none")
    for mtbf in FAILURE_RATES:
        failures = failure_overrides(task_seconds, mtbf)
        settings[f"mtbf {mtbf:g}T"] = failures
        for mode, extra in (("sync", []), ("async", [*ASYNC, *grace])):
            name = f"{mode}-mtbf{mtbf:g}"
            rows[name] = train_and_eval(base, name, [*extra, *failures])
            record(name, mode, f"MTBF {mtbf:g}T, restart {RESTART_TASKS:g}T", mtbf)
    for mode, extra in (("sync", []), ("async", [*ASYNC, *grace])) if STRAGGLER else ():
        name = f"{mode}-slow"
        rows[name] = train_and_eval(base, name, [*extra, f"train.slowdown={SLOWDOWN:g}"])
        record(name, mode, f"island-0 {SLOWDOWN:g}x slower")
    if "--compression" in sys.argv:
        rows["int8"] = train_and_eval(base, "int8", ["outer.compression=int8"])
        rows["int4"] = train_and_eval(base, "int4", ["outer.compression=int4"])
        dp_up = steps * params * 4  # per task: one full float32 gradient sent per inner step
        for name, key in (("none", "sync"), ("int8", "int8"), ("int4", "int4")):
            r = rows[key]
            out["compression"].append({
                "compression": name, "pseudo_gradient_bytes_up": r["pseudo_gradient_bytes_up"],
                "data_parallel_bytes_up": dp_up, "ratio_to_data_parallel": dp_up / r["pseudo_gradient_bytes_up"],
                "module_bytes_down": r["module_bytes_down"], "data_parallel_bytes_down": dp_up,
                "ratio_down_to_data_parallel": dp_up / r["module_bytes_down"],
                "inner_state_bytes_up": r["inner_state_bytes_up"], "inner_state_bytes_down": r["inner_state_bytes_down"],
                "perplexity": r["perplexity"],
                "perplexity_cost_pct": 100 * (r["perplexity"] / rows["sync"]["perplexity"] - 1),
            })
    add_predictions(out)
    path = write_results("islands", out, markdown(out))
    print(path.with_suffix(".md").read_text())


def add_predictions(out: dict) -> None:
    """The simulator's goodput for each measured run's settings (bench/islands_prediction.py), in place."""
    from bench.islands_prediction import predict_rows

    out["prediction"] = predict_rows(out)


def _goodput_row(rows: dict, name: str, mode: str, fault: str) -> dict:
    r, reference = rows[name], rows["sync"]
    return {"run": name, "mode": mode, "fault": fault, "goodput": r["goodput"], "perplexity": r["perplexity"],
            "perplexity_vs_failure_free_sync_pct": 100 * (r["perplexity"] / reference["perplexity"] - 1),
            "injected_failures": r["injected_failures"], "stale_applied": r["stale_applied"],
            "dropped": r["dropped_tasks"], "applied": r["applied_tasks"], "tasks_by_island": r["tasks_by_island"],
            "wall_seconds": r["wall_seconds"]}


def markdown(out: dict) -> str:
    b = out["budget"]
    lines = [
        "# Islands: goodput sync vs async under failures and a straggler",
        "",
        f"demo grid 2x2, {b['path_parameters']:,} parameters per path, {b['inner_steps_per_task']} inner steps per "
        f"task (batch 4, fp32), {b['rounds']} rounds, {b['islands']} island processes of one thread for 4 paths on "
        f"this machine, task time T = {b['task_seconds']:.1f}s (failure-free sync run), inner checkpoints every "
        f"{b['checkpoint_steps']} steps, async {' '.join(b['async_overrides'])}; whole benchmark {b['seconds']:.0f}s. "
        "Goodput as docs/islands.md#goodput defines it.",
        "",
        "| run | mode | fault | failures | goodput | simulator | perplexity | vs failure-free sync | applied | stale "
        "| dropped | tasks by island | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    predicted = {p["run"]: p for p in out.get("prediction", {}).get("runs", [])}
    for g in out["goodput"]:
        by_island = ", ".join(f"{k}: {v}" for k, v in g["tasks_by_island"].items())
        p = predicted.get(g["run"])
        sim = "" if p is None else f"{p['goodput']:.1%}" + (" (fitted)" if p.get("fitted") else "")
        lines.append(
            f"| {g['run']} | {g['mode']} | {g['fault']} | {g['injected_failures']} | {g['goodput']:.1%} | {sim} "
            f"| {g['perplexity']:.2f} | {g['perplexity_vs_failure_free_sync_pct']:+.2f}% | {g['applied']} "
            f"| {g['stale_applied']} | {g['dropped']} | {by_island} | {g['wall_seconds']:.0f}s |")
    lines += ["", "Failure settings: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in b["failure_settings"].items())]
    if out.get("prediction"):
        lines += ["", "Simulator: " + out["prediction"]["settings"]]
    if out["compression"]:
        lines += [
            "",
            "## Bytes per island per task (data parallel = one float32 gradient per inner step each way)",
            "",
            "| compression | pseudo-gradient up | DP up | DP / ours (up) | modules down | DP / ours (down) "
            "| inner state up / down | perplexity | cost |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in out["compression"]:
            lines.append(
                f"| {c['compression']} | {c['pseudo_gradient_bytes_up'] / 1e3:,.1f} kB | {c['data_parallel_bytes_up'] / 1e6:,.1f} MB "
                f"| {c['ratio_to_data_parallel']:,.0f}x | {c['module_bytes_down'] / 1e3:,.1f} kB "
                f"| {c['ratio_down_to_data_parallel']:,.0f}x | {c['inner_state_bytes_up'] / 1e3:,.0f} / "
                f"{c['inner_state_bytes_down'] / 1e3:,.0f} kB | {c['perplexity']:.2f} | {c['perplexity_cost_pct']:+.2f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown-only"]:  # re-render the table from bench/results/islands.json
        record = json.loads((RESULTS / "islands.json").read_text())
        print(with_source(record, markdown(record)))
    elif sys.argv[1:] == ["--predict"]:  # add the simulator's column to bench/results/islands.json
        record = json.loads((RESULTS / "islands.json").read_text())
        add_predictions(record)
        (RESULTS / "islands.json").write_text(json.dumps(record, indent=1) + "\n")
        (RESULTS / "islands.md").write_text(with_source(record, markdown(record)))
        print(with_source(record, markdown(record)))
    else:
        main()
