"""Runs of the dipaco pipeline for the quality benchmark (`bench_quality.py`) and the experiments built on it
(`experiments/recipe_search.py`, `experiments/capacity.py`).

    runner = Runner(Path("runs/bench-quality"))
    run = runner.pipeline("dipaco", ROOT / "configs/demo.yaml", ["run.rounds=4"], baselines=True,
                          modes=["prefix", "oracle"])
    eval_json = read_eval(run)

Each run calls the `dipaco` stages in a subprocess (pretrain, route, shard, train, baselines, eval;
no report). Runs that would compute the same thing share it instead: a run starts with a copy of an
earlier run's tokenizer (same corpus and vocabulary, so every model scores the same test tokens),
its dense warm start (same corpus, model, inner recipe and warm-start steps) and its routing and
shards (same routing inputs and grid). What counts as "the same" is the resolved config
(`dipaco.config.load_config`), so an override that changes any input makes its own copy.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dipaco.config import Config, load_config  # noqa: E402
from dipaco.optim.outer_history import describe_rows  # noqa: E402
from dipaco.outputs import mark_run_dir  # noqa: E402

log = logging.getLogger("quality_runs")


def dipaco(*args: str, log_file: Path | None = None) -> None:
    """`python -m dipaco ARGS` from the repository root, offline; output to `log_file` when given."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log.info("$ dipaco %s", " ".join(args))
    if log_file is None:
        subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=env, check=True)
        return
    with open(log_file, "a") as out:
        result = subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    if result.returncode:
        raise RuntimeError(f"dipaco {args[0]} failed (exit {result.returncode}); see {log_file}")


def _key(config: Config, *sections: str, extra: tuple = ()) -> str:
    d = config.to_dict()
    return json.dumps([d[s] for s in sections] + list(extra), sort_keys=True)


def warm_start_steps_as_fraction(config_file: Path, overrides: list[str]) -> list[str]:
    """`overrides` with a warm start given in steps (`warm_start.steps=N`, the last one wins) written as the
    `warm_start.fraction` that gives exactly N steps with the other overrides' grid, rounds and H."""
    steps = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("warm_start.steps=")]
    rest = [o for o in overrides if not o.startswith("warm_start.steps=")]
    if not steps:
        return rest
    if steps[-1] == 0:
        return [*rest, "warm_start.fraction=0"]
    path_steps = load_config(config_file, [*rest, "warm_start.fraction=0.5"]).pretrain_steps  # f = 0.5: as many
    return [*rest, f"warm_start.fraction={steps[-1] / (steps[-1] + path_steps)!r}"]


def tokenizer_key(config: Config) -> str:
    return _key(config, "corpus", extra=(config.sharding.vocab_size, config.sharding.tokenizer))


def pretrain_key(config: Config) -> str:
    """What the warm start depends on: its steps, not the fraction of the run that makes them (grids differ)."""
    return _key(config, "corpus", "sharding", "model", "inner", extra=(config.run.seed, config.pretrain_steps))


def routing_key(config: Config) -> str:
    base = pretrain_key(config) if config.routing.featurizer == "base-model" else ""
    topology = (config.topology.levels, config.topology.replicas)
    return _key(config, "corpus", "routing", "sharding", extra=(topology, base))


