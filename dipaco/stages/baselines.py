"""`dipaco baselines`: the dense baselines (`dipaco.eval.baselines`), each a path-shaped model (a 1x1
grid) trained on all paths' data with the same recipe.

    dipaco baselines --config configs/tiny.yaml --run runs/tiny     # all, in parallel processes
    dipaco baseline --name dense-equal-steps --config ... --run ...  # one

Each is trained by `dipaco.optim.dense.train_dense` (plain AdamW, the inner schedule stretched over
its own steps) into `baselines/<name>/` (`model.safetensors` and `summary.json`), from scratch; its
budget includes the `pretrain.steps` of the warm start the grid started from (`dipaco.eval.baselines`).
"""

from __future__ import annotations

import dataclasses
import logging

from dipaco.config import Config, save_config
from dipaco.device import resolve_device
from dipaco.eval.baselines import baseline_model_config
from dipaco.islands.processes import Task, plan_parallelism, run_tasks
from dipaco.optim.dense import is_trained, train_dense
from dipaco.run_dir import RunDir
from dipaco.stages.context import PathFactory, baseline_budgets

log = logging.getLogger(__name__)


def train_baseline(config: Config, run: RunDir, *, name: str) -> dict:
    """Train one baseline; returns its summary."""
    factory = PathFactory(config, run)
    steps = baseline_budgets(config, factory.topology.n_paths)
    if name not in steps:
        raise ValueError(f"unknown baseline {name!r}; baselines are {sorted(steps)}")
    spec = dataclasses.replace(factory.spec, model=baseline_model_config(config.model, config.eval, name))
    batches = factory.reader.iter_batches(None, "train", batch_size=config.inner.batch_size, seed=config.train.seed)
    _, summary = train_dense(spec, batches, steps=steps[name], inner=config.inner, seed=config.train.seed,
                             device=resolve_device(config.train.device), precision=config.train.precision,
                             out=run.baselines / name, info={"name": name, "pretrain_steps_in_budget": config.pretrain.steps})
    return summary


def train_baselines(config: Config, run: RunDir) -> None:
    """Train every baseline not yet trained, each in its own process, in parallel."""
    save_config(config, run.config)
    names = [name for name in baseline_budgets(config, 1) if not is_trained(run.baselines / name)]
    processes, threads = plan_parallelism(len(names), threads=config.train.threads_per_island)
    tasks = [Task(name=f"baseline {name}", args=["baseline", "--name", name, "--config", str(run.config),
                                                 "--run", str(run.root)], log=run.logs / f"baseline-{name}.log")
             for name in names]
    run_tasks(tasks, processes=processes, threads=threads, desc="baselines")
