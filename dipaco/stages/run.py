"""`dipaco run`: every stage in order — pretrain (with a warm start), route, shard, train (with the
baselines alongside, `eval.baselines_with_train`), baselines, eval, report.

    dipaco run --config configs/tiny.yaml --run runs/tiny
    dipaco run --config configs/tiny.yaml --run runs/tiny --restart-from shard sharding.val_fraction=0.2

Route and shard are skipped when done, but never when their artifacts were made with other config values
or inputs (`dipaco.pipeline.fingerprints`): that stops before anything is written, naming the keys, unless
`--restart-from STAGE` moves STAGE's and later stages' artifacts aside. The one stage that imports others.
"""

from __future__ import annotations

import argparse
import logging
import time

from dipaco.config import Config
from dipaco.pipeline.fingerprints import STAGE_ORDER, check, restart_from
from dipaco.run_dir import RunDir
from dipaco.stages import baselines, evaluate, pretrain, report, route, shard, train

log = logging.getLogger(__name__)


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    restart = getattr(args, "restart_from", None)
    kept = STAGE_ORDER[: STAGE_ORDER.index(restart)] if restart else STAGE_ORDER
    check(run, config, tuple(s for s in ("route", "shard", "train") if s in kept))
    if restart:
        restart_from(run, config, restart)
    if config.pretrain_steps and not (run.root / "pretrain" / "summary.json").exists():
        pretrain.command(config, run, args)
    if (run.routing / "assignments.json").exists():
        log.info("route: %s exists, skipping (run `dipaco route` to redo it)", run.routing)
    else:
        route.command(config, run, args)
    if (run.shards / "index.json").exists():
        log.info("shard: %s exists, skipping (run `dipaco shard` to redo it)", run.shards)
    else:
        shard.command(config, run, args)
    if config.eval.baselines and config.eval.baselines_with_train:
        # the longest baseline trains alongside the islands, the others after them (dipaco.stages.baselines)
        baselines.command(config, run, args, alongside=lambda: train.command_train(config, run, args))
    else:
        train.command_train(config, run, args)
        if config.eval.baselines:
            baselines.command(config, run, args)
    evaluate.command(config, run, args)
    report.command(config, run, args)
    print(f"whole pipeline: {time.perf_counter() - started:.0f}s; the report is {run.root / 'report.md'}")
