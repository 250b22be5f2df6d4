"""A readable report of a run: `report.md` with PNG plots, written into the run directory.

    dipaco report --run runs/demo          # after train + eval; the last stage of `dipaco run`

Reads what the stages wrote (train.json, the store's best.json, eval.json, the shard index and the
baselines' summaries) and draws, with matplotlib's Agg backend:
- `report/loss.png`: training loss (per round) and validation loss (per module version) of every path;
- `report/perplexity.png`: routed perplexity per eval mode against the dense baselines;
- `report/paths.png`: training tokens per path, test documents routed to each path, parameters;
- `report/bytes.png`: bytes the islands sent per round;
- `report/all_paths.png`: every path on every path's test documents (when eval ran `all-paths`).
Anything a stage has not produced yet is left out and said so.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
from pathlib import Path

import numpy as np

from dipaco.atomic import write_bytes, write_text
from dipaco.config import Config
from dipaco.pipeline.context import PathFactory
from dipaco.run_dir import RunDir
from dipaco.tables import format_table

log = logging.getLogger(__name__)


def write_report(config: Config, run: RunDir) -> Path:
    """Write `run/report.md` and its images under `run/report/`; returns the report's path."""
    if not run.train_summary.exists() and not run.eval_results.exists():
        raise FileNotFoundError(f"{run.root} has neither {run.train_summary.name} nor {run.eval_results.name}: "
                                f"nothing to report; run `dipaco train` and `dipaco eval --run {run.root}` first")
    import matplotlib

    matplotlib.use("Agg")
    figures = run.root / "report"
    figures.mkdir(parents=True, exist_ok=True)
    train = _json(run.train_summary)
    rounds = train.get("rounds", []) if isinstance(train, dict) else None
    if not isinstance(rounds, list) or not all(isinstance(r, dict) for r in rounds):
        raise ValueError(f"{run.train_summary} is not a training summary (\"rounds\" should be a list of objects); "
                         f"`dipaco train --run {run.root}` writes it again")
    evaluation = _json(run.eval_results)
    index = _json(run.shards / "index.json")
    best = _best(config, run)
    levels = "x".join(map(str, config.topology.levels))
    lines = [f"# DiPaCo run report: {run.root}", "",
             f"Grid {levels} ({math.prod(config.topology.levels)} paths), {config.model.n_layers} blocks of width "
             f"{config.model.hidden_size}, {config.run.rounds} rounds x {config.inner.steps} inner steps, "
             f"outer lr {config.outer_step.lr} momentum {config.outer_step.momentum}.", ""]
    lines += _loss_section(train, best, figures)
    lines += _eval_section(evaluation, figures)
    lines += _paths_section(index, evaluation, figures)
    lines += _bytes_section(train, figures)
    return write_text(run.root / "report.md", "\n".join(lines) + "\n")


