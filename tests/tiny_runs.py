"""The tiny run trained in one process: the real `Coordinator` and `IslandWorker`s polled in turn on a
fake clock (so heartbeat timeouts need no sleeping and every schedule is exact).

    run = make_run(tiny_routed, tmp_path / "run", ["run.rounds=3"])
    clock = Clock()
    drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(2)], clock)

conftest's `tiny_straight` is one such run of configs/tiny.yaml (two rounds, two islands), the reference
that resumed, crashed, S3 and Ray runs are compared with: sync rounds with fixed seeds give the same
modules however the islands ran.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

from cli_helpers import TINY

from dipaco.config import Config, load_config, save_config
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.islands.island.polling import IslandWorker
from dipaco.islands.island.training import IslandSetup
from dipaco.model.topology import Topology
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir
from dipaco.stages.island import island_setup
from dipaco.store.module_store import ModuleStore


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Crash(Exception):
    pass


@dataclass
class TinyRun:
    """A run with the tiny shards and an initialised store, and the pieces the islands and coordinator take."""

    dir: RunDir
    config: Config
    setup: IslandSetup

    @property
    def store(self) -> ModuleStore:
        return self.setup.store

    @property
    def topology(self) -> Topology:
        return self.setup.topology

    def coordinator(self, clock: Clock) -> Coordinator:
        return Coordinator(self.store, self.topology, settings=CoordinatorSettings.from_config(self.config),
                           sizes=PathFactory(self.config, self.dir).path_sizes, clock=clock)

    def island(self, name: str, clock: Clock, **kwargs) -> IslandWorker:
        return IslandWorker(self.setup, name=name, clock=clock, **kwargs)


def make_run(tiny: RunDir, root: Path, overrides: list[str]) -> TinyRun:
    """A copy of the routed and sharded `tiny` at `root` with configs/tiny.yaml + `overrides` (CPU) and its store initialised."""
    run = RunDir(root)
    for part in ("tokenizer", "routing", "shards"):
        shutil.copytree(tiny.root / part, run.root / part)
    config = load_config(TINY, ["hardware.device=cpu", *overrides])
    save_config(config, run.config)
    start_or_resume_store(PathFactory(config, run))
    return TinyRun(dir=run, config=config, setup=island_setup(config, run))


def drive(coordinator: Coordinator, islands: list[IslandWorker], clock: Clock, *, dt: float = 0.5,
          turns: int = 400, until_round: int | None = None) -> None:
    """Poll until the run is done (or round `until_round` is committed)."""
    for _ in range(turns):
        if coordinator.tick() or (until_round is not None and coordinator.committed >= until_round):
            return
        for island in islands:
            island.poll()
        clock.t += dt
    raise AssertionError(f"the run did not finish in {turns} turns (round {coordinator.committed})")
