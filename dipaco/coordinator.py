"""The round loop: hand out island tasks, then apply the outer step module by module.

    dipaco train --config configs/tiny.yaml --run runs/tiny

Round t: every path trains from module version t − 1 on an island (`train.islands` pull-based
island processes on this machine, `dipaco.worker`, talking only to the store); the coordinator
service (`dipaco.scheduler`) hands out the tasks, and once the round may close (`outer.mode`), every
module is updated from the pseudo-gradients of the paths that contain it (`dipaco.async_outer`,
`dipaco.outer`) and version t is written, then `state.json` commits the round. `dipaco coordinator`
runs the same loop without local islands. A killed run resumes with the same command: finished
rounds are kept, and so are the results of islands that finished in the interrupted round.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from dipaco.config import Config, save_config
from dipaco.early_stopping import record_final_val_losses
from dipaco.launch import Task, WorkerPool, plan_parallelism
from dipaco.model import split_into_modules
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


def train(config: Config, run: RunDir, *, local_islands: bool = True) -> dict:
    """Run (or resume) all rounds; returns the training summary also written to `train.json`.

    The rounds are run by the task-board coordinator (`dipaco.scheduler`); with `local_islands`
    it also starts `train.islands` pull-based island processes on this machine (`dipaco.worker`)."""
    from dipaco.scheduler import Coordinator, goodput
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
    service = Coordinator(factory)
    last = min(config.train.stop_after_round or config.train.rounds, config.train.rounds)
    islands = None
    if local_islands and done < last:
        islands = WorkerPool(pull_island_tasks(run, processes), threads=threads)
    try:
        rounds = tqdm(range(done + 1, last + 1), desc="rounds", unit="round", initial=done,
                      total=config.train.rounds, dynamic_ncols=True, disable=None)
        for round in rounds:
            round_started = time.perf_counter()
            stats = service.run_round(round, check=islands.check_any_alive if islands else None)
            stats["seconds"] = time.perf_counter() - round_started
            summary["rounds"].append(stats)
            _write_json(run.train_summary, summary)
            mean_train = sum(stats["train_loss"].values()) / len(stats["train_loss"])
            rounds.set_postfix(train_loss=f"{mean_train:.3f}")
            log.info("round %d: mean train loss %.3f, %d tokens, %.2f MB pseudo-gradients, %d results applied "
                     "(%d stale, %d dropped), %d tasks in flight, %.1fs", round, mean_train, stats["tokens"],
                     stats["bytes_up"] / 1e6, stats.get("applied", 0), stats.get("stale", 0), stats.get("dropped", 0),
                     stats.get("in_flight", 0), stats["seconds"])
        finished_at = time.monotonic()
        if islands and last == config.train.rounds:
            islands.stop()  # they stop by themselves after the run's last round
        if factory.store.current_round() == config.train.rounds:
            record_final_val_losses(factory)  # so the last round can be a path's best (dipaco eval --best)
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
        bytes_up=sum(r.get("bytes_up", 0) for r in summary["rounds"]),
    )
    if islands:
        island_seconds = finished_at - (service.first_beat or finished_at)  # first heartbeat to last commit
        summary["goodput"] = goodput(factory.store, rounds=config.train.rounds, islands=processes, seconds=island_seconds)
    _write_json(run.train_summary, summary)
    return summary


def pull_island_tasks(run: RunDir, processes: int) -> list[Task]:
    """`processes` pull-based islands (`dipaco island`, unpinned) named island-0, island-1, ..."""
    return [Task(name=f"island-{i}", log=run.logs / f"island-{i}.log",
                 args=["island", "--config", str(run.config), "--run", str(run.root), "--name", f"island-{i}"])
            for i in range(processes)]


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
