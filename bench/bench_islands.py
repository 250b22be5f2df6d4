"""Benchmark: bytes per island per round with compressed pseudo-gradients, and goodput sync vs async.

    python bench/bench_islands.py            # or `make bench`; writes bench/results/islands.{json,md}
    python bench/bench_islands.py --markdown-only   # re-render the table from bench/results/islands.json
    BENCH_MTBF_TASKS=3 python bench/bench_islands.py --failures-only   # redo (b) with failures only

Budget (2 CPU cores, about 10 minutes when idle): the demo grid (2x2 paths of 1.3M parameters, 25 inner
steps per round of batch 4, fp32) on the bundled corpus, `ROUNDS` rounds, plain-averaging outer step (lr 1, momentum 0, no
rescale; see the brief), one island process per path (`train.islands=4`), each run a real
`dipaco train` (coordinator + pull-based island processes over a local store), then routed
held-out perplexity (`dipaco.stages.evaluate`).

(a) outer.compression none / int8 / int4: bytes each island uploads and downloads per round (one
    task = one path for one round), next to what data-parallel training would send for the same
    inner steps: every step, each worker sends its full float32 gradient and receives the averaged
    one (P parameters x 4 bytes each way, per step). Perplexity cost of each compression.
(b) outer.mode sync vs async, with no failures and with injected island deaths
    (`train.fail_mtbf`, `train.return_after`, `train.heartbeat_timeout`): goodput = island seconds
    spent on inner steps whose results were applied / (islands x wall seconds from the first
    heartbeat to the last commit), and final perplexity.
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
WORK = ROOT / "runs" / "bench-islands"
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
ISLANDS = 4
COMMON = [f"train.rounds={ROUNDS}", "outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false",
          "eval.baselines=false", f"train.islands={ISLANDS}", "train.threads_per_island=1", "train.keep_rounds=0",
          "train.precision=fp32", "eval.precision=fp32", "inner.batch_size=4"]
ASYNC = ["outer.mode=async", "outer.quorum=0.5", "outer.max_staleness=2"]


MTBF_TASKS = float(os.environ.get("BENCH_MTBF_TASKS", "2"))


def failure_overrides(task_seconds: float) -> list[str]:
    """Failures scaled to the measured task time T (machines differ, and so does their load): each island
    fails on average every MTBF_TASKS x T, stays away T / 2, and is declared lost after T / 3 without
    heartbeats."""
    t = max(task_seconds, 3.0)
    return [f"train.fail_mtbf={MTBF_TASKS * t:.1f}", f"train.return_after={t / 2:.1f}",
            f"train.heartbeat_timeout={t / 3:.1f}", "train.heartbeat_seconds=0.5"]
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
        log("routing and sharding the bundled corpus (demo config)")
        dipaco("route", "--config", str(CONFIG), "--run", str(base.root))
        dipaco("shard", "--config", str(CONFIG), "--run", str(base.root))
    return base


def train_and_eval(base: RunDir, name: str, overrides: list[str]) -> dict:
    run = RunDir(WORK / name)
    if run.root.exists():
        shutil.rmtree(run.root)
    for part in ("tokenizer", "routing", "shards"):
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
    if "--failures-only" in sys.argv:  # reuse the failure-free runs of the last benchmark
        previous = json.loads((RESULTS / "islands.json").read_text())
        rows = {k: previous["runs"][k] for k in ("none", "int8", "int4", "async")}
        started -= previous["budget"]["seconds"] - sum(previous["runs"][k]["wall_seconds"]
                                                       for k in ("sync-failures", "async-failures"))
    else:
        rows = {}
        rows["none"] = train_and_eval(base, "none", [])
        rows["int8"] = train_and_eval(base, "int8", ["outer.compression=int8"])
        rows["int4"] = train_and_eval(base, "int4", ["outer.compression=int4"])
    task_seconds = rows["none"]["task_seconds"]
    grace = [f"outer.grace_seconds={task_seconds / 5:.1f}"]  # the fast islands wait at most T / 5 for stragglers
    failures = failure_overrides(task_seconds)
    if "async" not in rows:
        rows["async"] = train_and_eval(base, "async", [*ASYNC, *grace])
    rows["sync-failures"] = train_and_eval(base, "sync-failures", failures)
    rows["async-failures"] = train_and_eval(base, "async-failures", [*ASYNC, *grace, *failures])

    steps = rows["none"]["inner_steps"]
    dp_up = steps * params * 4  # per round: one full float32 gradient sent per inner step
    compression = []
    for name in ("none", "int8", "int4"):
        r = rows[name]
        compression.append({
            "compression": name, "pseudo_gradient_bytes_up": r["pseudo_gradient_bytes_up"],
            "data_parallel_bytes_up": dp_up, "ratio_to_data_parallel": dp_up / r["pseudo_gradient_bytes_up"],
            "module_bytes_down": r["module_bytes_down"], "data_parallel_bytes_down": dp_up,
            "ratio_down_to_data_parallel": dp_up / r["module_bytes_down"],
            "inner_state_bytes_up": r["inner_state_bytes_up"], "inner_state_bytes_down": r["inner_state_bytes_down"],
            "perplexity": r["perplexity"],
            "perplexity_cost_pct": 100 * (r["perplexity"] / rows["none"]["perplexity"] - 1),
        })
    goodput = []
    for name, mode, failing in (("none", "sync", False), ("async", "async", False),
                                ("sync-failures", "sync", True), ("async-failures", "async", True)):
        r = rows[name]
        goodput.append({"mode": mode, "failures": failing, "goodput": r["goodput"], "perplexity": r["perplexity"],
                        "perplexity_vs_failure_free_sync_pct": 100 * (r["perplexity"] / rows["none"]["perplexity"] - 1),
                        "injected_failures": r["injected_failures"], "stale_applied": r["stale_applied"],
                        "dropped": r["dropped_tasks"], "applied": r["applied_tasks"], "wall_seconds": r["wall_seconds"]})
    out = {
        "budget": {"config": "configs/demo.yaml", "overrides": COMMON, "failure_overrides": failures,
                   "async_overrides": ASYNC + grace, "task_seconds": task_seconds, "path_parameters": params, "inner_steps_per_round": steps,
                   "seconds": time.perf_counter() - started},
        "compression": compression, "goodput": goodput, "runs": rows,
    }
    path = write_results("islands", out, markdown(out))
    print(path.with_suffix(".md").read_text())


def markdown(out: dict) -> str:
    b = out["budget"]
    lines = [
        "# Islands: compressed pseudo-gradients and goodput",
        "",
        f"demo grid 2x2, {b['path_parameters']:,} parameters per path, {b['inner_steps_per_round']} inner steps per "
        f"round (batch 4, fp32), {ROUNDS} rounds, {ISLANDS} island processes (one per path) on this machine, "
        f"mean task {b['task_seconds']:.1f}s; "
        f"whole benchmark {b['seconds']:.0f}s. Data parallel = one float32 gradient per inner step each way.",
        "",
        "## (a) bytes per island per round",
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
    lines += [
        "",
        f"## (b) goodput, sync vs async (failures: {' '.join(b['failure_overrides'])}; async: "
        f"{' '.join(b['async_overrides'])})",
        "",
        "| mode | failures | injected | goodput | perplexity | vs failure-free sync | applied | stale applied "
        "| dropped | wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in out["goodput"]:
        lines.append(
            f"| {g['mode']} | {'yes' if g['failures'] else 'no'} | {g['injected_failures']} | {g['goodput']:.1%} "
            f"| {g['perplexity']:.2f} | {g['perplexity_vs_failure_free_sync_pct']:+.2f}% | {g['applied']} "
            f"| {g['stale_applied']} | {g['dropped']} | {g['wall_seconds']:.0f}s |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown-only"]:  # re-render the table from bench/results/islands.json
        record = json.loads((RESULTS / "islands.json").read_text())
        print(with_source(record, markdown(record)))
    else:
        main()