class Runner:
    """Pipelines under one folder, sharing tokenizer, warm start and routing where they coincide."""

    def __init__(self, root: Path, *, keep: bool = False):
        self.root = root
        if root.exists() and not keep:
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        self.donors: dict[tuple[str, str], Path] = {}

    def _adopt(self, run: Path, what: str, key: str, parts: list[str]) -> None:
        donor = self.donors.get((what, key))
        if donor is not None and donor != run:
            for part in parts:
                if (donor / part).exists() and not (run / part).exists():
                    shutil.copytree(donor / part, run / part)
        else:
            self.donors[(what, key)] = run

    def pipeline(self, name: str, config_file: Path, overrides: list[str], *, baselines: bool,
                 modes: list[str], reroute_after: tuple[int, ...] = ()) -> Path:
        """Run every stage of one pipeline into `<root>/<name>` (finished stages are not redone).

        `reroute_after`: module versions after which `dipaco reroute` runs one discriminative phase
        (needs `corpus.router_fraction` > 0). A version before the last round re-shards and training
        goes on (DiPaCo §2.4.2's hard EM); the last round (`run.rounds`) only re-fits the router
        that evaluation routes by, and the evaluation by the router before it is kept as
        `eval-before-reroute.json`. The dense baselines train before any phase, on the first shards."""
        overrides = [*overrides, f"eval.baselines={str(baselines).lower()}", f"eval.modes=[{','.join(modes)}]"]
        config = load_config(config_file, overrides)
        run = self.root / name
        mark_run_dir(run)  # a dipaco run folder before bench.log lands in it (dipaco refuses unmarked non-empty ones)
        self._adopt(run, "tokenizer", tokenizer_key(config), ["tokenizer"])
        if config.pretrain_steps:
            self._adopt(run, "pretrain", pretrain_key(config), ["pretrain"])
        self._adopt(run, "routing", routing_key(config), ["routing", "shards"])
        args = ["--config", str(config_file), "--run", str(run), *overrides]
        log_file = run / "bench.log"
        started = time.perf_counter()
        if config.pretrain_steps and not (run / "pretrain" / "summary.json").exists():
            dipaco("pretrain", *args, log_file=log_file)
        if not (run / "routing" / "assignments.json").exists():
            dipaco("route", *args, log_file=log_file)
        if not (run / "shards" / "index.json").exists():
            dipaco("shard", *args, log_file=log_file)
        rounds = config.run.rounds
        if any(not 0 < r <= rounds for r in reroute_after):
            raise ValueError(f"reroute_after {reroute_after} must be module versions in [1, {rounds}]")
        if reroute_after and config.corpus.router_fraction <= 0:
            raise ValueError("reroute_after needs corpus.router_fraction > 0 (the documents the phases score)")
        if baselines:  # before any phase, so that they train on the same shards as a run without one
            dipaco("baselines", *args, log_file=log_file)
        for r in sorted(r for r in reroute_after if r < rounds):
            if r not in rerouted_after(run):
                if trained_rounds(run) < r:
                    dipaco("train", *args, f"run.stop_after_round={r}", log_file=log_file)
                dipaco("reroute", *args, log_file=log_file)
        if trained_rounds(run) < rounds:
            dipaco("train", *args, log_file=log_file)
        if rounds in reroute_after and rounds not in rerouted_after(run):
            if not (run / "eval-before-reroute.json").exists():
                if not (run / "eval.json").exists():
                    dipaco("eval", *args, log_file=log_file)
                (run / "eval.json").rename(run / "eval-before-reroute.json")
            dipaco("reroute", *args, log_file=log_file)
        if not (run / "eval.json").exists():
            dipaco("eval", *args, log_file=log_file)
        log.info("%s: %.0fs", name, time.perf_counter() - started)
        return run


def trained_rounds(run: Path) -> int:
    """Rounds `dipaco train` has committed in `run` (0 before it started)."""
    return len(read_json(run / "train.json").get("rounds", []))


def rerouted_after(run: Path) -> set[int]:
    """The module versions after which `dipaco reroute` phases ran in `run`."""
    path = run / "routing" / "phases.json"
    return {p["after_round"] for p in json.loads(path.read_text())} if path.exists() else set()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def outer_steps(run: Path) -> str:
    """The outer step each span of a run's rounds took, as applied (train.json's rows)."""
    rows = read_json(run / "train.json").get("rounds")
    return describe_rows(rows, file=str(run / "train.json")) if rows else "not recorded (no train.json rows)"


def pretrain_summary(run: Path) -> dict:
    """The warm start's summary (steps, tokens) of a run, {} without one."""
    return read_json(run / "pretrain" / "summary.json")


def mode_perplexity(eval_json: dict, mode: str, checkpoints: str = "last") -> float | None:
    for row in eval_json.get("modes", {}).get("rows", []):
        if row["mode"] == mode and row["checkpoints"] == checkpoints:
            return row["perplexity"]
    return None
