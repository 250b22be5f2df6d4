"""The `dipaco` command: one subcommand per pipeline stage, and `run` for all of them.

    dipaco run    --config configs/tiny.yaml --run runs/tiny     # route, shard, train, baselines, eval, report
    dipaco route  --config configs/tiny.yaml --run runs/tiny routing.prefix_tokens=16
    dipaco island --config configs/tiny.yaml --run runs/tiny --path 3
    dipaco coordinator --config configs/tiny.yaml --run runs/tiny  # + `dipaco island ...` on other machines
    dipaco simulate --run runs/sim simulate.learners=16             # chaos simulation, no training
    dipaco status --run runs/tiny --watch 5                         # the live board of a running run
    dipaco export out/tiny --run runs/tiny && dipaco serve out/tiny # the mixture as one directory, served

Every subcommand takes `--config FILE` (YAML in configs/; default: the run's own config.yaml, else the
built-in defaults) and `--run DIR` (where artifacts go), and any number of `section.key=value` overrides.
`dipaco <subcommand> --help` explains each.

This file only parses the command line and dispatches (`COMMANDS`: the stage function of each command,
one file per command in `dipaco.stages`, imported on use). The config is checked whole before a stage
is imported (torch, transformers) or a file is written; a bad config exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dipaco import __version__
from dipaco.config_keys import ConfigError
from dipaco.inference.routes import route_arg
from dipaco.pipeline.fingerprints import STAGE_ORDER
from dipaco.signals import exit_code, restore, stop_on_signals

log = logging.getLogger("dipaco")


def _common(parser: argparse.ArgumentParser, *, store_only: bool = False) -> None:
    parser.add_argument("--config", help="YAML config file (default: the run's own config.yaml, the built-in "
                                          "defaults for a new run); compared with the run's, each change named")
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


def _serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a mixture written by `dipaco export DIR`")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--route", default=None, type=route_arg,
                        help="router (the k-means router), likelihood (the paths' likelihood of the prefix) or "
                             "likelihood:K (that among the router's K best paths); default: the export's")
    parser.add_argument("--max-loaded", type=int, default=None, metavar="N",
                        help="path models kept in memory, least recently used dropped (default: all paths when "
                             "they fit in memory, else as many as fit, with a warning)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


COMMAND_HELP = {  # command -> its help line, listed by `dipaco --help` in this order
    "run": "the whole pipeline: route, shard, train, baselines, eval, report (done stages are skipped; made with other settings: refused, see --restart-from)",
    "route": "train the tokenizer, fit the router on document prefixes, assign documents to paths",
    "shard": "tokenize and pack each path's documents into checked zstd shards",
    "train": "run (or resume) the outer rounds with local island processes",
    "island": "a pull-based island worker (or, with --path and no --pull, one path for one round)",
    "coordinator": "the round loop alone: task board, outer steps, module versions (islands run elsewhere)",
    "baselines": "train the dense baselines (equal steps, equal compute)",
    "eval": "routed evaluation of the held-out documents against the dense baselines",
    "export": "write the whole mixture (every path, the router, the tokenizer) as one directory that "
              "dipaco.load, dipaco serve and lm_eval read (or --path N: one path as a Hugging Face model)",
    "generate": "route a prompt to a path and generate a continuation with it",
    "report": "write report.md with plots into the run directory",
    "pretrain": "train the dense warm-start model (before routing; every module starts from it)",
    "reroute": "one discriminative re-routing phase: score the router split, fit the router, re-shard",
    "simulate": "chaos simulation at paper scale: goodput of data parallel, elastic, sync and async rounds",
    "status": "the live board of a run: rounds, islands and their tasks, queue, goodput, bytes, per-path losses",
    "serve": "an exported mixture behind OpenAI's completions API (/v1/completions: logprobs, echo, "
             "streaming; lm_eval's local-completions), each request routed by its prompt to one path",
}


def build_parser() -> argparse.ArgumentParser:
    """The `dipaco` command line: one subcommand per `COMMAND_HELP` entry (and the internal one-baseline
    command, not listed), each with its arguments in the order its --help shows them."""
    parser = argparse.ArgumentParser(prog="dipaco", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dipaco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    parsers = {name: sub.add_parser(name, help=help_text, description=help_text)
               for name, help_text in COMMAND_HELP.items()}
    parsers[TRAIN_ONE_BASELINE] = sub.add_parser(TRAIN_ONE_BASELINE)  # internal: no help, so not listed
    _status_options(parsers.pop("status"))  # reads a run's store, writes nothing: --run or --store
    _serve_options(parsers.pop("serve"))  # reads an exported mixture, no run
    parsers["export"].add_argument("out", help="output directory: new, empty, or an earlier export (--overwrite)")
    parsers["export"].add_argument("--overwrite", action="store_true",
                                   help="replace an earlier dipaco export in OUT (never anything else)")
    parsers["generate"].add_argument("prompt", help="the text to continue")
    for name, stage_parser in parsers.items():
        _common(stage_parser, store_only=name in STORE_ONLY_STAGES)
    for name in ("export", "generate"):
        _version_options(parsers[name])
    _export_options(parsers["export"])
    _generate_options(parsers["generate"])
    for name in ("run", "train", "coordinator"):
        parsers[name].add_argument("--force", action="store_true",
                                   help="take over the store's coordinator lease even if another coordinator seems to "
                                        "hold it (only when you know it is gone: docs/islands.md#crash-safety)")
    _island_options(parsers["island"])
    _eval_options(parsers["eval"])
    parsers["simulate"].add_argument("--no-sweep", action="store_true",
                                     help="only the four strategies at the configured cluster, not the goodput-vs-chips sweep")
    parsers["run"].add_argument("--restart-from", choices=STAGE_ORDER, default=None, metavar="STAGE",
                                help="redo STAGE and every later one (" + ", ".join(STAGE_ORDER) + "): their old "
                                     "artifacts are moved to RUN/superseded/<time>/; for a run whose config changed")
    parsers[TRAIN_ONE_BASELINE].add_argument("--name", required=True, help="dense-equal-steps, dense-equal-compute or dense-large")
    return parser


def _version_options(parser: argparse.ArgumentParser) -> None:
    """Which module version a command that reads trained paths (export, generate) takes."""
    parser.add_argument("--round", type=int, default=None, help="module version (default: the last)")
    parser.add_argument("--best", action="store_true", help="each path at its best round (validation loss)")


def _export_options(parser: argparse.ArgumentParser) -> None:
    """`dipaco export`'s own options after the common ones: what the export holds and how it routes."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--path", type=int, help="only this path, as a Hugging Face model directory")
    which.add_argument("--all", action="store_true", help="the whole mixture (the default; kept for older scripts)")
    parser.add_argument("--route", default="router", choices=["router", "likelihood"],
                        help="the mixture's default routing at load (either can be chosen at load)")
    parser.add_argument("--per-path", action="store_true",
                        help="also each routed path as its own Hugging Face directory (OUT/path-0003/)")
    parser.add_argument("--baselines", action="store_true",
                        help="also the run's dense baselines, as Hugging Face directories in OUT/baselines/")


