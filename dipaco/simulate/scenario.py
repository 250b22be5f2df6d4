"""One `dipaco simulate` run: the four strategies side by side at the configured cluster, and the
goodput-vs-chips sweep (async rounds at each learner count, data parallel for reference)."""

from __future__ import annotations

import logging

from dipaco.simulate.data_parallel import simulate_data_parallel
from dipaco.simulate.diloco import simulate_rounds
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.settings import Settings
from dipaco.tables import format_table

log = logging.getLogger(__name__)

STRATEGIES = ("data-parallel", "elastic data-parallel", "sync rounds", "async rounds")


def failure_model(settings: Settings) -> FailureModel:
    sim = settings.sim
    return FailureModel(chip_mtbi_hours=sim.chip_mtbi_hours, speed_sigma=sim.speed_sigma, seed=sim.seed)


def run_strategy(settings: Settings, strategy: str) -> dict[str, float]:
    """Goodput and bytes of one strategy (each from the same seed)."""
    failures = failure_model(settings)
    if strategy == "data-parallel":
        ledger = simulate_data_parallel(settings, failures, elastic=False)
    elif strategy == "elastic data-parallel":
        ledger = simulate_data_parallel(settings, failures, elastic=True)
    elif strategy == "sync rounds":
        ledger = simulate_rounds(settings, failures, mode="sync")
    elif strategy == "async rounds":
        ledger = simulate_rounds(settings, failures, mode="async")
    else:
        raise ValueError(f"unknown strategy {strategy!r}; strategies are {list(STRATEGIES)}")
    return ledger.summary()


def compare(settings: Settings) -> dict[str, dict[str, float]]:
    results = {}
    for strategy in STRATEGIES:
        results[strategy] = run_strategy(settings, strategy)
        log.info("%s: goodput %.3f", strategy, results[strategy]["goodput"])
    return results


def sweep(settings: Settings) -> list[dict]:
    """Goodput at each total chip count of `simulate.sweep_chips`: async rounds with each learner count
    of `simulate.sweep_learners` (chips split evenly), and both data-parallel strategies."""
    rows = []
    for chips in settings.sim.sweep_chips:
        for learners in settings.sim.sweep_learners:
            at = settings.with_(learners=learners, chips_per_learner=max(1, chips // learners))
            rows.append({"strategy": "async rounds", "learners": learners, "chips": at.total_chips,
                         "goodput": run_strategy(at, "async rounds")["goodput"]})
        at = settings.with_(learners=1, chips_per_learner=chips)
        for strategy in ("data-parallel", "elastic data-parallel"):
            rows.append({"strategy": strategy, "learners": 1, "chips": chips,
                         "goodput": run_strategy(at, strategy)["goodput"]})
        log.info("sweep: %d chips done", chips)
    return rows


def format_comparison(results: dict[str, dict[str, float]]) -> str:
    rows = [[name, f"{r['goodput']:.1%}", f"{r['goodput_by_time']:.1%}",
             f"{r['lost_chip_seconds'] / r['allocated_chip_seconds']:.1%}",
             f"{r['idle_chip_seconds'] / r['allocated_chip_seconds']:.1%}",
             f"{r['bytes_per_link_per_training_second'] * 8 / 1e9:.3g}"]
            for name, r in results.items()]
    return format_table(["strategy", "goodput (by work)", "by time", "lost", "idle", "Gbit/s per link while training"], rows)
