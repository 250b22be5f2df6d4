"""Benchmark: goodput and perplexity of sync vs async rounds under restart-style failures and a straggler,
and (with --compression) bytes per island per round with compressed pseudo-gradients.

    python bench/bench_islands.py                  # writes bench/results/islands.{json,md}
    python bench/bench_islands.py --compression    # also part (a), three more runs
    python bench/bench_islands.py --markdown-only  # re-render the tables from bench/results/islands.json
    python bench/bench_islands.py --predict        # (re)compute the simulator's column from the JSON
    BENCH_MTBF_TASKS=1 BENCH_STRAGGLER=0 python bench/bench_islands.py   # one failure rate, no straggler runs
    python bench/bench_islands.py --replicas 2 --inner-steps 25 --rounds 2 --mtbf 0.5 --no-straggler \
        --name islands-replicas2       # 8 islands (topology.replicas=2: 8 paths), bench/results/islands-replicas2.*

Each run is a real `dipaco train` (coordinator + pull-based island processes over a local store) of the
demo grid (2x2 paths, the demo's warm start, 25 inner steps of batch 4, fp32, plain-averaging outer
step), then routed held-out perplexity (`dipaco eval`). Goodput is docs/islands.md#goodput's: the
inner-loop seconds of the results committed rounds applied (a resumed task counts the steps before its
checkpoint once; checkpoint writes are not counted) / (islands x seconds from the first heartbeat to
the last commit), from `train.json`.

(b) Failures as the paper models them: an island fails (its process keeps its disk), is back after a
    restart time R and resumes its task from its last inner checkpoint (`resilience.checkpoint_steps`, every
    step by default: ~T/25, the paper's ~T/20); failures per island are exponential with mean MTBF
    (`faults.mtbf`, `faults.mode=die`). MTBF and R are in units of the task time T measured by
    the failure-free sync run, so the settings mean the same on a loaded machine. The defaults are the
    paper's learner (150k chips at a one-year chip MTBI: MTBF ~1T, restart ~0.15T) and twice its rate.
    For each failure rate, sync and async run side by side (one after the other, in this invocation).
(c) A straggler: island-0 runs `faults.slowdown`x slower, sync vs async (`BENCH_STRAGGLER=0` skips it).
(a) compression.codec none / int8 / int4 (--compression): bytes each island uploads and downloads per
    task, next to what data-parallel training would send for the same inner steps (a float32 gradient
    each way per step), and the perplexity each compression costs.
Next to each measured goodput: the simulator's prediction for the same settings
(bench/islands_prediction.py: `dipaco simulate`'s rounds, driven by the same round policy).

Budget: by default 4 island processes of one thread each, one per path (the simulator's mapping needs
one learner per path; `--replicas R` gives 4 R paths and as many islands), on whatever cores there are,
and 2 rounds (`--rounds`, or `BENCH_ROUNDS`; `--islands` / `BENCH_ISLANDS`, `--mtbf` / `BENCH_MTBF_TASKS`,
`--restart` / `BENCH_RESTART_TASKS`, `--checkpoint-steps` / `BENCH_CHECKPOINT_STEPS`); the results are
written after every run, so a run cut short keeps what was measured (`--predict` adds the simulator's
column afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
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
BASE = [] if os.environ.get("BENCH_WARM_START") == "1" else ["warm_start.fraction=0", "routing.featurizer=tfidf"]
WORK = ROOT / "runs" / "bench-islands"
ASYNC = ["rounds.mode=async", "rounds.quorum=0.5", "rounds.max_staleness=2"]
SLOWDOWN = 3.0


@dataclass(frozen=True)
class Setting:
    """What one invocation measures (command-line options; the defaults are the environment's, then the
    benchmark's historical ones: 4 islands, 2 rounds of 25 steps, MTBF 0.5 T and 1 T, R 0.15 T)."""

    replicas: int = 1  # topology.replicas: islands = 4 x replicas, one per path of the 2x2 grid
    islands: int = 4
    rounds: int = 2
    inner_steps: int = 25
    checkpoint_steps: int = 1  # of the inner steps (paper: ~T/20)
    restart_tasks: float = 0.15  # restart time R, in task times T
    mtbf_tasks: tuple[float, ...] = (0.5, 1.0)  # MTBF per island, in T
    sync_target: float | None = None  # also the MTBF at which the simulator predicts this sync goodput
    straggler: bool = True  # the sync / async runs with island-0 3x slower
    name: str = "islands"  # bench/results/<name>.{json,md}

    @property
    def common(self) -> list[str]:
        return [*BASE, f"run.rounds={self.rounds}", "outer.lr=1.0", "outer.momentum=0.0",
                "outer.rescale_by_paths=false", "eval.baselines=false", "eval.modes=[prefix]",
                f"hardware.islands={self.islands}", "hardware.threads_per_island=1", "store.keep_versions=0",
                "hardware.precision=fp32", "inner.batch_size=4",
                f"resilience.checkpoint_steps={self.checkpoint_steps}",
                *self.topology, f"inner.steps={self.inner_steps}"]  # always: configs/demo.yaml's own H is not the benchmark's

    @property
    def topology(self) -> list[str]:
        """The grid override (routing and sharding depend on it too)."""
        return [f"topology.replicas={self.replicas}"] if self.replicas > 1 else []

    @property
    def base_dir(self) -> Path:
        """The routed and sharded run the benchmark copies (routing depends on the replicas)."""
        return WORK / ("base" if self.replicas == 1 else f"base-replicas{self.replicas}")

    @property
    def work(self) -> Path:
        return WORK if self.name == "islands" else WORK / self.name


def setting_from(argv: list[str]) -> tuple[Setting, argparse.Namespace]:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=1,
                        help="topology.replicas (DiLoCo replicas per path): 2 gives 8 paths; islands default to 4 x this")
    parser.add_argument("--islands", type=int, default=None, help="island processes (default BENCH_ISLANDS, else one per path)")
    parser.add_argument("--rounds", type=int, default=int(env("BENCH_ROUNDS", "2")), help="run.rounds (results per path)")
    parser.add_argument("--inner-steps", type=int, default=25, help="inner.steps H per task")
    parser.add_argument("--checkpoint-steps", type=int, default=int(env("BENCH_CHECKPOINT_STEPS", "1")))
    parser.add_argument("--restart", type=float, default=float(env("BENCH_RESTART_TASKS", "0.15")),
                        help="restart time R in task times T")
    parser.add_argument("--mtbf", default=env("BENCH_MTBF_TASKS", "0.5,1"),
                        help="comma-separated MTBF per island in task times T, one sync + async pair each ('' for none)")
    parser.add_argument("--mtbf-for-sync", type=float, default=None, metavar="GOODPUT",
                        help="after the failure-free runs, also run the MTBF at which the simulator (fitted to them) "
                             "predicts this sync goodput, e.g. 0.5")
    parser.add_argument("--no-straggler", action="store_true", help="skip the straggler runs (BENCH_STRAGGLER=0)")
    parser.add_argument("--name", default="islands", help="results name: bench/results/NAME.{json,md}")
    parser.add_argument("--compression", action="store_true", help="also the int8 / int4 runs (part a)")
    parser.add_argument("--markdown-only", action="store_true", help="re-render bench/results/NAME.md from its JSON")
    parser.add_argument("--predict", action="store_true", help="(re)compute the simulator's column from the JSON")
    args = parser.parse_args(argv)
    islands = args.islands or (int(env("BENCH_ISLANDS")) if env("BENCH_ISLANDS") else 4 * args.replicas)
    if args.replicas < 1 or islands < 1 or args.rounds < 1 or args.inner_steps < 1 or args.checkpoint_steps < 0:
        parser.error(f"--replicas, --islands, --rounds and --inner-steps must be >= 1 and --checkpoint-steps >= 0, got "
                     f"{args.replicas}, {islands}, {args.rounds}, {args.inner_steps}, {args.checkpoint_steps}")
    mtbf = tuple(float(x) for x in args.mtbf.split(",") if x.strip())
    if any(m <= 0 for m in mtbf) or args.restart < 0:
        parser.error(f"--mtbf values must be > 0 and --restart >= 0, got {args.mtbf!r}, {args.restart}")
    if args.mtbf_for_sync is not None and not 0 < args.mtbf_for_sync < 1:
        parser.error(f"--mtbf-for-sync must be a goodput in (0, 1), got {args.mtbf_for_sync}")
    straggler = not args.no_straggler and env("BENCH_STRAGGLER", "1") != "0"
    return Setting(replicas=args.replicas, islands=islands, rounds=args.rounds, inner_steps=args.inner_steps,
                   checkpoint_steps=args.checkpoint_steps, restart_tasks=args.restart, mtbf_tasks=mtbf,
                   sync_target=args.mtbf_for_sync, straggler=straggler, name=args.name), args


