"""The `dipaco` command: one subcommand per pipeline stage, and `run` for all of them.

    dipaco run    --config configs/tiny.yaml --run runs/tiny     # route, shard, train, baselines, eval
    dipaco route  --config configs/tiny.yaml --run runs/tiny routing.prefix_tokens=16
    dipaco island --config configs/tiny.yaml --run runs/tiny --path 3

Every subcommand takes `--config FILE` (YAML in configs/) and `--run DIR` (where artifacts go), and
any number of `section.key=value` overrides. `dipaco <subcommand> --help` explains each.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from dipaco.config import Config, load_config
from dipaco.run import RunDir

log = logging.getLogger("dipaco")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    parser.add_argument("--run", required=True, help="run directory where this stage reads and writes artifacts")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config fields")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dipaco", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands = {
        "run": "the whole pipeline: route, shard, train, baselines, eval (finished stages are skipped)",
        "route": "train the tokenizer, fit the router on document prefixes, assign documents to paths",
        "shard": "tokenize and pack each path's documents into checked zstd shards",
        "train": "run (or resume) the outer rounds with local island processes",
        "island": "train one path for one round, as an island does, and push its pseudo-gradient",
        "baselines": "train the dense baselines (equal steps, equal compute)",
        "baseline": "train one dense baseline (used by `baselines`)",
        "eval": "routed evaluation of the held-out documents against the dense baselines",
        "pretrain": "train the dense warm-start model (before routing; every module starts from it)",
        "reroute": "one discriminative re-routing phase: score the router split, fit the router, re-shard",
    }
    parsers = {}
    for name, help_text in commands.items():
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        _common(parsers[name])
    parsers["island"].add_argument("--path", type=int, action="append", required=True,
                                   help="a path this island trains (repeat for several)")
    parsers["island"].add_argument("--round", type=int, default=None,
                                   help="the round to train (default: the next one the store needs)")
    parsers["island"].add_argument("--follow", action="store_true",
                                   help="keep training these paths every round until the run ends")
    parsers["baseline"].add_argument("--name", required=True, help="dense-equal-steps or dense-equal-compute")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")
    from dipaco.launch import set_threads_from_env

    set_threads_from_env()
    try:
        config = load_config(args.config, args.overrides)
        run = RunDir(args.run)
        run.root.mkdir(parents=True, exist_ok=True)
        STAGES[args.command](config, run, args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        log.error("%s", err)
        return 1
    return 0


def cmd_route(config: Config, run: RunDir, args) -> None:
    from dipaco.pipeline import format_routing, route

    stats = route(config, run)
    print(format_routing(stats))


def cmd_shard(config: Config, run: RunDir, args) -> None:
    from dipaco.pipeline import format_shards, shard

    print(format_shards(shard(config, run)))


def cmd_train(config: Config, run: RunDir, args) -> None:
    from dipaco.coordinator import train

    summary = train(config, run)
    print(f"trained {summary['n_paths']} paths for {summary['rounds_completed']} rounds "
          f"({summary['inner_steps_per_path']} inner steps each, {summary['tokens']:,} tokens) "
          f"in {summary['seconds']:.0f}s; summary in {run.train_summary}")


def cmd_island(config: Config, run: RunDir, args) -> None:
    from dipaco.island import follow_rounds, run_island_task
    from dipaco.paths import PathFactory

    factory = PathFactory(config, run)
    if args.follow:
        tasks = follow_rounds(factory, paths=args.path)
        print(f"island for paths {args.path}: {tasks} tasks; the run has finished round {config.train.rounds}")
        return
    round = args.round if args.round is not None else factory.store.current_round() + 1
    if round > config.train.rounds:
        raise ValueError(f"the run has completed all {config.train.rounds} rounds (train.rounds); nothing to train")
    for path in args.path:
        meta = run_island_task(factory, path=path, round=round)
        print(json.dumps({k: v for k, v in meta.items() if k != "losses"}))


def cmd_baselines(config: Config, run: RunDir, args) -> None:
    from dipaco.baselines import train_baselines

    train_baselines(config, run)


def cmd_baseline(config: Config, run: RunDir, args) -> None:
    from dipaco.baselines import train_baseline

    summary = train_baseline(config, run, name=args.name)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}))


def cmd_eval(config: Config, run: RunDir, args) -> None:
    from dipaco.evaluate import evaluate, format_results

    results = evaluate(config, run)
    print(format_results(results))
    print(f"\nresults in {run.eval_results}")


def cmd_pretrain(config: Config, run: RunDir, args) -> None:
    from dipaco.pretrain import pretrain

    summary = pretrain(config, run)
    print(f"dense warm start: {summary['steps']} steps, {summary['tokens']:,} tokens, final train loss "
          f"{summary['final_train_loss']:.3f}, {summary['seconds']:.0f}s")


def cmd_reroute(config: Config, run: RunDir, args) -> None:
    from dipaco.reroute import format_phase, reroute

    print(format_phase(reroute(config, run)))


def cmd_run(config: Config, run: RunDir, args) -> None:
    started = time.perf_counter()
    if config.pretrain.steps and not (run.root / "pretrain" / "summary.json").exists():
        cmd_pretrain(config, run, args)
    if (run.routing / "assignments.json").exists():
        log.info("route: %s exists, skipping (run `dipaco route` to redo it)", run.routing)
    else:
        cmd_route(config, run, args)
    if (run.shards / "index.json").exists():
        log.info("shard: %s exists, skipping (run `dipaco shard` to redo it)", run.shards)
    else:
        cmd_shard(config, run, args)
    cmd_train(config, run, args)
    if config.eval.baselines:
        cmd_baselines(config, run, args)
    cmd_eval(config, run, args)
    print(f"whole pipeline: {time.perf_counter() - started:.0f}s")


STAGES = {
    "run": cmd_run,
    "route": cmd_route,
    "shard": cmd_shard,
    "train": cmd_train,
    "island": cmd_island,
    "baselines": cmd_baselines,
    "baseline": cmd_baseline,
    "eval": cmd_eval,
    "pretrain": cmd_pretrain,
    "reroute": cmd_reroute,
}

if __name__ == "__main__":
    sys.exit(main())