def _generate_options(parser: argparse.ArgumentParser) -> None:
    """`dipaco generate`'s own options after the common ones: sampling and routing."""
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--route", default="router", type=route_arg,
                        help="pick the path by the run's router (default), by the paths' own likelihood of the "
                             "prompt's routing prefix (the `likelihood` eval mode) or likelihood:K (that among "
                             "the router's K best paths)")


def _island_options(parser: argparse.ArgumentParser) -> None:
    """`dipaco island`'s own options after the common ones: its paths, name, injected faults and workers."""
    parser.add_argument("--path", type=int, action="append", default=None,
                        help="a path this island trains (repeat for several); with --pull: pin to it")
    parser.add_argument("--pull", action="store_true",
                        help="pull tasks from the coordinator (the default when no --path is given)")
    parser.add_argument("--name", default=None, help="island name (default: host-pid)")
    parser.add_argument("--fail-mtbf", type=float, default=None,
                        help="inject failures with this mean time between failures in seconds (faults.mtbf)")
    parser.add_argument("--return-after", type=float, default=None,
                        help="a failed island comes back after this many seconds (faults.return_after)")
    parser.add_argument("--slowdown", type=float, default=None,
                        help="inject a straggler: every inner step takes this many times longer (faults.slowdown)")
    parser.add_argument("--max-tasks", type=int, default=None, help="stop after this many tasks")
    parser.add_argument("--worker", type=int, default=None,
                        help="run worker K of an elastic island (hardware.workers_per_island > 1) whose "
                             "lighthouse TORCHFT_LIGHTHOUSE names; without it `dipaco island` starts the "
                             "lighthouse and every worker on this machine")


def _eval_options(parser: argparse.ArgumentParser) -> None:
    """`dipaco eval`'s own options after the common ones: the eval modes and best rounds."""
    parser.add_argument("--mode", action="append", default=None,
                        help="prefix | every:W | likelihood | oracle | oracle-split | all-paths (repeat; default eval.modes)")
    parser.add_argument("--best", action="store_true", default=None,
                        help="also evaluate each path at its round with the lowest validation loss")


