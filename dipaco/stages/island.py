"""`dipaco island`: a pull-based island process, or one path trained once (`--path P` without `--pull`).

    dipaco island --config configs/tiny.yaml --run runs/tiny                  # any path, until the run ends
    dipaco island --config configs/tiny.yaml --run runs/tiny --pull --path 3  # pinned to path 3
    torchrun --nproc-per-node 2 -m dipaco -- island ...                       # DDP inside the island
    dipaco island ... --name island-0 hardware.workers_per_island=2           # an elastic island: 2 workers

The island itself (`dipaco.islands.island`) talks only to the store; this stage builds it from the
config and the command line. With `hardware.workers_per_island` N > 1 it is an elastic island: this command
runs its lighthouse and N worker processes (`dipaco.islands.elastic_group`), each this command again with
`--worker k` (`dipaco.islands.island.elastic_island`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket

from dipaco.config import Config, FaultsConfig
from dipaco.device import resolve_device
from dipaco.islands.elastic_group import run_group
from dipaco.islands.island import ddp, elastic
from dipaco.islands.island.elastic_island import ElasticIsland
from dipaco.islands.island.faults import FaultClock
from dipaco.islands.island.pinned import run_pinned_task
from dipaco.islands.island.polling import IslandWorker, follow_leader
from dipaco.islands.island.training import IslandSetup
from dipaco.islands.processes import THREADS_ENV, available_cores
from dipaco.pipeline.context import PathFactory
from dipaco.run_dir import RunDir
from dipaco.store.board import check_island_name
from dipaco.store.ledger import publish_counts
from dipaco.store.module_store import ModuleStore
from dipaco.store.run_state import run_finished


def island_setup(config: Config, run: RunDir, *, slowdown: float = 1.0, factory: PathFactory | None = None) -> IslandSetup:
    """The pieces of the run an island uses, unpacked from the config once (`slowdown`: an injected straggler;
    `factory`: the run's store, grid and shard reader when the caller has them already)."""
    factory = factory or PathFactory(config, run)
    factory.store.limit_bandwidth(config.faults.store_bandwidth)  # an emulated link (0: none)
    return IslandSetup(store=factory.store, topology=factory.topology, spec=factory.spec, reader=factory.reader,
                       inner=config.inner, compression=config.compression, hardware=config.hardware, run=config.run,
                       resilience=config.resilience, cancellable=config.rounds.mode == "async",
                       checkpoints=run.root / "islands", warm_start_steps=config.warm_start_steps, slowdown=slowdown,
                       step_seconds=config.faults.step_seconds, fragments=config.outer.fragments,
                       private_local=config.outer.private_modules == "local")


def island(config: Config, run: RunDir, *, pull: bool, paths: list[int] | None, name: str | None,
           fail_mtbf: float | None = None, return_after: float | None = None, max_tasks: int | None = None,
           slowdown: float | None = None, worker: int | None = None, argv: list[str] | None = None) -> None:
    """Run a pull-based island (`pull`), or train each of `paths` once for the next round. `slowdown`
    (default: `faults.slowdown` for the island named island-0, else 1) makes it that many times slower."""
    if name is not None:
        check_island_name(name)  # before any work: a name the coordinator cannot list leaves the island unseen
    store = PathFactory(config, run).store
    if not store.shared:
        raise ValueError(f"store.url {config.store.url!r} lives in one process's memory: an island "
                         f"cannot share it with the coordinator; use a directory or a shared URL (s3://, gs://)")
    store.check_reachable()
    if not pull:
        setup = island_setup(config, run)
        for path in paths or []:
            meta = run_pinned_task(setup, path=path, island=name or f"one-shot-path-{path}")
            print(json.dumps({k: v for k, v in meta.to_json().items() if k != "losses"}))
        publish_counts(setup.store, owner=name or "one-shot", role="island")  # its bytes join the run's traffic
        return
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    if slowdown is None:
        slowdown = config.faults.slowdown if name == "island-0" else 1.0
    faults = dataclasses.replace(config.faults, mtbf=config.faults.mtbf if fail_mtbf is None else fail_mtbf,
                                 return_after=config.faults.return_after if return_after is None else return_after)
    if config.hardware.workers_per_island > 1:
        if max_tasks is not None:
            raise ValueError(f"--max-tasks {max_tasks}: an elastic island (hardware.workers_per_island "
                             f"{config.hardware.workers_per_island}) works until the run's end")
        elastic_island(config, run, store, name=name, paths=paths, faults=faults, slowdown=slowdown, worker=worker,
                       argv=argv)
        return
    if worker is not None:
        raise ValueError(f"--worker {worker}: only an elastic island (hardware.workers_per_island > 1) has workers")
    setup = island_setup(config, run, slowdown=slowdown)
    ctx = ddp.init_from_env(resolve_device(config.hardware.device))
    if ctx is not None and faults.mtbf > 0:
        raise ValueError("fault injection (faults.mtbf) is not supported in a torchrun (DDP) island")
    try:
        if ctx is not None and not ctx.leader:
            follow_leader(setup, ctx)
            return
        clock = FaultClock(mtbf=faults.mtbf, return_after=faults.return_after, mode=faults.mode,
                           seed=config.run.seed, island=name)
        worker = IslandWorker(setup, name=name, pinned=paths, faults=clock, ctx=ctx)
        done = worker.run(max_tasks=max_tasks)
        print(f"island {name}: {done} tasks, {clock.failures} injected failures")
    finally:
        ddp.shutdown(ctx)


def elastic_island(config: Config, run: RunDir, store: ModuleStore, *, name: str, paths: list[int] | None,
                   faults: FaultsConfig, slowdown: float, worker: int | None, argv: list[str] | None) -> None:
    """An island of `hardware.workers_per_island` workers: worker `worker` of it, or (None) its lighthouse and
    every worker, started again as `argv` (this command line) with `--worker k` and restarted when one dies."""
    workers = config.hardware.workers_per_island
    try:
        elastic.require_torchft()
    except ImportError as err:
        raise ValueError(f"hardware.workers_per_island {workers}: {err}") from err
    device = resolve_device(config.hardware.device)
    if device.type != "cpu":
        raise ValueError(f"hardware.workers_per_island {workers}: an elastic island trains on the CPU (gloo) only so "
                         f"far, not on {device} (hardware.device {config.hardware.device!r}); set hardware.device cpu")
    if faults.mtbf > 0 and faults.mode != "die":
        raise ValueError(f"hardware.workers_per_island {workers}: an elastic island's workers fail by dying "
                         f"(faults.mode die), not {faults.mode!r} (faults.mtbf {faults.mtbf})")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError(f"hardware.workers_per_island {workers}: an elastic island is not started by torchrun")
    if worker is None:
        if not argv:
            raise ValueError("an elastic island restarts its workers from its own command line, which is unknown here")
        threads = max(1, int(os.environ.get(THREADS_ENV) or available_cores()) // workers)
        restarts = run_group(name=name, args=[*argv, "--name", name], workers=workers, threads=threads, logs=run.logs,
                             finished=lambda: run_finished(store), join_seconds=config.resilience.worker_join_seconds,
                             lost_seconds=config.resilience.worker_lost_seconds)
        print(f"island {name}: {workers} workers, {restarts} restarts")
        return
    if not 0 <= worker < workers:
        raise ValueError(f"--worker {worker} is not one of hardware.workers_per_island {workers} (0..{workers - 1})")
    setup = island_setup(config, run, slowdown=slowdown)
    clock = FaultClock(mtbf=faults.mtbf, return_after=faults.return_after, mode=faults.mode, seed=config.run.seed,
                       island=f"{name}-w{worker}")  # each worker on its own schedule
    done = ElasticIsland(setup, name=name, worker=worker, workers=workers, pinned=paths, faults=clock).run()
    print(f"island {name} worker {worker}: sealed {done} tasks")


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    island(config, run, pull=args.pull or not args.path, paths=args.path, name=args.name, fail_mtbf=args.fail_mtbf,
           return_after=args.return_after, max_tasks=args.max_tasks, slowdown=args.slowdown, worker=args.worker,
           argv=getattr(args, "argv", None))
