"""`dipaco island`: a pull-based island process, or one path trained once (`--path P` without `--pull`).

    dipaco island --config configs/tiny.yaml --run runs/tiny                  # any path, until the run ends
    dipaco island --config configs/tiny.yaml --run runs/tiny --pull --path 3  # pinned to path 3
    torchrun --nproc-per-node 2 -m dipaco -- island ...                       # DDP inside the island

The island itself (`dipaco.islands.island`) talks only to the store; this stage builds it from the
config and the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

from dipaco.config import Config
from dipaco.device import resolve_device
from dipaco.islands import ddp
from dipaco.islands.faults import FaultClock
from dipaco.islands.island import IslandSetup, IslandWorker, follow_leader, run_pinned_task
from dipaco.run_dir import RunDir
from dipaco.stages.context import PathFactory, warm_start_steps


def island_setup(config: Config, run: RunDir) -> IslandSetup:
    """The pieces of the run an island uses, unpacked from the config once."""
    factory = PathFactory(config, run)
    return IslandSetup(store=factory.store, topology=factory.topology, spec=factory.spec, reader=factory.reader,
                       inner=config.inner, outer=config.outer, train=config.train, checkpoints=run.root / "islands",
                       warm_start_steps=warm_start_steps(config))


def island(config: Config, run: RunDir, *, pull: bool, paths: list[int] | None, name: str | None,
           fail_mtbf: float | None = None, return_after: float | None = None, max_tasks: int | None = None,
           slowdown: float | None = None) -> None:
    """Run a pull-based island (`pull`), or train each of `paths` once for the next round. `slowdown`
    (default: `train.slowdown` for the island named island-0, else 1) makes it that many times slower."""
    store = PathFactory(config, run).store
    if not store.shared:
        raise ValueError(f"train.store_url {config.train.store_url!r} lives in one process's memory: an island "
                         f"cannot share it with the coordinator; use a directory or a shared URL (s3://, gs://)")
    store.check_reachable()
    if not pull:
        setup = island_setup(config, run)
        for path in paths or []:
            meta = run_pinned_task(setup, path=path, island=name or f"one-shot-path-{path}")
            print(json.dumps({k: v for k, v in meta.to_json().items() if k != "losses"}))
        return
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    if slowdown is None:
        slowdown = config.train.slowdown if name == "island-0" else 1.0
    train_cfg = dataclasses.replace(
        config.train, fail_mtbf=config.train.fail_mtbf if fail_mtbf is None else fail_mtbf,
        return_after=config.train.return_after if return_after is None else return_after, slowdown=slowdown)
    setup = island_setup(dataclasses.replace(config, train=train_cfg), run)
    ctx = ddp.init_from_env(resolve_device(train_cfg.device))
    if ctx is not None and train_cfg.fail_mtbf > 0:
        raise ValueError("fault injection (train.fail_mtbf) is not supported in a torchrun (DDP) island")
    try:
        if ctx is not None and not ctx.leader:
            follow_leader(setup, ctx)
            return
        faults = FaultClock(mtbf=train_cfg.fail_mtbf, return_after=train_cfg.return_after, mode=train_cfg.fail_mode,
                            seed=train_cfg.seed, island=name)
        worker = IslandWorker(setup, name=name, pinned=paths, faults=faults, ctx=ctx)
        done = worker.run(max_tasks=max_tasks)
        print(f"island {name}: {done} tasks, {faults.failures} injected failures")
    finally:
        ddp.shutdown(ctx)
