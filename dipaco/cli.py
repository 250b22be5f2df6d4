"""The `dipaco` command: one subcommand per pipeline stage, and `run` for all of them.

    dipaco run    --config configs/tiny.yaml --run runs/tiny     # route, shard, train, baselines, eval, report
    dipaco route  --config configs/tiny.yaml --run runs/tiny routing.prefix_tokens=16
    dipaco island --config configs/tiny.yaml --run runs/tiny --path 3
    dipaco coordinator --config configs/tiny.yaml --run runs/tiny  # + `dipaco island ...` on other machines
    dipaco simulate --run runs/sim simulate.learners=16             # chaos simulation, no training
    dipaco status --run runs/tiny --watch 5                         # the live board of a running run

Every subcommand takes `--config FILE` (YAML in configs/) and `--run DIR` (where artifacts go), and
any number of `section.key=value` overrides. `dipaco <subcommand> --help` explains each.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from dipaco.config import Config, load_config
from dipaco.pipeline.fingerprints import STAGE_ORDER
from dipaco.run_dir import RunDir

log = logging.getLogger("dipaco")


def _common(parser: argparse.ArgumentParser, *, store_only: bool = False) -> None:
    parser.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    if store_only:  # island, coordinator: a run published in a store is enough
        parser.add_argument("--store", default=None, metavar="URL",
                            help="run from the run published in this store alone (its config, tokenizer and shards; "
                                 "docs/islands.md#store-only-islands); --run is then this machine's working directory")
        parser.add_argument("--run", default=None, help="run directory where this stage reads and writes artifacts "
                                                        "(with --store: default <store.cache_dir>/runs/<URL digest>)")
    else:
        parser.add_argument("--run", required=True, help="run directory where this stage reads and writes artifacts")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config fields")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _status_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default=None, help="run directory (its store: store.url, else RUN/store)")
    parser.add_argument("--store", default=None, help="the store's URL, read alone (e.g. s3://bucket/dipaco/demo)")
    parser.add_argument("--config", default=None, help="the run's config (default: RUN/config.yaml when there is one)")
    parser.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                        help="redraw every SECONDS until the run finishes (Ctrl-C stops)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per refresh")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dipaco", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands = {
        "run": "the whole pipeline: route, shard, train, baselines, eval, report (done stages are skipped; made with other settings: refused, see --restart-from)",
        "route": "train the tokenizer, fit the router on document prefixes, assign documents to paths",
        "shard": "tokenize and pack each path's documents into checked zstd shards",
        "train": "run (or resume) the outer rounds with local island processes",
        "island": "a pull-based island worker (or, with --path and no --pull, one path for one round)",
        "coordinator": "the round loop alone: task board, outer steps, module versions (islands run elsewhere)",
        "baselines": "train the dense baselines (equal steps, equal compute)",
        "baseline": "train one dense baseline (used by `baselines`)",
        "eval": "routed evaluation of the held-out documents against the dense baselines",
        "export": "write a path (or --all paths and the router) as Hugging Face model directories",
        "generate": "route a prompt to a path and generate a continuation with it",
        "report": "write report.md with plots into the run directory",
        "pretrain": "train the dense warm-start model (before routing; every module starts from it)",
        "reroute": "one discriminative re-routing phase: score the router split, fit the router, re-shard",
        "simulate": "chaos simulation at paper scale: goodput of data parallel, elastic, sync and async rounds",
        "status": "the live board of a run: rounds, islands and their tasks, queue, goodput, bytes, per-path losses",
    }
    parsers = {}
    for name, help_text in commands.items():
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name == "status":  # reads a run's store, writes nothing: --run or --store
            _status_options(parsers[name])
            continue
        if name == "export":
            parsers[name].add_argument("out", help="output directory: new, empty, or an earlier export (--overwrite)")
            parsers[name].add_argument("--overwrite", action="store_true",
                                       help="replace an earlier dipaco export in OUT (never anything else)")
        if name == "generate":
            parsers[name].add_argument("prompt", help="the text to continue")
        _common(parsers[name], store_only=name in STORE_ONLY_STAGES)
    for name in ("export", "generate"):
        parsers[name].add_argument("--round", type=int, default=None, help="module version (default: the last)")
        parsers[name].add_argument("--best", action="store_true", help="each path at its best round (validation loss)")
    which = parsers["export"].add_mutually_exclusive_group(required=True)
    which.add_argument("--path", type=int, help="the path to export")
    which.add_argument("--all", action="store_true", help="every path, plus the router and the tokenizer")
    parsers["generate"].add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parsers["generate"].add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parsers["generate"].add_argument("--seed", type=int, default=0, help="sampling seed")
    parsers["generate"].add_argument("--route", default="router", choices=["router", "likelihood"],
                                     help="pick the path by the run's router (default) or by the paths' own "
                                          "likelihood of the prompt's routing prefix (the `likelihood` eval mode)")
    for name in ("run", "train", "coordinator"):
        parsers[name].add_argument("--force", action="store_true",
                                   help="take over the store's coordinator lease even if another coordinator seems to "
                                        "hold it (only when you know it is gone: docs/islands.md#crash-safety)")
    parsers["island"].add_argument("--path", type=int, action="append", default=None,
                                   help="a path this island trains (repeat for several); with --pull: pin to it")
    parsers["island"].add_argument("--pull", action="store_true",
                                   help="pull tasks from the coordinator (the default when no --path is given)")
    parsers["island"].add_argument("--name", default=None, help="island name (default: host-pid)")
    parsers["island"].add_argument("--fail-mtbf", type=float, default=None,
                                   help="inject failures with this mean time between failures in seconds (faults.mtbf)")
    parsers["island"].add_argument("--return-after", type=float, default=None,
                                   help="a failed island comes back after this many seconds (faults.return_after)")
    parsers["island"].add_argument("--slowdown", type=float, default=None,
                                   help="inject a straggler: every inner step takes this many times longer (faults.slowdown)")
    parsers["island"].add_argument("--max-tasks", type=int, default=None, help="stop after this many tasks")
    parsers["eval"].add_argument("--mode", action="append", default=None,
                                 help="prefix | every:W | oracle | all-paths (repeat; default eval.modes)")
    parsers["eval"].add_argument("--best", action="store_true", default=None,
                                 help="also evaluate each path at its round with the lowest validation loss")
    parsers["simulate"].add_argument("--no-sweep", action="store_true",
                                     help="only the four strategies at the configured cluster, not the goodput-vs-chips sweep")
    parsers["run"].add_argument("--restart-from", choices=STAGE_ORDER, default=None, metavar="STAGE",
                                help="redo STAGE and every later one (" + ", ".join(STAGE_ORDER) + "): their old "
                                     "artifacts are moved to RUN/superseded/<time>/; for a run whose config changed")
    parsers["baseline"].add_argument("--name", required=True, help="dense-equal-steps, dense-equal-compute or dense-large")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")
    from dipaco.islands.processes import exit_with_parent, set_threads_from_env

    set_threads_from_env()
    exit_with_parent()
    previous = stop_on_signals()
    try:
        if args.command == "status":  # no run directory to prepare: it only reads
            cmd_status(args)
            return 0
        config, run = _config_and_run(args)
        prepare_run_dir(run, args.command)
        STAGES[args.command](config, run, args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        log.error("%s", err)
        return 1
    except OSError as err:  # a filesystem refusal the checks above did not foresee: name it, no traceback
        log.error("%s: %s", type(err).__name__, err)
        return 1
    except KeyboardInterrupt as stop:
        log.error("%s; run the same command again to resume", stop.args[0] if stop.args else "interrupted (SIGINT)")
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _config_and_run(args) -> tuple[Config, RunDir]:
    """The config and run directory a command works with: `--store URL` fetches the run published there
    (`dipaco.pipeline.published`), else `--config` (or the run's own resolved config) and `--run`."""
    if getattr(args, "store", None):
        if args.config:
            raise ValueError("--store URL runs with the config published in the store; give overrides "
                             "(section.key=value) instead of --config")
        from dipaco.pipeline.published import PUBLICATION_WAIT, fetch_run

        return fetch_run(args.store, run_root=Path(args.run) if args.run else None, overrides=args.overrides,
                         wait=PUBLICATION_WAIT if args.command == "island" else 0.0)  # islands may start first
    if args.run is None:
        raise ValueError(f"dipaco {args.command}: give --run DIR (or --store URL for a run published in a store)")
    config_file = args.config
    if config_file is None and args.command in RUN_CONFIG_STAGES and (Path(args.run) / "config.yaml").exists():
        config_file = Path(args.run) / "config.yaml"  # the run's own resolved config
    return load_config(config_file, args.overrides), RunDir(args.run)


def stop_on_signals():
    """SIGTERM ends a command as Ctrl-C does: an exception, so every `finally` runs (the train stage stops
    its island processes; `dipaco.islands.processes`). Committed rounds stay; the same command resumes."""
    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be set from the main thread (tests call main() from others)

    def stop(signum, frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    return signal.signal(signal.SIGTERM, stop)  # the handler it replaces, restored when main() returns


READ_ONLY_STAGES = ("export", "generate")  # read the run, write elsewhere (or nowhere)


def prepare_run_dir(run: RunDir, command: str) -> None:
    """Before any work: refuse a `--run` that is not a run directory (`dipaco.outputs`); stages that read a
    finished run need it to exist, and stages that write into it need it writable."""
    from dipaco.outputs import check_run_dir, check_writable, mark_run_dir

    check_run_dir(run.root)
    if command in RUN_CONFIG_STAGES:  # eval, export, generate, report: a run made by earlier stages
        run.require(run.root, "run")
    if command in READ_ONLY_STAGES:
        return
    run.root.mkdir(parents=True, exist_ok=True)
    check_writable(run.root)
    mark_run_dir(run.root)


def cmd_route(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.route import format_routing, route

    stats = route(config, run)
    print(format_routing(stats))


def cmd_shard(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.shard import format_shards, shard

    print(format_shards(shard(config, run)))


def cmd_train(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.train import train

    summary = train(config, run, force=args.force)
    print(f"trained {summary['n_paths']} paths for {summary['rounds_completed']} rounds "
          f"({summary['inner_steps_per_path']} inner steps each, {summary['tokens']:,} tokens) "
          f"in {summary['seconds']:.0f}s; summary in {run.train_summary}")


def cmd_coordinator(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.train import train

    summary = train(config, run, local_islands=False, force=args.force)
    print(f"coordinated {summary['rounds_completed']} rounds of {summary['n_paths']} paths "
          f"({summary['tokens']:,} tokens) in {summary['seconds']:.0f}s; summary in {run.train_summary}")


def cmd_island(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.island import island

    island(config, run, pull=args.pull or not args.path, paths=args.path, name=args.name, fail_mtbf=args.fail_mtbf,
           return_after=args.return_after, max_tasks=args.max_tasks, slowdown=args.slowdown)


def cmd_baselines(config: Config, run: RunDir, args, *, alongside=None) -> None:
    """`alongside` (`dipaco run`): a stage to run while the longest baseline trains (`dipaco.stages.baselines`)."""
    from dipaco.stages.baselines import train_baselines

    train_baselines(config, run, alongside=alongside)


def cmd_baseline(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.baselines import train_baseline

    summary = train_baseline(config, run, name=args.name)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}))


def cmd_eval(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.evaluate import evaluate, format_results

    results = evaluate(config, run, modes=getattr(args, "mode", None), best=getattr(args, "best", None))
    print(format_results(results))
    print(f"\nresults in {run.eval_results}")


def cmd_pretrain(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.pretrain import pretrain

    summary = pretrain(config, run)
    print(f"dense warm start: {summary['steps']} steps, {summary['tokens']:,} tokens, final train loss "
          f"{summary['final_train_loss']:.3f}, {summary['seconds']:.0f}s")


def cmd_reroute(config: Config, run: RunDir, args) -> None:
    """One re-routing phase, then the shards rewritten for the new assignments."""
    from dipaco.stages.reroute import format_phase, reroute
    from dipaco.stages.shard import shard

    record = reroute(config, run)
    try:
        shard(config, run)
    except ValueError as err:
        raise ValueError(f"{err}\n(re-routing phase {record['phase']} is recorded in {run.routing / 'phases.json'}; "
                         f"`dipaco shard --run {run.root}` writes the shards of its routing)") from err
    from dipaco.pipeline.fingerprints import accept_new_shards

    accept_new_shards(run)  # training goes on from the current modules on the new shards, on purpose
    print(format_phase(record))


def cmd_run(config: Config, run: RunDir, args) -> None:
    """Every stage in order; route and shard are skipped when done, but never when their artifacts were made
    with other config values or inputs (`dipaco.pipeline.fingerprints`): that stops before anything is written,
    naming the keys, unless `--restart-from STAGE` moves STAGE's and later stages' artifacts aside."""
    from dipaco.pipeline.fingerprints import check, restart_from

    started = time.perf_counter()
    restart = getattr(args, "restart_from", None)
    kept = STAGE_ORDER[: STAGE_ORDER.index(restart)] if restart else STAGE_ORDER
    check(run, config, tuple(s for s in ("route", "shard", "train") if s in kept))
    if restart:
        restart_from(run, config, restart)
    if config.pretrain_steps and not (run.root / "pretrain" / "summary.json").exists():
        cmd_pretrain(config, run, args)
    if (run.routing / "assignments.json").exists():
        log.info("route: %s exists, skipping (run `dipaco route` to redo it)", run.routing)
    else:
        cmd_route(config, run, args)
    if (run.shards / "index.json").exists():
        log.info("shard: %s exists, skipping (run `dipaco shard` to redo it)", run.shards)
    else:
        cmd_shard(config, run, args)
    if config.eval.baselines and config.eval.baselines_with_train:
        # the longest baseline trains alongside the islands, the others after them (dipaco.stages.baselines)
        cmd_baselines(config, run, args, alongside=lambda: cmd_train(config, run, args))
    else:
        cmd_train(config, run, args)
        if config.eval.baselines:
            cmd_baselines(config, run, args)
    cmd_eval(config, run, args)
    cmd_report(config, run, args)
    print(f"whole pipeline: {time.perf_counter() - started:.0f}s; the report is {run.root / 'report.md'}")


def _rounds(factory, args) -> dict[int, int]:
    """The module version of each path that `--round` / `--best` ask for."""
    if getattr(args, "best", False):
        from dipaco.device import resolve_device
        from dipaco.eval.early_stopping import best_of_run

        return best_of_run(factory.store, factory.topology, factory.spec, factory.validation,
                           device=resolve_device(factory.config.hardware.device))[0]
    last = factory.store.current_round()
    round = last if args.round is None else args.round
    if not 0 <= round <= last:
        raise ValueError(f"--round {round} is outside the store's rounds 0..{last}")
    return {p: round for p in range(factory.topology.n_paths)}


def cmd_export(config: Config, run: RunDir, args) -> None:
    from dipaco.pipeline.context import PathFactory
    from dipaco.stages.export import export_all, export_path

    factory = PathFactory(config, run)
    rounds = _rounds(factory, args)
    if args.all:
        out = export_all(factory, rounds=rounds, out=args.out, overwrite=args.overwrite)
        print(f"exported {factory.topology.n_paths} paths, the router and the tokenizer to {out}")
        return
    if not 0 <= args.path < factory.topology.n_paths:
        raise ValueError(f"--path {args.path} is outside 0..{factory.topology.n_paths - 1}")
    out = export_path(factory, path=args.path, round=rounds[args.path], out=args.out, overwrite=args.overwrite)
    print(f"exported path {args.path} (round {rounds[args.path]}) to {out}; "
          f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")


def cmd_generate(config: Config, run: RunDir, args) -> None:
    from dipaco.pipeline.context import PathFactory
    from dipaco.stages.generate import check_options, generate

    check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, route=args.route)
    factory = PathFactory(config, run)
    rounds = _rounds(factory, args)
    text, path = generate(factory, args.prompt, rounds=rounds, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, route=args.route)
    print(f"[path {path} {factory.topology.path_label(path)}, round {rounds[path]}]")
    print(text)


def cmd_report(config: Config, run: RunDir, args) -> None:
    from dipaco.stages.report import write_report

    path = write_report(config, run)
    print(f"report: {path}")


def cmd_simulate(config: Config, run: RunDir, args) -> None:
    from dipaco.simulate.scenario import format_comparison
    from dipaco.stages.simulate import simulate

    results = simulate(config, run, with_sweep=not args.no_sweep)
    sim = config.simulate
    print(f"{sim.learners} learners x {sim.chips_per_learner:,} chips, per-chip MTBI {sim.chip_mtbi_hours:g} h, "
          f"{sim.horizon_hours:g} h simulated")
    print(format_comparison(results["strategies"]))
    print(f"\nresults in {run.root / 'simulate'}")


def cmd_status(args) -> None:
    from dipaco.stages.status import config_of, source, status

    if args.watch < 0:
        raise ValueError(f"--watch must be >= 0 seconds, got {args.watch}")
    src = source(run=args.run, store=args.store, config=config_of(args.run, args.config))
    status(src, watch=args.watch, as_json=args.json)


RUN_CONFIG_STAGES = ("eval", "export", "generate", "report")
STORE_ONLY_STAGES = ("island", "coordinator")  # may run from a store's URL alone (--store)

STAGES = {
    "run": cmd_run,
    "route": cmd_route,
    "shard": cmd_shard,
    "train": cmd_train,
    "island": cmd_island,
    "coordinator": cmd_coordinator,
    "baselines": cmd_baselines,
    "baseline": cmd_baseline,
    "eval": cmd_eval,
    "export": cmd_export,
    "generate": cmd_generate,
    "report": cmd_report,
    "pretrain": cmd_pretrain,
    "reroute": cmd_reroute,
    "simulate": cmd_simulate,
}

if __name__ == "__main__":
    sys.exit(main())
