"""Dense baselines: one path-sized model (a 1x1 grid) trained on all paths' data with the same recipe.

    dipaco baselines --config configs/tiny.yaml --run runs/tiny     # both, in parallel processes
    dipaco baseline --name dense-equal-steps --config ... --run ...  # one

- `dense-equal-steps`: as many inner steps as each path took (rounds x H): equal wall-clock when
  the islands run in parallel, the paper's headline comparison;
- `dense-equal-compute`: as many steps as all paths together (paths x rounds x H): equal compute;
- `dense-large` (when `eval.large_hidden_size` is set): a wider / deeper dense model (the paper's
  1.3B against 150M paths: about 8x a path's parameters) for as many steps as each path.

Each is trained by plain AdamW with the inner schedule stretched over its own steps, and saved as
`baselines/<name>/model.safetensors` with a `summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from dipaco.config import Config, ModelConfig, save_config
from dipaco.device import resolve_device
from dipaco.islands.processes import Task, plan_parallelism, run_tasks
from dipaco.model.path_model import count_parameters, load_parameters, save_parameters
from dipaco.optim.inner import make_optimizer, train_steps
from dipaco.run_dir import RunDir
from dipaco.stages.context import PathFactory

log = logging.getLogger(__name__)


def baseline_steps(config: Config, n_paths: int) -> dict[str, int]:
    """The inner-step budget of each baseline."""
    per_path = config.train.rounds * config.inner.steps
    budgets = {"dense-equal-steps": per_path, "dense-equal-compute": per_path * n_paths}
    if config.eval.large_hidden_size:
        budgets["dense-large"] = per_path
    return budgets


def baseline_model_config(config: Config, name: str) -> ModelConfig:
    """The architecture of a baseline: a path's, or the `dense-large` one (same head size)."""
    if name != "dense-large":
        return config.model
    head = config.model.hidden_size // config.model.n_heads
    return dataclasses.replace(config.model, hidden_size=config.eval.large_hidden_size,
                               n_heads=config.eval.large_hidden_size // head,
                               n_layers=config.eval.large_n_layers or config.model.n_layers)


def train_baseline(config: Config, run: RunDir, *, name: str) -> dict:
    factory = PathFactory(config, run)
    budgets = baseline_steps(config, factory.topology.n_paths)
    if name not in budgets:
        raise ValueError(f"unknown baseline {name!r}; baselines are {sorted(budgets)}")
    steps = budgets[name]
    device = resolve_device(config.train.device)
    model_config = baseline_model_config(config, name)
    model = dataclasses.replace(factory.spec, model=model_config).new_model(seed=config.train.seed).to(device)
    optimizer = make_optimizer(model, config.inner)
    batches = factory.reader.iter_batches(None, "train", batch_size=config.inner.batch_size, seed=config.train.seed)
    log.info("training %s for %d steps", name, steps)
    started = time.perf_counter()
    stats = train_steps(model, optimizer, batches, start_step=0, steps=steps, total_steps=steps,
                        config=config.inner, device=device, precision=config.train.precision)
    out = run.baselines / name
    out.mkdir(parents=True, exist_ok=True)
    save_parameters(model, out / "model.safetensors")
    summary = {
        "name": name,
        "steps": steps,
        "tokens": stats["tokens"],
        "seconds": time.perf_counter() - started,
        "parameters": count_parameters(model),
        "model": dataclasses.asdict(model_config),
        "final_train_loss": sum(stats["losses"][-10:]) / len(stats["losses"][-10:]),
        "losses": stats["losses"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def train_baselines(config: Config, run: RunDir) -> None:
    """Train every baseline not yet trained, each in its own process, in parallel."""
    save_config(config, run.config)
    names = [name for name in baseline_steps(config, 1) if not (run.baselines / name / "summary.json").exists()]
    processes, threads = plan_parallelism(len(names), threads=config.train.threads_per_island)
    tasks = [Task(name=f"baseline {name}", args=["baseline", "--name", name, "--config", str(run.config),
                                                 "--run", str(run.root)], log=run.logs / f"baseline-{name}.log")
             for name in names]
    run_tasks(tasks, processes=processes, threads=threads, desc="baselines")


def load_baseline(factory: PathFactory, name: str):
    """A trained baseline model (CPU, float32) and its summary."""
    folder = factory.run.require(factory.run.baselines / name / "summary.json", "baselines").parent
    summary = json.loads((folder / "summary.json").read_text())
    model = dataclasses.replace(factory.spec, model=ModelConfig(**summary["model"])).new_model()
    load_parameters(model, folder / "model.safetensors")
    return model, summary
