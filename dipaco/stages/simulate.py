"""`dipaco simulate`: the chaos simulator (`dipaco.simulate`) at the `simulate` config section's cluster.

    dipaco simulate --run runs/sim simulate.learners=16 simulate.chip_mtbi_hours=4383

Writes `<run>/simulate/simulate.json` (settings, the four strategies side by side, the sweep) and
`<run>/simulate/goodput-vs-chips.png`, and returns the results. The round policy's settings (quorum,
grace window, staleness) are the `rounds` section's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from dipaco.atomic import write_text
from dipaco.config import Config
from dipaco.run_dir import RunDir
from dipaco.simulate.scenario import compare, format_comparison, sweep
from dipaco.simulate.settings import Settings

log = logging.getLogger(__name__)


def simulate(config: Config, run: RunDir, *, with_sweep: bool = True) -> dict:
    import json

    settings = Settings.from_config(config)
    results = {"settings": {"simulate": dataclasses.asdict(config.simulate), "rounds": dataclasses.asdict(config.rounds),
                            "codec": settings.codec, "inner_steps": settings.inner_steps},
               "strategies": compare(settings), "sweep": sweep(settings) if with_sweep else []}
    out = run.root / "simulate"
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "simulate.json", json.dumps(results, indent=2) + "\n")
    if results["sweep"]:
        plot_sweep(results["sweep"], out / "goodput-vs-chips.png",
                   title=f"per-chip MTBI {config.simulate.chip_mtbi_hours / 8766:.2g} years")
    return results


def plot_sweep(rows: list[dict], path: Path, *, title: str) -> Path:
    """Goodput against total chips: one line per async learner count, and the two data-parallel lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        label = (f"async rounds, {row['learners']} learner{'s' if row['learners'] > 1 else ''}"
                 if row["strategy"] == "async rounds" else row["strategy"])
        lines.setdefault(label, []).append((row["chips"], row["goodput"]))
    for label, points in lines.items():
        points.sort()
        style = "--" if "data-parallel" in label else "-"
        ax.plot([c for c, _ in points], [100 * g for _, g in points], style, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Goodput vs chips ({title})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    results = simulate(config, run, with_sweep=not args.no_sweep)
    sim = config.simulate
    print(f"{sim.learners} learners x {sim.chips_per_learner:,} chips, per-chip MTBI {sim.chip_mtbi_hours:g} h, "
          f"{sim.horizon_hours:g} h simulated")
    print(format_comparison(results["strategies"]))
    print(f"\nresults in {run.root / 'simulate'}")