# The failure model, from the paper's setting (docs/islands.md#benchmark): a learner of 150k chips at a
# per-chip MTBI of one year fails every 210 s, ~1 task time T of 200 s, and is back after a 30 s
# restart (docs/simulate.md's fit), 0.15 T, resuming from a checkpoint taken every ~T/20.
def failure_overrides(task_seconds: float, mtbf_tasks: float, *, restart_tasks: float) -> list[str]:
    """Restart-style failures scaled to the measured task time T: each island fails on average every
    mtbf_tasks x T of its up-time, is back after R = restart_tasks x T and resumes from its inner
    checkpoint; a silent island's task is handed on after T / 2."""
    t = max(task_seconds, 2.0)
    return [f"faults.mtbf={mtbf_tasks * t:.1f}", f"faults.return_after={restart_tasks * t:.1f}",
            "faults.mode=die", f"resilience.heartbeat_timeout={t / 2:.1f}", "resilience.heartbeat_seconds=0.5"]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dipaco(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"dipaco {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def prepare(setting: Setting) -> RunDir:
    base = RunDir(setting.base_dir)
    if not (base.shards / "index.json").exists():
        log("warm start, routing and sharding the bundled corpus (demo config)")
        options = [*BASE, *setting.topology]
        if load_config(CONFIG, options).pretrain_steps:  # the demo's dense warm start; its model also routes (base-model)
            dipaco("pretrain", "--config", str(CONFIG), "--run", str(base.root), *options)
        dipaco("route", "--config", str(CONFIG), "--run", str(base.root), *options)
        dipaco("shard", "--config", str(CONFIG), "--run", str(base.root), *options)
    return base


def train_and_eval(setting: Setting, base: RunDir, name: str, overrides: list[str]) -> dict:
    run = RunDir(setting.work / name)
    if run.root.exists():
        shutil.rmtree(run.root)
    for part in ("tokenizer", "pretrain", "routing", "shards"):
        if (base.root / part).exists():
            shutil.copytree(base.root / part, run.root / part)
    args = ["--config", str(CONFIG), "--run", str(run.root), *setting.common, *overrides]
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
        "goodput": summary.get("goodput", {}).get("goodput"), "rounds": config.run.rounds,
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


def path_parameters(setting: Setting, base: RunDir) -> int:
    from dipaco.model.path_model import count_parameters
    from dipaco.pipeline.context import PathFactory

    return count_parameters(PathFactory(load_config(CONFIG, setting.common), base).new_model())


def main(setting: Setting, *, compression: bool) -> None:
    started = time.perf_counter()
    base = prepare(setting)
    params = path_parameters(setting, base)
    rows = {"sync": train_and_eval(setting, base, "sync", [])}
    task_seconds = rows["sync"]["task_seconds"]
    grace = [f"rounds.grace_seconds={task_seconds / 5:.1f}"]  # at most T / 5 (adaptive below it: dipaco.rounds)
    out = {"budget": {}, "goodput": [], "compression": [], "runs": rows}
    settings: dict[str, list[str]] = {}
    steps = rows["sync"]["inner_steps"]

    def record(name: str, mode: str, fault: str, mtbf: float | None = None) -> None:
        """Add the run's row and write the results so far (a run cut short keeps what was measured)."""
        out["goodput"].append({**_goodput_row(rows, name, mode, fault), "mtbf_tasks": mtbf})
        out["budget"] = {
            "config": "configs/demo.yaml", "overrides": setting.common, "islands": setting.islands,
            "rounds": setting.rounds, "replicas": setting.replicas, "paths": 4 * setting.replicas,
            "failure_settings": settings, "async_overrides": ASYNC + grace, "task_seconds": task_seconds,
            "checkpoint_steps": setting.checkpoint_steps, "restart_tasks": setting.restart_tasks, "slowdown": SLOWDOWN,
            "path_parameters": params, "inner_steps_per_task": steps, "seconds": time.perf_counter() - started}
        write_results(setting.name, out, markdown(out))

    record("sync", "sync", "none")
    rows["async"] = train_and_eval(setting, base, "async", [*ASYNC, *grace])
    record("async", "async", "none")
    rates = list(setting.mtbf_tasks)
    if setting.sync_target is not None:
        from bench.islands_prediction import mtbf_for_sync

        mtbf = round(mtbf_for_sync(out, target=setting.sync_target), 2)
        out["mtbf_for_sync"] = {"target": setting.sync_target, "mtbf_tasks": mtbf}
        log(f"the simulator, fitted to the failure-free runs, predicts sync goodput {setting.sync_target:.0%} at "
            f"MTBF {mtbf:g} T")
        rates.insert(0, mtbf)
    for mtbf in rates:
        failures = failure_overrides(task_seconds, mtbf, restart_tasks=setting.restart_tasks)
        settings[f"mtbf {mtbf:g}T"] = failures
        for mode, extra in (("sync", []), ("async", [*ASYNC, *grace])):
            name = f"{mode}-mtbf{mtbf:g}"
            rows[name] = train_and_eval(setting, base, name, [*extra, *failures])
            record(name, mode, f"MTBF {mtbf:g}T, restart {setting.restart_tasks:g}T", mtbf)
    for mode, extra in (("sync", []), ("async", [*ASYNC, *grace])) if setting.straggler else ():
        name = f"{mode}-slow"
        rows[name] = train_and_eval(setting, base, name, [*extra, f"faults.slowdown={SLOWDOWN:g}"])
        record(name, mode, f"island-0 {SLOWDOWN:g}x slower")
    if compression:
        rows["int8"] = train_and_eval(setting, base, "int8", ["compression.codec=int8"])
        rows["int4"] = train_and_eval(setting, base, "int4", ["compression.codec=int4"])
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
    path = write_results(setting.name, out, markdown(out))
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
        f"task (batch 4, fp32), {b['rounds']} rounds, {b['islands']} island processes of one thread for "
        f"{b.get('paths', 4)} paths{' (topology.replicas=' + str(b['replicas']) + ')' if b.get('replicas', 1) > 1 else ''} on "
        f"this machine, task time T = {b['task_seconds']:.1f}s (failure-free sync run), inner checkpoints every "
        f"{b['checkpoint_steps']} steps, restart R = {b['restart_tasks']:g} T, async {' '.join(b['async_overrides'])}; "
        f"whole benchmark {b['seconds']:.0f}s. "
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
    if out.get("mtbf_for_sync"):
        m = out["mtbf_for_sync"]
        lines += ["", f"MTBF {m['mtbf_tasks']:g} T is where the simulator, fitted to the failure-free runs, predicted "
                      f"sync goodput {m['target']:.0%} (`--mtbf-for-sync {m['target']:g}`)."]
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
    SETTING, ARGS = setting_from(sys.argv[1:])
    RESULT = RESULTS / f"{SETTING.name}.json"
    if ARGS.markdown_only:  # re-render bench/results/NAME.md from its JSON
        record = json.loads(RESULT.read_text())
        print(with_source(record, markdown(record)))
    elif ARGS.predict:  # add the simulator's column to bench/results/NAME.json
        record = json.loads(RESULT.read_text())
        add_predictions(record)
        RESULT.write_text(json.dumps(record, indent=1) + "\n")
        RESULT.with_suffix(".md").write_text(with_source(record, markdown(record)))
        print(with_source(record, markdown(record)))
    else:
        main(SETTING, compression=ARGS.compression)
