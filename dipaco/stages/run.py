"""`dipaco run`: every stage in order — pretrain (with a warm start), route, shard, train (with the
baselines alongside, `eval.baselines_with_train`; with `routing.router: learned`, its `dipaco reroute`
phases), baselines, eval, report.

    dipaco run --config configs/tiny.yaml --run runs/tiny
    dipaco run --config configs/tiny.yaml --run runs/tiny --restart-from shard sharding.val_fraction=0.2

Pretrain, route and shard are skipped when done, which only their record says (written after every
artifact, `fingerprints.completed`): a stage that was interrupted, even after writing its artifacts, is
redone, and so is every stage after it. A done stage's artifacts made with other config values or inputs
(`dipaco.pipeline.fingerprints`) stop the run before anything is written, naming the keys, unless
`--restart-from STAGE` moves STAGE's and later stages' artifacts aside. The one stage that imports others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

from dipaco.config import Config
from dipaco.pipeline.fingerprints import STAGE_ORDER, check, completed, restart_from
from dipaco.run_dir import RunDir
from dipaco.stages import baselines, evaluate, pretrain, report, reroute, route, shard, train

log = logging.getLogger(__name__)


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    restart = getattr(args, "restart_from", None)
    kept = STAGE_ORDER[: STAGE_ORDER.index(restart)] if restart else STAGE_ORDER
    redo = stages_to_redo(run, config, kept)
    check(run, config, tuple(s for s in ("route", "shard", "train") if s in kept and s not in redo))
    if restart:
        restart_from(run, config, restart)
    for stage, command in (("pretrain", pretrain.command), ("route", route.command), ("shard", shard.command)):
        if stage in redo:
            command(config, run, args)
        elif stage != "pretrain" or config.pretrain_steps:
            log.info("%s: done (its record is there), skipping (run `dipaco %s` to redo it)", stage, stage)
    if config.eval.baselines and config.eval.baselines_with_train:
        # the longest baseline trains alongside the islands, the others after them (dipaco.stages.baselines)
        baselines.command(config, run, args, alongside=lambda: train_and_reroute(config, run, args))
    else:
        train_and_reroute(config, run, args)
        if config.eval.baselines:
            baselines.command(config, run, args)
    evaluate.command(config, run, args)
    report.command(config, run, args)
    print(f"whole pipeline: {time.perf_counter() - started:.0f}s; the report is {run.root / 'report.md'}")


def train_and_reroute(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    """`dipaco train`; with `routing.router: learned`, `reroute.phases` discriminative phases (`dipaco reroute`):
    the first phases - 1 after rounds R k / phases (training goes on, on the new shards), the last after the
    last round, so that evaluation and the export route by the learned router. A phase in routing/phases.json
    after a round the store has already reached (a resumed run) is not done again."""
    phases = config.reroute.phases if config.routing.router == "learned" else 0
    done = _phases_done(config, run) if phases else set()
    for k in range(1, phases + 1):
        stop = config.run.rounds * k // phases
        if k < phases:
            train.command_train(dataclasses.replace(config, run=dataclasses.replace(config.run, stop_after_round=stop)),
                                run, args)
        else:
            train.command_train(config, run, args)
        if stop not in done:
            reroute.command(config, run, args)
    if not phases:
        train.command_train(config, run, args)


def _phases_done(config: Config, run: RunDir) -> set[int]:
    """The rounds after which routing/phases.json records a phase of this training: those up to the store's
    current round (a phase after a later round belongs to a training moved aside by `--restart-from`)."""
    from dipaco.pipeline.context import PathFactory
    from dipaco.store.module_store import StoreError

    phases_file = run.routing / "phases.json"
    if not phases_file.exists():
        return set()
    try:
        reached = PathFactory(config, run).store.current_round()
    except StoreError:  # not trained yet
        return set()
    return {p["after_round"] for p in json.loads(phases_file.read_text()) if p["after_round"] <= reached}


def stages_to_redo(run: RunDir, config: Config, kept: tuple[str, ...]) -> set[str]:
    """The stages before train that `dipaco run` runs: those not `completed` (or moved aside: not in `kept`),
    and every one after the first of them (its inputs are new)."""
    redo: set[str] = set()
    for stage in ("pretrain", "route", "shard"):
        if stage == "pretrain" and not config.pretrain_steps:
            continue
        if redo or stage not in kept or not completed(run, stage):
            if stage in kept and not redo and (run.root / _LAST_ARTIFACT[stage]).exists():
                log.warning("%s: %s is there, but not the record of a finished `dipaco %s` (it was interrupted); "
                            "redoing it", stage, _LAST_ARTIFACT[stage], stage)
            redo.add(stage)
    return redo


_LAST_ARTIFACT = {"pretrain": "pretrain/summary.json", "route": "routing/assignments.json", "shard": "shards/index.json"}
