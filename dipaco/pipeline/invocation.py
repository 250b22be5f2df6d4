"""How a command finds its config and run directory: `--store URL` fetches the run published there
(`published.fetch_run`), else `--config` (or the run's own resolved `config.yaml`) and `--run`.

    config, run = config_and_run("eval", config_file=None, run="runs/tiny", store=None, overrides=[],
                                 run_config=True, wait=0.0)
    prepare_run_dir(run, needs_run=True, writes=True)
"""

from __future__ import annotations

from pathlib import Path

from dipaco.config import Config, load_config
from dipaco.outputs import check_run_dir, check_writable, mark_run_dir
from dipaco.run_dir import RunDir


def config_and_run(command: str, *, config_file: str | None, run: str | None, store: str | None,
                   overrides: list[str], run_config: bool, wait: float) -> tuple[Config, RunDir]:
    """`run_config`: without `--config`, read the run's own config.yaml when there is one; `wait`: seconds
    to wait for a run to be published in `store` (islands may start before their coordinator)."""
    if store:
        if config_file:
            raise ValueError("--store URL runs with the config published in the store; give overrides "
                             "(section.key=value) instead of --config")
        from dipaco.pipeline.published import fetch_run

        return fetch_run(store, run_root=Path(run) if run else None, overrides=overrides, wait=wait)
    if run is None:
        raise ValueError(f"dipaco {command}: give --run DIR (or --store URL for a run published in a store)")
    if config_file is None and run_config and (Path(run) / "config.yaml").exists():
        config_file = Path(run) / "config.yaml"  # the run's own resolved config
    return load_config(config_file, overrides), RunDir(run)


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
