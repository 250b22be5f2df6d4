"""An exported mixture and its dense baselines side by side in lm-evaluation-harness: one table.

    python -m dipaco.inference.side_by_side out/demo --tasks dipaco_demo --route router --json out/lm-eval.json
    make lm-eval RUN=runs/demo          # exports the run with its baselines, then this (TASKS=, ROUTE=, LIMIT=)

Every model goes through the same `dipaco` model type (`harness.MixtureLM`): the mixture routes each
request to one path, a baseline (`OUT/baselines/<name>/`, written by `dipaco export --baselines`) is one
model; the tokenization, windows and scorer are the same, so the numbers compare. Tasks come from
lm-evaluation-harness and from `--include-path` (default: the demo tasks dipaco ships, dipaco/data/lm_eval).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dipaco.inference.routes import route_arg
from dipaco.tables import format_table

log = logging.getLogger(__name__)

SHIPPED_TASKS = Path(__file__).resolve().parent.parent / "data" / "lm_eval"


def evaluate_side_by_side(directory: str | Path, *, tasks: list[str], route: str | None = None,
                          include_path: str | Path = SHIPPED_TASKS, limit: int | float | None = None,
                          batch_size: int = 16) -> dict[str, dict]:
    """{model name: lm_eval's `results` per task} for the mixture in `directory` and each of its baselines,
    one model in memory at a time."""
    from lm_eval import simple_evaluate

    from dipaco.inference.harness import MixtureLM

    directory = Path(directory)
    baselines = directory / "baselines"
    models = {f"DiPaCo ({route or 'export default'} routing)": (directory, route)}
    models.update({d.name: (d, None) for d in sorted(baselines.iterdir()) if d.is_dir()} if baselines.is_dir() else {})
    manager = task_manager(include_path, tasks)
    out = {}
    for name, (path, model_route) in models.items():
        log.info("lm-eval: %s", name)
        lm = MixtureLM(path=str(path), route=model_route, batch_size=batch_size)
        out[name] = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit)["results"]
        del lm
    return out


def task_manager(include_path: str | Path, tasks: list[str]):
    """lm_eval's task index: `include_path` alone when it holds every task asked for (indexing the hundreds of
    built-in tasks takes seconds), else with the built-in ones."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path), include_defaults=False)
    if all(task in manager.all_tasks for task in tasks):
        return manager
    return TaskManager(include_path=str(include_path))


def metric_columns(results: dict[str, dict]) -> list[tuple[str, str]]:
    """Every (task, metric key) any model has, in first-seen order, without the standard errors."""
    columns = []
    for per_task in results.values():
        for task, metrics in per_task.items():
            for key in metrics:
                metric = "," in key and "_stderr" not in key  # "acc,none": a metric and its filter
                if metric and (task, key) not in columns:
                    columns.append((task, key))
    return columns


def format_side_by_side(results: dict[str, dict]) -> str:
    """The models as rows, each task's metrics (without their standard errors) as columns."""
    columns = metric_columns(results)
    rows = [[name] + [_cell(per_task.get(task, {}).get(key)) for task, key in columns]
            for name, per_task in results.items()]
    return format_table(["model"] + [f"{task} {key.split(',')[0]}" for task, key in columns], rows)


def _cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a mixture written by `dipaco export DIR --baselines`")
    parser.add_argument("--tasks", default="dipaco_demo", help="comma-separated lm-eval tasks (default dipaco_demo)")
    parser.add_argument("--route", type=route_arg, default=None,
                        help="the mixture's routing (default: the export's)")
    parser.add_argument("--include-path", default=str(SHIPPED_TASKS), help="a directory of task YAMLs")
    parser.add_argument("--limit", type=float, default=None, help="examples per task (a fraction when < 1)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = evaluate_side_by_side(args.directory, tasks=args.tasks.split(","), route=args.route,
                                    include_path=args.include_path, limit=limit, batch_size=args.batch_size)
    print(format_side_by_side(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
