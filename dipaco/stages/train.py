"""The round loop: hand out island tasks, then apply the outer step module by module.

    dipaco train --config configs/tiny.yaml --run runs/tiny

Round t: every path trains from module version t − 1 on an island (`train.islands` pull-based
island processes on this machine, `dipaco.islands.island`, talking only to the store); the coordinator
service (`dipaco.islands.coordinator`) hands out the tasks, and once the round may close (`outer.mode`), every
module is updated from the pseudo-gradients of the paths that contain it (`dipaco.islands.rounds`,
`dipaco.optim.outer`) and version t is written, then `state.json` commits the round. `dipaco coordinator`
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
from dipaco.eval.early_stopping import record_final_val_losses
from dipaco.islands.coordinator import Coordinator, goodput, initialise_store
from dipaco.islands.processes import Task, WorkerPool, plan_parallelism
from dipaco.run_dir import RunDir
from dipaco.stages.context import PathFactory

log = logging.getLogger(__name__)


def train(config: Config, run: RunDir, *, local_islands: bool = True) -> dict:
    """Run (or resume) all rounds; returns the training summary also written to `train.json`.

    The rounds are run by the task-board coordinator (`dipaco.islands.coordinator`); with `local_islands`
    it also starts `train.islands` pull-based island processes on this machine (`dipaco.islands.island`)."""
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
