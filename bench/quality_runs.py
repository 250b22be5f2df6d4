"""Runs of the dipaco pipeline for the quality benchmarks (`bench_quality.py`, `bench_recipe_search.py`).

    runner = Runner(Path("runs/bench-quality"))
    run = runner.pipeline("dipaco", ROOT / "configs/demo.yaml", ["train.rounds=4"], baselines=True,
                          modes=["prefix", "oracle"])
    eval_json = read_eval(run)

Each run calls the `dipaco` stages in a subprocess (pretrain, route, shard, train, baselines, eval;
no report). Runs that would compute the same thing share it instead: a run starts with a copy of an
earlier run's tokenizer (same corpus and vocabulary, so every model scores the same test tokens),
its dense warm start (same corpus, model, inner recipe and `pretrain.steps`) and its routing and
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


def tokenizer_key(config: Config) -> str:
    return _key(config, "corpus", extra=(config.sharding.vocab_size, config.sharding.tokenizer))


def pretrain_key(config: Config) -> str:
    return _key(config, "corpus", "sharding", "model", "inner", "pretrain", extra=(config.train.seed,))


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
                 modes: list[str]) -> Path:
        """Run every stage of one pipeline into `<root>/<name>` (finished stages are not redone)."""
        overrides = [*overrides, f"eval.baselines={str(baselines).lower()}", f"eval.modes=[{','.join(modes)}]"]
        config = load_config(config_file, overrides)
        run = self.root / name
        mark_run_dir(run)  # a dipaco run folder before bench.log lands in it (dipaco refuses unmarked non-empty ones)
        self._adopt(run, "tokenizer", tokenizer_key(config), ["tokenizer"])
        if config.pretrain.steps:
            self._adopt(run, "pretrain", pretrain_key(config), ["pretrain"])
        self._adopt(run, "routing", routing_key(config), ["routing", "shards"])
        args = ["--config", str(config_file), "--run", str(run), *overrides]
        log_file = run / "bench.log"
        started = time.perf_counter()
        if config.pretrain.steps and not (run / "pretrain" / "summary.json").exists():
            dipaco("pretrain", *args, log_file=log_file)
        if not (run / "routing" / "assignments.json").exists():
            dipaco("route", *args, log_file=log_file)
        if not (run / "shards" / "index.json").exists():
            dipaco("shard", *args, log_file=log_file)
        if not (run / "train.json").exists():
            dipaco("train", *args, log_file=log_file)
        if baselines:
            dipaco("baselines", *args, log_file=log_file)
        if not (run / "eval.json").exists():
            dipaco("eval", *args, log_file=log_file)
        log.info("%s: %.0fs", name, time.perf_counter() - started)
        return run


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def pretrain_summary(run: Path) -> dict:
    """The warm start's summary (steps, tokens) of a run, {} without one."""
    return read_json(run / "pretrain" / "summary.json")


def mode_perplexity(eval_json: dict, mode: str, checkpoints: str = "last") -> float | None:
    for row in eval_json.get("modes", {}).get("rows", []):
        if row["mode"] == mode and row["checkpoints"] == checkpoints:
            return row["perplexity"]
    return None
