"""A trained run's DiPaCo mixture and its dense baselines in lm-evaluation-harness, side by side, as a results file.

    python bench/bench_lm_eval.py --name lm-eval-demo        # trains configs/demo.yaml into runs/lm-eval-demo first
    python bench/bench_lm_eval.py --run runs/demo --run-command "make demo" --name lm-eval-demo   # a finished run

CPU only is fine: the demo trains in 6-10 min on 2 idle cores, and the shipped tasks score in a minute or two.
The run is exported with its baselines (`dipaco export --baselines`, as `make lm-eval` does) to RUN-mixture,
then the mixture under each `--route` (default: router, then likelihood) and every dense baseline go through the
same `dipaco` model type (`dipaco.inference.side_by_side`) on `--tasks` (default: `dipaco_demo`, the two tasks
dipaco ships in dipaco/data/lm_eval). Writes bench/results/NAME.{json,md}: one row per model, each task's
metrics with lm-eval's standard error where it gives one, and the run's own held-out perplexity
(`dipaco eval`, RUN/eval.json) beside them. The shipped tasks' passages are documents of the demo corpus: the
file counts how many of them open a document of the run's train split.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import markdown_table, write_results  # noqa: E402

log = logging.getLogger(__name__)

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
EVAL_MODE = {"router": "prefix", "likelihood": "likelihood"}  # a routing's `dipaco eval` mode
PASSAGE_FIELD = {"dipaco_demo_continuation": ("demo_continuation.jsonl", "context"),
                 "dipaco_demo_text": ("demo_text.jsonl", "text")}  # a shipped task's file and the field its passage opens


def dipaco(*args: str) -> float:
    """Run `python -m dipaco ARGS` offline; returns its wall seconds."""
    log.info("python -m dipaco %s", " ".join(args))
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env={**os.environ, **OFFLINE}, check=True)
    return time.monotonic() - start


def evaluate(directory: Path, *, tasks: list[str], routes: list[str], limit: int | None) -> dict[str, dict]:
    """{model: lm-eval results per task}: the mixture once per routing, then each baseline (evaluated with the
    first routing's call; later calls score the baselines again and only their mixture row is kept)."""
    from dipaco.inference.side_by_side import evaluate_side_by_side

    mixture, baselines = {}, {}
    for route in routes:
        for model, per_task in evaluate_side_by_side(directory, tasks=tasks, route=route, limit=limit).items():
            (mixture if model.startswith("DiPaCo") else baselines).setdefault(model, per_task)
    return {**mixture, **baselines}


def held_out_perplexity(evaluation: dict) -> dict[str, float]:
    """{lm-eval model name: perplexity} from `dipaco eval`'s eval.json: each routing's mode (last checkpoints)
    for the mixture, each baseline's own row."""
    out = {m["model"]: m["perplexity"] for m in evaluation.get("models", []) if not m["model"].startswith("DiPaCo")}
    modes = {r["mode"]: r["perplexity"] for r in evaluation.get("modes", {}).get("rows", []) if r["checkpoints"] == "last"}
    for route, mode in EVAL_MODE.items():
        if mode in modes:
            out[f"DiPaCo ({route} routing)"] = modes[mode]
    return out


def count_trained(passages: list[str], texts: list[str], splits, *, train: int = 0) -> dict[str, int]:
    """How many `passages` open a document of the train split (`splits[i] == train`), how many open only other
    documents, and how many open none."""
    counts = {"passages": len(passages), "trained_on": 0, "held_out": 0, "not_found": 0}
    for passage in passages:
        found = [int(splits[i]) for i, text in enumerate(texts) if text.startswith(passage)]
        key = "not_found" if not found else "trained_on" if train in found else "held_out"
        counts[key] += 1
    return counts


def shipped_task_overlap(config_path: Path, tasks: list[str]) -> dict[str, dict[str, int]]:
    """count_trained for each shipped task asked for (a group such as dipaco_demo stands for both), against the
    corpus and splits `config_path` trains on."""
    from dipaco.config import load_config
    from dipaco.inference.side_by_side import SHIPPED_TASKS
    from dipaco.pipeline.documents import load_run_corpus, run_splits
    from routing.corpus import TRAIN

    wanted = [t for t in PASSAGE_FIELD if t in tasks or "dipaco_demo" in tasks]
    if not wanted:
        return {}
    corpus = load_config(config_path).corpus
    texts = list(load_run_corpus(corpus)["text"])
    splits = run_splits(corpus, len(texts))
    out = {}
    for task in wanted:
        file, field = PASSAGE_FIELD[task]
        rows = [json.loads(line) for line in (SHIPPED_TASKS / file).read_text().splitlines() if line.strip()]
        out[task] = count_trained([r[field] for r in rows], texts, splits, train=TRAIN)
    return out


def run_precision(run: Path) -> str:
    """The precision the run's config (RUN/config.yaml) resolves to on this machine's device."""
    from dipaco.config import load_config
    from dipaco.device import resolve_device, resolve_precision

    hardware = load_config(run / "config.yaml").hardware
    return resolve_precision(hardware.precision, resolve_device(hardware.device))


def figure(value) -> str:
    """A metric as the table shows it: 4 decimals under 10, else 2."""
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def markdown(record: dict) -> str:
    """The title, what was run, the models x metrics table (± lm-eval's standard error) and the notes."""
    from dipaco.inference.side_by_side import metric_columns

    results, perplexity = record["lm_eval"], record["held_out_perplexity"]
    columns = metric_columns(results)
    rows = []
    for model, per_task in results.items():
        cells = []
        for task, key in columns:
            value = per_task.get(task, {}).get(key)
            metric, _, filt = key.partition(",")
            stderr = per_task.get(task, {}).get(f"{metric}_stderr,{filt}")
            cells.append("-" if not isinstance(value, (int, float)) else
                         figure(value) + (f" ± {figure(stderr)}" if isinstance(stderr, (int, float)) else ""))
        rows.append([model, *cells, figure(perplexity[model]) if model in perplexity else "-"])
    headers = ["model", *(f"{task} {key.split(',')[0]}" for task, key in columns), "held-out perplexity (dipaco eval)"]
    lines = [f"# {record['title']}", "",
             f"The run: `{record['run_command']}`" + (f" ({record['run_seconds'] / 60:.1f} min)" if record["run_seconds"] else "")
             + f", trained and evaluated by `dipaco eval` in {record['run_precision']}"
             + f"; exported with its baselines to `{record['export']}` ({record['export_seconds']:.0f} s), "
             f"evaluated in {record['eval_seconds']:.0f} s (tasks `{','.join(record['tasks'])}`"
             + (f", limit {record['limit']}" if record["limit"] else "") + "). Every model is lm-eval's `dipaco` model type, "
             "scored in fp32 by the project's scorer; the mixture routes each request by its context.", "",
             markdown_table(headers, rows), ""]
    if record["overlap"]:
        parts = [f"`{task}`: {c['trained_on']} of {c['passages']} passages open a document of the run's train split"
                 + (f", {c['held_out']} only documents it held out" if c["held_out"] else "")
                 + (f", {c['not_found']} no document of its corpus" if c["not_found"] else "")
                 for task, c in record["overlap"].items()]
        seen = any(c["trained_on"] for c in record["overlap"].values())
        lines += ["The shipped tasks' passages are documents of the demo corpus (scripts/build_lm_eval_tasks.py); "
                  "against this run's corpus, " + "; ".join(parts) + "."
                  + (" So these scores compare the models side by side on their training data, not held-out quality."
                     if seen else ""), ""]
    lines += ["The held-out perplexity column is `dipaco eval` on the run's test split (RUN/eval.json); a mixture "
              "row takes the eval mode that routes the same way (router: `prefix`, likelihood: `likelihood`).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="lm-eval-demo", help="writes bench/results/NAME.{json,md}")
    parser.add_argument("--config", default="configs/demo.yaml", help="the run's config")
    parser.add_argument("--run", default=None, help="a finished run (default: train --config into runs/NAME)")
    parser.add_argument("--run-command", default=None, help="with --run: how it was made, for the record")
    parser.add_argument("--run-seconds", type=float, default=None, help="with --run: its wall time, for the record")
    parser.add_argument("--tasks", default="dipaco_demo", help="comma-separated lm-eval tasks")
    parser.add_argument("--route", action="append", choices=sorted(EVAL_MODE), default=None,
                        help="the mixture's routings, one row each (default: router and likelihood)")
    parser.add_argument("--limit", type=int, default=None, help="examples per task (a reduced run)")
    parser.add_argument("overrides", nargs="*", help="section.key=value for training (without --run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if args.run and not args.run_command:
        parser.error("--run needs --run-command: how the run was made, for the record")
    if args.run and args.overrides:
        parser.error(f"overrides {args.overrides} only apply when this script trains (without --run)")
    config = ROOT / args.config
    run = Path(args.run) if args.run else Path("runs") / args.name
    run_command, run_seconds = args.run_command, args.run_seconds
    if not args.run:
        run_command = " ".join(["python -m dipaco run --config", args.config, "--run", str(run), *args.overrides])
        run_seconds = dipaco("run", "--config", str(config), "--run", str(run), *args.overrides)
    export = Path(f"{run}-mixture")
    saved = ROOT / run / "config.yaml"  # the run's config, overrides included
    export_seconds = dipaco("export", str(export), "--baselines", "--overwrite", "--config", str(saved), "--run", str(run))
    tasks, start = args.tasks.split(","), time.monotonic()
    results = evaluate(ROOT / export, tasks=tasks, routes=args.route or ["router", "likelihood"], limit=args.limit)
    eval_seconds = time.monotonic() - start
    evaluation = json.loads((ROOT / run / "eval.json").read_text()) if (ROOT / run / "eval.json").is_file() else {}
    record = {"title": f"`{run}` in lm-evaluation-harness: the DiPaCo mixture and its dense baselines",
              "run": str(run), "run_command": run_command, "run_seconds": run_seconds, "export": str(export),
              "run_precision": run_precision(ROOT / run), "export_seconds": export_seconds,
              "eval_seconds": eval_seconds, "tasks": tasks, "limit": args.limit,
              "overlap": shipped_task_overlap(saved, tasks), "held_out_perplexity": held_out_perplexity(evaluation),
              "lm_eval": results}
    text = markdown(record)
    print(text)
    write_results(args.name, json.loads(json.dumps(record, default=str)), text)


if __name__ == "__main__":
    main()