# command -> (stage module, its function): imported on use, so `dipaco --help` stays fast. A function takes
# (config, run, args); `status` (a store alone) and `serve` (an exported mixture) take (args).
COMMANDS = {
    "run": ("dipaco.stages.run", "command"),
    "route": ("dipaco.stages.route", "command"),
    "shard": ("dipaco.stages.shard", "command"),
    "train": ("dipaco.stages.train", "command_train"),
    "island": ("dipaco.stages.island", "command"),
    "coordinator": ("dipaco.stages.train", "command_coordinator"),
    "baselines": ("dipaco.stages.baselines", "command"),
    "_train-baseline": ("dipaco.stages.baselines", "command_one"),
    "eval": ("dipaco.stages.evaluate", "command"),
    "export": ("dipaco.stages.export", "command"),
    "generate": ("dipaco.stages.generate", "command"),
    "report": ("dipaco.stages.report", "command"),
    "pretrain": ("dipaco.stages.pretrain", "command"),
    "reroute": ("dipaco.stages.reroute", "command"),
    "simulate": ("dipaco.stages.simulate", "command"),
    "status": ("dipaco.stages.status", "command"),
    "serve": ("dipaco.stages.serve", "command"),
}
TRAIN_ONE_BASELINE = "_train-baseline"  # internal (`dipaco.stages.baselines.INTERNAL_COMMAND`): one baseline's process
RUN_STAGES = ("eval", "export", "generate", "report")  # read a run made by earlier stages
READ_ONLY_STAGES = ("export", "generate")  # read the run, write elsewhere (or nowhere)
STORE_ONLY_STAGES = ("island", "coordinator")  # may run from a store's URL alone (--store)
NO_RUN_STAGES = ("status", "serve")  # take (args): a store or an exported mixture, no run directory
LOCKING_STAGES = ("run", "pretrain", "route", "shard", "reroute")  # write the run's artifacts: one at a time per run


class TqdmHandler(logging.StreamHandler):
    """Log lines written with `tqdm.write` (to stderr), so that none prints over a progress bar: the bars are
    cleared, the line written, the bars drawn again below it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's own rule: a handler never raises
            self.handleError(record)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line (an elastic island's workers rerun it)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[TqdmHandler()],
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")
    from dipaco.islands.processes import exit_with_parent

    exit_with_parent()
    installed = stop_on_signals()
    try:
        dispatch(args)
    except ConfigError as err:  # the config itself: a usage error, as argparse's
        log.error("%s", err)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        log.error("%s", err)
        return 1
    except OSError as err:  # a filesystem refusal the checks above did not foresee: name it, no traceback
        log.error("%s: %s", type(err).__name__, err)
        return 1
    except KeyboardInterrupt as stop:  # SIGINT or SIGTERM (`dipaco.signals`): every `finally` has run
        log.error("%s; run the same command again to resume", stop.args[0] if stop.args else "interrupted (SIGINT)")
        return exit_code(stop)
    finally:
        restore(installed)
    return 0


def dispatch(args: argparse.Namespace) -> None:
    """Run the stage function of `args.command` with the command's config and run directory: the config
    checked and the run directory prepared before the stage's module (torch, transformers) is imported."""
    from dipaco.islands.processes import set_threads_from_env

    module, function = COMMANDS[args.command]
    if args.command in NO_RUN_STAGES:  # no run directory to prepare: they only read
        if args.command == "serve":  # the one of them that computes
            set_threads_from_env()
        getattr(importlib.import_module(module), function)(args)
        return
    if args.command == "generate":
        from dipaco.stages.generate import command_on_export

        if command_on_export(args):  # --run names an exported mixture, not a run
            return
    from dipaco.pipeline.invocation import config_and_run, prepare_run_dir

    store = getattr(args, "store", None)
    wait = 0.0
    if store and args.command == "island":  # islands may start before their coordinator publishes the run
        from dipaco.pipeline.published import PUBLICATION_WAIT as wait
    config, run = config_and_run(args.command, config_file=args.config, run=args.run, store=store,
                                 overrides=args.overrides, wait=wait)
    prepare_run_dir(run, needs_run=args.command in RUN_STAGES, writes=args.command not in READ_ONLY_STAGES)
    set_threads_from_env()  # (imports torch when the launcher set a thread count)
    stage = getattr(importlib.import_module(module), function)
    if args.command not in LOCKING_STAGES:
        stage(config, run, args)
        return
    from dipaco.outputs import locked_run_dir

    with locked_run_dir(run.root, command=args.command):
        stage(config, run, args)


if __name__ == "__main__":
    sys.exit(main())