def _loss_section(train: dict, best: dict, figures: Path) -> list[str]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = train.get("rounds", [])
    history = {int(p): {int(v): x for v, x in h.items()} for p, h in best.get("history", {}).items()}
    if not history:  # an older run: the per-round val_loss_start of train.json
        for r in rounds:
            for p, x in r.get("val_loss_start", {}).items():
                history.setdefault(int(p), {})[r["round"] - 1] = x
    if not rounds:
        return ["## Loss", "", "No training rounds yet (`dipaco train`).", ""]
    paths = sorted({int(p) for r in rounds for p in r["train_loss"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, p in enumerate(paths):
        color = colors[i % len(colors)]
        mine = [r for r in rounds if str(p) in r["train_loss"]]  # async: a round applies some of the paths
        ax.plot([r["round"] for r in mine], [r["train_loss"][str(p)] for r in mine], "-o", ms=3, color=color,
                label=f"path {p} train" if len(paths) <= 8 else None)
        if p in history:
            versions = sorted(history[p])
            ax.plot(versions, [history[p][v] for v in versions], "--", color=color,
                    label=f"path {p} val" if len(paths) <= 8 else None)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (validation: loss of the modules after that round)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training (solid) and validation (dashed) loss per path")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, figures / "loss.png")
    lines = ["## Loss per path", "", "![training and validation loss](report/loss.png)", ""]
    if best.get("best"):
        rows = [[p, b["round"], f"{b['val_loss']:.3f}", f"{history.get(int(p), {}).get(max(history.get(int(p), {0: 0})), float('nan')):.3f}"]
                for p, b in best["best"].items()]
        lines += ["Best round per path (early stopping) against the last round:", "", "```",
                  format_table(["path", "best round", "best val loss", "last val loss"], rows), "```", ""]
        if best.get("kept_bytes") is not None:
            lines += [f"Module versions kept only because they are some path's best: "
                      f"{best['kept_bytes'] / 1e6:.2f} MB.", ""]
    return lines


def _eval_section(evaluation: dict, figures: Path) -> list[str]:
    import matplotlib.pyplot as plt

    if not evaluation:
        return ["## Routed perplexity", "", "Not evaluated yet (`dipaco eval`).", ""]
    bars = [(r["mode"] + (" (best)" if r["checkpoints"] == "best" else ""), r["perplexity"], "C0")
            for r in evaluation.get("modes", {}).get("rows", [])]
    if not bars:
        bars = [(m["model"], m["perplexity"], "C0") for m in evaluation["models"] if m["paths"] > 1]
    bars += [(m["model"], m["perplexity"], "C1") for m in evaluation["models"] if m["paths"] == 1]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(bars) + 1.2))
    names, values, colors = zip(*bars)
    ax.barh(range(len(bars)), values, color=colors)
    ax.set_yticks(range(len(bars)), names, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_xlabel("test perplexity (same tokens for every model)")
    ax.set_title("DiPaCo eval modes (blue) against dense baselines (orange)")
    _save(fig, figures / "perplexity.png")
    headers = ["model", "params/path", "params total", "warm start", "steps/path", "steps in all", "train tokens (all)",
               "perplexity"]
    rows = [[m["model"], f"{m['params_per_path']:,}", f"{m['params_total']:,}", m.get("pretrain_steps", 0),
             m["steps_per_path"], m.get("steps_total", m["steps_per_path"]), _tokens(m), f"{m['perplexity']:.2f}"]
            for m in evaluation["models"]]
    lines = ["## Routed perplexity", "",
             f"{evaluation['test_documents']} held-out documents, {evaluation['scored_tokens']:,} tokens scored "
             f"after a {evaluation['prefix_tokens']}-token routing prefix.", "",
             "![perplexity per eval mode and baseline](report/perplexity.png)", "", "```",
             format_table(headers, rows), "```", ""]
    modes = evaluation.get("modes") or {}
    if modes.get("rows"):
        lines += ["```", format_table(["eval mode", "checkpoints", "perplexity"],
                                      [[r["mode"], r["checkpoints"], f"{r['perplexity']:.3f}"] for r in modes["rows"]]),
                  "```", ""]
    if modes.get("all_paths"):
        grid = np.array(modes["all_paths"], dtype=float)
        fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.6 * len(grid)), max(4.0, 1.2 + 0.5 * len(grid))))
        image = ax.imshow(grid, cmap="viridis_r")
        fig.colorbar(image, ax=ax, label="perplexity")
        ax.set_xlabel("test documents routed to path q")
        ax.set_ylabel("model of path p")
        ax.set_title("Every path on every path's documents", fontsize=10)
        ax.set_xticks(range(len(grid)))
        ax.set_yticks(range(len(grid)))
        if len(grid) <= 16:
            middle = np.nanmean(grid)
            for (p, q), x in np.ndenumerate(grid):
                if not np.isnan(x):
                    ax.text(q, p, f"{x:.1f}", ha="center", va="center", fontsize=7, color="w" if x > middle else "k")
        _save(fig, figures / "all_paths.png")
        lines += ["Specialisation: the diagonal is each path on its own documents.", "",
                  "![all paths on all documents](report/all_paths.png)", ""]
    return lines


def _paths_section(index: dict, evaluation: dict, figures: Path) -> list[str]:
    import matplotlib.pyplot as plt

    if not index:
        return []
    paths = [p["path"] for p in index["paths"]]
    tokens = [p["train"]["tokens"] for p in index["paths"]]
    test_docs = {p["path"]: p["documents"] for p in evaluation.get("per_path", [])}
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(paths, [t / 1e6 for t in tokens])
    axes[0].set_xlabel("path")
    axes[0].set_ylabel("training tokens (M)")
    axes[0].set_title("Training data per path")
    axes[1].bar(paths, [test_docs.get(p, 0) for p in paths], color="C2")
    axes[1].set_xlabel("path")
    axes[1].set_ylabel("test documents")
    axes[1].set_title("Test documents routed to each path")
    _save(fig, figures / "paths.png")
    lines = ["## Path sizes", "", "![data per path](report/paths.png)", ""]
    dipaco = [m for m in evaluation.get("models", []) if m["paths"] > 1]
    if dipaco:
        m = dipaco[0]
        lines += [f"Each path has {m['params_per_path']:,} parameters; all {m['paths']} paths together "
                  f"{m['params_total']:,} (shared modules counted once).", ""]
    return lines


def _bytes_section(train: dict, figures: Path) -> list[str]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = train.get("rounds", [])
    sent = [r.get("bytes_up", r.get("bytes", 0)) for r in rounds]
    if not rounds or not any(sent):
        return []
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["round"] for r in rounds], [b / 1e6 for b in sent])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("MB sent by the islands")
    ax.set_title("Pseudo-gradient bytes exchanged per round")
    _save(fig, figures / "bytes.png")
    return ["## Communication", "", "![bytes per round](report/bytes.png)", "",
            f"{sum(sent) / 1e6:.1f} MB of pseudo-gradients over {len(rounds)} rounds "
            f"({sum(sent) / len(rounds) / 1e6:.2f} MB per round).", ""]


def _best(config: Config, run: RunDir) -> dict:
    from dipaco.eval.early_stopping import read_best

    try:
        return read_best(PathFactory(config, run).store)
    except Exception as err:  # a report is still useful without the store
        log.warning("cannot read the validation-loss history from the store of %s: %s", run.root, err)
        return {}


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, image.getvalue())


def _tokens(row: dict) -> str:
    """A model's training tokens, the warm start's included (older eval.json files say tokens_seen)."""
    tokens = row.get("train_tokens_total", row.get("tokens_seen"))
    return f"{tokens:,}" if tokens else "-"


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    print(f"report: {write_report(config, run)}")
