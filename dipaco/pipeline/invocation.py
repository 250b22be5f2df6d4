"""How a command finds its config and run directory: `--store URL` fetches the run published there
(`published.fetch_run`), else `--config` (default: the run's own `config.yaml`, else the built-in
defaults) and `--run`.

    config, run = config_and_run("eval", config_file=None, run="runs/tiny", store=None, overrides=[], wait=0.0)
    prepare_run_dir(run, needs_run=True, writes=True)

The config is checked whole before the command imports torch or writes a file: its keys and values
(`config_keys`, naming where a bad key came from), the bounds that depend on the grid (`outer.fragments`
against the grid's modules) and a store that the command's processes can share. A `--config` given for
a run that has one is compared with it, and each changed key named with what it does (`changes`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dipaco.config import Config
from dipaco.config_keys import ConfigError, Source, build_config, read_raw
from dipaco.model.topology import Topology
from dipaco.outputs import check_run_dir, check_writable, mark_run_dir
from dipaco.pipeline.changes import config_changes
from dipaco.run_dir import RunDir

log = logging.getLogger(__name__)

SHARED_STORE_COMMANDS = ("run", "train", "coordinator", "island")  # run their islands in other processes


def config_and_run(command: str, *, config_file: str | None, run: str | None, store: str | None,
                   overrides: list[str], wait: float) -> tuple[Config, RunDir]:
    """`config_file` None: the run's own config.yaml when there is one; `wait`: seconds to wait for a run to be
    published in `store` (islands may start before their coordinator)."""
    if store:
        if config_file:
            raise ValueError("--store URL runs with the config published in the store; give overrides "
                             "(section.key=value) instead of --config")
        from dipaco.pipeline.published import fetch_run

        return fetch_run(store, run_root=Path(run) if run else None, overrides=overrides, wait=wait)
    if run is None:
        raise ValueError(f"dipaco {command}: give --run DIR (or --store URL for a run published in a store)")
    root = RunDir(run)
    own = root.config if root.config.is_file() else None
    raw, source = read_raw(config_file or own, overrides)
    config = build_config(Config, raw, source=source)
    check_for_command(config, command=command, source=source)
    if own and (config_file or overrides):
        _say_changes(own, config, run=root, given=f"--config {config_file}" if config_file else "the command line")
    return config, root


def check_for_command(config: Config, *, command: str, source: Source) -> None:
    """The checks a config's sections cannot make alone: `outer.fragments` within the grid's modules, and
    a store the command's processes can share (`store.url`)."""
    modules = Topology.from_config(config.topology, n_layers=config.model.n_layers).modules
    if config.outer.fragments > len(modules):
        raise ConfigError(f"outer.fragments {config.outer.fragments} must be between 1 and the grid's {len(modules)} "
                          f"modules ({', '.join(modules[:6])}{', ...' if len(modules) > 6 else ''}) "
                          f"(in {source.blame('outer.fragments topology.levels')})")
    if command in SHARED_STORE_COMMANDS and config.store.url.split("://")[0] == "memory":
        raise ConfigError(f"store.url {config.store.url!r} lives in one process's memory, but the islands of "
                          f"`dipaco {command}` are other processes and would never see it; use a directory or a "
                          f"shared URL (s3://, gs://) (in {source.of('store.url')})")


def _say_changes(own: Path, config: Config, *, run: RunDir, given: str) -> None:
    """Log what `given` (--config, or overrides) changes against the run's own config.yaml (nothing when
    they agree)."""
    try:
        raw, source = read_raw(own, [])
        run_config = build_config(Config, raw, source=source)
    except ValueError as err:  # a config.yaml an older dipaco wrote: nothing to compare with
        log.warning("%s cannot be compared with %s: %s", own, given, err)
        return
    lines = config_changes(run_config, config, run=run)
    if lines:
        log.warning("%s differs from the run's own %s:\n  %s",
                    given, own, "\n  ".join(lines))


def prepare_run_dir(run: RunDir, *, needs_run: bool, writes: bool) -> None:
    """Before any work: refuse a `--run` that is not a run directory (`dipaco.outputs`); a command that
    reads a finished run (`needs_run`) needs it to exist, one that `writes` into it needs it writable."""
    check_run_dir(run.root)
    if needs_run:
        run.require(run.root, "run")
    if not writes:
        return
    run.root.mkdir(parents=True, exist_ok=True)
    check_writable(run.root)
    mark_run_dir(run.root)
