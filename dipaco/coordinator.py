"""The round loop: hand out island tasks, then apply the outer step module by module.

    dipaco train --config configs/tiny.yaml --run runs/tiny

Round t: every path trains from module version t − 1 on an island (`train.islands` long-running
island processes on this machine, each owning some of the paths, talking only to the store); once
all have reported, every module is updated from the pseudo-gradients of the paths that contain it
(`dipaco.outer`) and version t is written, then `state.json` commits the round. A killed run resumes with the same command: finished rounds are
kept, and so are the results of islands that finished in the interrupted round.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from dipaco.config import Config, save_config
from dipaco.island import unflatten_pseudo_gradient
from dipaco.launch import Task, WorkerPool, plan_parallelism
from dipaco.model import split_into_modules
from dipaco.outer import combine_pseudo_gradients, outer_update
from dipaco.paths import PathFactory
from dipaco.run import RunDir

log = logging.getLogger(__name__)


def initialise_store(factory: PathFactory) -> int:
    """Write module version 0 (every module from one seeded dense init, or from the `dipaco pretrain`
    dense model) unless the store has a run.

    Returns the last completed round. A store made for another grid is refused."""
    store, topology = factory.store, factory.topology
    state = store.state()
    if state is not None:
        if state.get("levels") != list(topology.levels) or state.get("modules") != topology.modules:
            raise ValueError(
                f"store {store.url} holds a run with levels {state.get('levels')}, "
                f"but the config asks for {list(topology.levels)}; use another --run or train.store_url"
            )
        return int(state["round"])
    model = factory.new_model(seed=factory.config.train.seed)
    from dipaco.pretrain import load_warm_start

    load_warm_start(factory, model)  # pretrain.warm_start: version 0 = the dense pretrained model
    written: set[str] = set()
    for path in range(topology.n_paths):
        for name, tensors in split_into_modules(model, topology, path=path).items():
            if name not in written:
                store.write_module(0, name, tensors)
                written.add(name)
    store.commit(round=0, levels=list(topology.levels), modules=topology.modules)
    log.info("initialised %d modules for %d paths in %s", len(written), topology.n_paths, store.url)
    return 0


def apply_outer_step(factory: PathFactory, round: int) -> dict:
    """Update every module from the round's results (all paths must have reported) and commit."""
    config, store, topology = factory.config, factory.store, factory.topology
    results = {}
    metas = {}
    for path in range(topology.n_paths):
        tensors, meta = store.read_result(round, path)
        results[path] = unflatten_pseudo_gradient(tensors)
        metas[path] = meta
    for name in topology.modules:
        paths = topology.paths_of_module(name)
        weight = (lambda p: float(metas[p]["tokens"])) if config.outer.weighting == "tokens" else (lambda p: 1.0)
        outer_grad = combine_pseudo_gradients(
            [(results[p][name], weight(p)) for p in paths], rescale_by_paths=config.outer.rescale_by_paths
        )
        params = store.read_module(round - 1, name)
        momentum = store.read_outer_state(round - 1, name)
        new_params, new_momentum = outer_update(params, momentum, outer_grad, config.outer)
        store.write_module(round, name, new_params)
        if new_momentum:
            store.write_outer_state(round, name, new_momentum)
    store.commit(round=round, levels=list(topology.levels), modules=topology.modules)
    if config.train.keep_rounds:
        store.prune(keep_from=round - config.train.keep_rounds + 1)
    return {
        "round": round,
        "tokens": sum(m["tokens"] for m in metas.values()),
        "bytes_up": sum(m["bytes"] for m in metas.values()),
        "train_loss": {p: m["train_loss"] for p, m in metas.items()},
        "val_loss_start": {p: m["val_loss_start"] for p, m in metas.items()},
        "island_seconds": {p: m["seconds"] for p, m in metas.items()},
    }


def train(config: Config, run: RunDir) -> dict:
    """Run (or resume) all rounds; returns the training summary also written to `train.json`."""
    save_config(config, run.config)
    factory = PathFactory(config, run)
    factory.reader.check_fingerprints(tokenizer=_tokenizer_fingerprint(factory))
    done = initialise_store(factory)
    topology = factory.topology
    summary = _load_summary(run.train_summary)
    summary["rounds"] = [r for r in summary["rounds"] if r["round"] <= done]  # drop rounds a reset store lost
    processes, threads = plan_parallelism(topology.n_paths, processes=config.train.islands,
                                          threads=config.train.threads_per_island)
    log.info("%d paths, %d rounds of %d inner steps; %d island processes x %d threads",
             topology.n_paths, config.train.rounds, config.inner.steps, processes, threads)
    started = time.perf_counter()
    last = min(config.train.stop_after_round or config.train.rounds, config.train.rounds)
    islands = WorkerPool(island_tasks(run, topology.n_paths, processes), threads=threads) if done < last else None
    try:
        rounds = tqdm(range(done + 1, last + 1), desc="rounds", unit="round", initial=done,
                      total=config.train.rounds, dynamic_ncols=True, disable=None)
        for round in rounds:
            round_started = time.perf_counter()
            wait_for_results(factory, round, islands)
            stats = apply_outer_step(factory, round)
            stats["seconds"] = time.perf_counter() - round_started
            summary["rounds"].append(stats)
            _write_json(run.train_summary, summary)
            mean_train = sum(stats["train_loss"].values()) / len(stats["train_loss"])
            rounds.set_postfix(train_loss=f"{mean_train:.3f}")
            log.info("round %d: mean train loss %.3f, %d tokens, %.1f MB pseudo-gradients, %.1fs", round,
                     mean_train, stats["tokens"], stats["bytes_up"] / 1e6, stats["seconds"])
        if islands:
            islands.stop()
    finally:
        if islands:
            islands.terminate()
    summary.update(
        n_paths=topology.n_paths,
        rounds_completed=factory.store.current_round(),
        inner_steps_per_path=factory.store.current_round() * config.inner.steps,
        tokens=sum(r["tokens"] for r in summary["rounds"]),
        seconds=sum(r["seconds"] for r in summary["rounds"]),
        last_session_seconds=time.perf_counter() - started,
    )
    _write_json(run.train_summary, summary)
    return summary


def island_tasks(run: RunDir, n_paths: int, processes: int) -> list[Task]:
    """One long-running island per process, each owning every `processes`-th path."""
    tasks = []
    for worker in range(processes):
        paths = list(range(worker, n_paths, processes))
        args = ["island", "--config", str(run.config), "--run", str(run.root), "--follow"]
        for p in paths:
            args += ["--path", str(p)]
        tasks.append(Task(name=f"island {worker} (paths {paths})", args=args, log=run.logs / f"island-{worker}.log"))
    return tasks


def wait_for_results(factory: PathFactory, round: int, islands: WorkerPool | None, poll_seconds: float = 0.2) -> None:
    """Block until every path has reported for `round`, failing fast if an island process died."""
    n_paths = factory.topology.n_paths
    with tqdm(total=n_paths, desc=f"round {round} islands", unit="path", leave=False, dynamic_ncols=True,
              disable=None) as bar:
        while True:
            reported = sum(factory.store.has_result(round, p) for p in range(n_paths))
            if reported > bar.n:
                bar.update(reported - bar.n)
            if reported == n_paths:
                return
            if islands:
                islands.check()
            time.sleep(poll_seconds)


def _tokenizer_fingerprint(factory: PathFactory) -> str:
    from sharding.tokenizer import tokenizer_fingerprint

    return tokenizer_fingerprint(factory.tokenizer)


def _load_summary(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"rounds": []}


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
