"""`dipaco baselines`: the dense baselines (`dipaco.eval.dense_baselines`), each a path-shaped model (a 1x1
grid) trained on all paths' data with the same recipe.

    dipaco baselines --config configs/tiny.yaml --run runs/tiny     # all, in parallel processes
    dipaco _train-baseline --name dense-equal-steps --config ... --run ...  # one (internal: what each process runs)

Each is trained by `dipaco.optim.dense.train_dense` (plain AdamW, the inner schedule stretched over
its own steps) into `baselines/<name>/` (`model.safetensors` and `summary.json`). Its budget includes
the steps of the warm start the grid started from (`dipaco.eval.dense_baselines`): with
`eval.baselines_init: warm-start` (the default) a path-sized baseline continues from that dense model
(`pretrain/model.safetensors`) for the rest of its budget; with `scratch` it trains the whole budget
from a fresh model. The summary records which (`init`) and the warm start's steps and tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable

from dipaco.config import Config, save_config
from dipaco.device import resolve_device
from dipaco.eval.dense_baselines import baseline_model_config, continues_warm_start, own_steps
from dipaco.islands.processes import Task, WorkerPool, available_cores, plan_parallelism, run_tasks
from dipaco.model.topology import Topology
from dipaco.optim.dense import PARAMETERS, SUMMARY, is_trained, train_dense
from dipaco.optim.inner import phase_steps
from dipaco.pipeline.context import PathFactory, baseline_budgets, check_schedule, warm_start_optimizer
from dipaco.pipeline.fingerprints import check
from dipaco.run_dir import RunDir

log = logging.getLogger(__name__)

INTERNAL_COMMAND = "_train-baseline"  # `dipaco _train-baseline`: one baseline, in a process of its own (hidden from --help)


def train_baseline(config: Config, run: RunDir, *, name: str) -> dict:
    """Train one baseline; returns its summary."""
    factory = PathFactory(config, run)
    steps = baseline_budgets(config, factory.topology.n_paths)
    if name not in steps:
        raise ValueError(f"unknown baseline {name!r}; baselines are {sorted(steps)}")
    spec = dataclasses.replace(factory.spec, model=baseline_model_config(config.model, config.eval, name))
    warm = continues_warm_start(name, init=config.eval.baselines_init, pretrain_steps=config.pretrain_steps,
                                warm_start=config.warm_start.init_modules)
    start = warm_start_record(config, run) if warm else {"steps": 0, "tokens": 0}
    info = {"name": name, "init": "warm-start" if warm else "scratch", "pretrain_steps": start["steps"],
            "pretrain_tokens": start["tokens"], "pretrain_steps_in_budget": config.pretrain_steps}
    batches = factory.reader.iter_batches(None, "train", batch_size=config.inner.batch_size, seed=config.run.seed)
    own = own_steps(steps[name], pretrain_steps=start["steps"], warm_started=warm)
    _, summary = train_dense(spec, batches, steps=own, inner=config.inner, seed=config.run.seed,
                             device=resolve_device(config.hardware.device), precision=config.hardware.precision,
                             out=run.baselines / name, info=info, init=run.pretrain / PARAMETERS if warm else None,
                             schedule=phase_steps(config.inner, steps=own, after=start["steps"]),
                             init_optimizer=warm_start_optimizer(config, run) if warm else None)
    return summary


def warm_start_record(config: Config, run: RunDir) -> dict:
    """Steps and tokens of the run's dense warm start (`pretrain/summary.json`), which a baseline
    continues from; an error naming the file when it is missing or trained for other than `Config.pretrain_steps`."""
    record, parameters = run.pretrain / SUMMARY, run.pretrain / PARAMETERS
    if not (record.exists() and parameters.exists()):
        raise ValueError(f"the baselines continue from the dense warm start (eval.baselines_init: warm-start), but "
                         f"{parameters} or {record} is missing: run `dipaco pretrain --run {run.root}` first, or set "
                         f"eval.baselines_init=scratch")
    pretrained = json.loads(record.read_text())
    check_schedule(config, record)
    if int(pretrained["steps"]) != config.pretrain_steps:
        raise ValueError(f"{record} records a warm start of {pretrained['steps']} steps, but this config asks for "
                         f"{config.pretrain_steps}: run `dipaco pretrain` again (or `dipaco run --restart-from pretrain`)")
    return {"steps": int(pretrained["steps"]), "tokens": int(pretrained["tokens"])}


def train_baselines(config: Config, run: RunDir, *, alongside: Callable[[], object] | None = None) -> None:
    """Train every baseline not yet trained, each in its own process, in parallel. With `alongside` (the
    train stage, `dipaco run`; `eval.baselines_with_train`): the baseline with the largest budget (the
    longest) trains while `alongside()` runs its island processes, with a share of the cores as if it were
    one more island, and the others after `alongside()` returns, next to the longest one, so that no core
    idles while it finishes. When `alongside()` raises, the baseline it ran with is stopped."""
    check(run, config, ("route", "shard"))
    save_config(config, run.config)
    n_paths = Topology.from_config(config.topology, n_layers=config.model.n_layers).n_paths
    budgets = baseline_budgets(config, n_paths)
    names = sorted((name for name in budgets if not is_trained(run.baselines / name)), key=lambda n: -budgets[n])
    tasks = [Task(name=f"baseline {name}", args=[INTERNAL_COMMAND, "--name", name, "--config", str(run.config),
                                                 "--run", str(run.root)], log=run.logs / f"baseline-{name}.log")
             for name in names]
    first = None
    if alongside is not None:
        if tasks:
            islands, _ = plan_parallelism(n_paths, processes=config.hardware.islands)  # the train stage's rule
            threads = max(1, available_cores() // (islands + 1))
            log.info("training %s alongside the islands (torch threads: %d)", tasks[0].name, threads)
            first, tasks = WorkerPool(tasks[:1], threads=threads), tasks[1:]
        try:
            alongside()
        except BaseException:
            if first is not None:
                first.terminate()
            raise
    try:
        if tasks:
            processes, threads = plan_parallelism(len(tasks) + (first is not None), threads=config.hardware.threads_per_island)
            run_tasks(tasks, processes=max(1, processes - (first is not None)), threads=threads, desc="baselines")
        if first is not None:
            first.wait()
    except BaseException:
        if first is not None:
            first.terminate()
        raise


def command(config: Config, run: RunDir, args: argparse.Namespace, *, alongside: Callable[[], object] | None = None) -> None:
    """`alongside` (`dipaco run`): a stage to run while the longest baseline trains."""
    train_baselines(config, run, alongside=alongside)


def command_one(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    """The internal `dipaco _train-baseline --name NAME`: one baseline, in the process `train_baselines` started."""
    summary = train_baseline(config, run, name=args.name)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}))
