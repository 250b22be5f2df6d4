"""The rows of bench/bench_compression.py (bench/results/wire.{json,md}): each variant's measured bytes per
applied result (path-round), its ratios against float32 DiLoCo and data parallel, and its perplexity against
float32 DiLoCo with the same inner optimizer and outer decay, from the finished runs' train.json, eval.json and
config.yaml (no training here).

    b = wire(Path("runs/bench-wire/seed0-float32"))        # one run's bytes and ratios
    results = collect({"float32": {0: run0}}, chosen=[], overrides={"float32": [...]})

Training traffic (the issue's definition): an island's pseudo-gradients up + module updates down + manifests
and checksums read. Full module reads (an island's joining read and its counted fallbacks, kind `module`) are
not training traffic; they are in everything, as are inner-state checkpoints, board reads and heartbeats.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.quality_runs import mode_perplexity, read_json
from dipaco.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TRAINING = (("up", "pseudo_gradient"), ("down", "module_update"), ("down", "manifests"))
BASELINES = {("adamw", "average"): "float32", ("muon", "average"): "float32, Muon",
             ("adamw", "keep"): "float32, decay keep", ("muon", "keep"): "float32, Muon, decay keep"}


def baseline_of(inner_optimizer: str, outer_decay: str) -> str:
    """The float32 DiLoCo variant a row's perplexity is compared with: the same inner optimizer and outer decay."""
    return BASELINES[(inner_optimizer, outer_decay)]


def wire(run: Path) -> dict:
    """The bytes the islands of `run` measured at the store (train.json's `traffic`, by direction and kind),
    per applied result (path-round), and the ratios (module docstring): `ratio_training_traffic` = float32
    DiLoCo's 2 x the path's float32 bytes over the training traffic, `ratio_everything` over every island byte
    but the published inputs, `ratio_vs_data_parallel` = data parallel's bytes, both ways, over everything."""
    train = read_json(run / "train.json")
    islands = train["traffic"]["by_role"]["island"]
    results = train["results_applied"]

    def measured(direction: str, kind: str) -> int:
        return islands.get(direction, {}).get(kind, {}).get("bytes", 0)

    training = sum(measured(d, k) for d, k in TRAINING)
    everything = sum(cell["bytes"] for d in ("up", "down") for k, cell in islands.get(d, {}).items() if k != "inputs")
    float32 = 2 * train["bytes_float32"]  # the same results' float32 pseudo-gradients up and updates down
    data_parallel = 2 * train["bytes_data_parallel"]  # train.json's is each way
    return {"per_result": {f"{d}_{k}": cell["bytes"] / results for d in ("up", "down")
                           for k, cell in islands.get(d, {}).items()},
            "training_traffic_per_result": training / results, "everything_per_result": everything / results,
            "float32_per_result": float32 / results, "results": results,
            "ratio_training_traffic": float32 / training, "ratio_everything": float32 / everything,
            "ratio_vs_data_parallel": data_parallel / everything if data_parallel else None,
            "data_parallel_workers": train["data_parallel_workers"], "rounds": train["rounds_completed"],
            "module_fallbacks": train.get("module_fallbacks"), "train_seconds": train.get("seconds", 0.0)}


def run_setting(run: Path) -> dict:
    """What a row is compared by, from the run's resolved config.yaml."""
    config = load_config(run / "config.yaml")
    return {"inner_optimizer": config.inner.optimizer, "outer_decay": config.outer.decay,
            "inner_checkpoint_every": config.resilience.inner_checkpoint_every, "configured_rounds": config.run.rounds}


def seed_figures(run: Path) -> dict:
    evaluation = read_json(run / "eval.json")
    return {"perplexity": mode_perplexity(evaluation, "prefix"), "bytes": wire(run),
            "scored_tokens": evaluation["scored_tokens"],
            "run": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run)}


def mean_of(per_seed: dict, key: str) -> float | None:
    values = [b["bytes"][key] for b in per_seed.values() if b["bytes"][key] is not None]
    return statistics.fmean(values) if values else None


def row_of(variant: str, by_seed: dict[int, Path], overrides: list[str]) -> dict:
    """One variant's row before its comparison with float32 (`compare`): setting, bytes and ratios (mean
    over its seeds; each seed's in `per_seed`)."""
    per_seed = {seed: seed_figures(run) for seed, run in sorted(by_seed.items())}
    kinds = sorted({k for s in per_seed.values() for k in s["bytes"]["per_result"]})
    fallbacks = [s["bytes"]["module_fallbacks"] for s in per_seed.values()]
    return {"variant": variant, "overrides": overrides, **run_setting(next(iter(by_seed.values()))),
            "rounds": min(s["bytes"]["rounds"] for s in per_seed.values()),
            "bytes_per_result": {k: statistics.fmean(s["bytes"]["per_result"].get(k, 0) for s in per_seed.values())
                                 for k in kinds},
            "module_fallbacks": None if None in fallbacks else sum(fallbacks),
            **{k: mean_of(per_seed, k) for k in ("training_traffic_per_result", "everything_per_result",
                                                 "float32_per_result", "ratio_training_traffic",
                                                 "ratio_everything", "ratio_vs_data_parallel")},
            "per_seed": per_seed}


def compare(row: dict, float32: dict | None) -> None:
    """`row`'s perplexity against its float32 baseline's on the seeds both have, in place: the mean over those
    seeds and each seed's, in percent (None without a baseline)."""
    seeds = [s for s in row["per_seed"] if float32 is not None and s in float32["per_seed"]]
    ppl = {s: row["per_seed"][s]["perplexity"] for s in row["per_seed"]}
    row["seeds"] = sorted(row["per_seed"])
    row["perplexity"] = statistics.fmean(ppl.values())
    row["perplexity_by_seed"] = ppl
    row["baseline"] = float32["variant"] if float32 is not None else None
    row["baseline_seeds"] = seeds
    if not seeds:
        row["perplexity_vs_float32_pct"], row["perplexity_vs_float32_pct_by_seed"] = None, {}
        return
    base = {s: float32["per_seed"][s]["perplexity"] for s in seeds}
    row["perplexity_vs_float32_pct"] = 100 * (statistics.fmean(ppl[s] for s in seeds)
                                              / statistics.fmean(base.values()) - 1)
    row["perplexity_vs_float32_pct_by_seed"] = {s: 100 * (ppl[s] / base[s] - 1) for s in seeds}


def collect(runs: dict[str, dict[int, Path]], *, chosen: list[str], overrides: dict[str, list[str]]) -> dict:
    """Every variant's row, compared with the float32 DiLoCo of its inner optimizer and outer decay."""
    rows = [row_of(name, by_seed, overrides[name]) for name, by_seed in runs.items()]
    by_name = {r["variant"]: r for r in rows}
    for row in rows:
        compare(row, by_name.get(baseline_of(row["inner_optimizer"], row["outer_decay"])))
    return {"rows": rows, "chosen": chosen,
            "train_seconds": sum(s["bytes"]["train_seconds"] for r in rows for s in r["per_seed"].values())}


def choose(rows: list[dict], *, first: int, min_ratio: float) -> list[str]:
    """The lowest-perplexity variant whose `ratio_training_traffic` is at least `min_ratio` at seed `first`
    ([] when none has)."""
    candidates = [(r["per_seed"][first]["perplexity"], r["variant"]) for r in rows
                  if first in r["per_seed"] and r["per_seed"][first]["bytes"]["ratio_training_traffic"] >= min_ratio]
    return [min(candidates)[1]] if candidates else []
