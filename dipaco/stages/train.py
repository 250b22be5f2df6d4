"""`dipaco train` and `dipaco coordinator`: the round loop.

    dipaco train       --config configs/tiny.yaml --run runs/tiny   # the coordinator and local island processes
    dipaco coordinator --config configs/tiny.yaml --run runs/tiny   # the coordinator alone; islands elsewhere

The coordinator (`dipaco.islands.coordinator`) hands out tasks to `hardware.islands` pull-based island
processes (`dipaco.islands.island`, talking only to the store), closes rounds as `rounds.mode` says and
writes each module version, train.json's rows and TensorBoard metrics; `launcher.kind=ray` runs the
coordinator and its islands as Ray tasks. The run ends when every path has had `run.rounds` results
applied. A killed run resumes with the same command; one coordinator holds a store's lease (`--force`
takes it over). train.json also says the outer step each span of rounds took as applied (`outer_steps`,
`dipaco.optim.outer_history`), the commit of the code each session trained with (`code`) and the store
traffic every process measured, by direction, kind and process, every session's included (`traffic`,
`dipaco.store.ledger`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from dipaco import atomic
from dipaco.code_version import code_version
from dipaco.config import Config, save_config
from dipaco.device import resolve_device
from dipaco.islands import launch_ray
from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.islands.coordinator.metrics import RunMetrics
from dipaco.islands.coordinator.pruning import finish_run
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.islands.coordinator.update_bound import InnerRun
from dipaco.islands.processes import Task, WorkerPool, plan_parallelism
from dipaco.optim.outer_history import describe_outer_steps, describe_rows, describe_step, outer_spans
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.fingerprints import check, index_digest, record
from dipaco.pipeline.published import publish_run
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir
from dipaco.store.goodput import by_work, goodput, median_rate
from dipaco.store.lease import Lease
from dipaco.store.records import RoundStats
from dipaco.store.run_state import run_finished
from dipaco.store.traffic import ring_allreduce_bytes

log = logging.getLogger(__name__)


def train(config: Config, run: RunDir, *, local_islands: bool = True, force: bool = False) -> dict:
    """Run (or resume) all rounds; returns the training summary also written to `train.json`.

    The rounds are run by the task-board coordinator (`dipaco.islands.coordinator`); with `local_islands`
    it also starts `hardware.islands` pull-based island processes on this machine (`dipaco.islands.island`).
    `force` takes over the store's coordinator lease even when another coordinator seems to hold it."""
    if local_islands and config.launcher.kind == "ray" and not launch_ray.in_coordinator_task():
        return _train_on_ray(config, run, force=force)
    factory = PathFactory(config, run)
    if not factory.store.shared:
        raise ValueError(f"store.url {config.store.url!r} lives in one process's memory, but the islands "
                         f"are other processes and would never see it; use a directory or a shared URL (s3://, gs://)")
    check(run, config, ("route", "shard", "train"))  # before anything is written (config.yaml included)
    summary = finished_summary(config, run, factory)
    if summary is not None:  # nothing to train: nothing written but a changed config (not even the lease)
        save_config(config, run.config)  # what later commands read (unchanged: not written)
        log.info("%s is finished: every path has had its run.rounds %d x inner.steps %d inner steps applied "
                 "(%d); nothing to train", run.root, config.run.rounds, config.inner.steps, summary["inner_steps_per_path"])
        return summary
    save_config(config, run.config)
    record(run, "train", config, shards=index_digest(run))
    factory.reader.check_fingerprints(tokenizer=_tokenizer_fingerprint(factory))
    factory.store.check_reachable()
    lease = Lease.acquire(factory.store, timeout=config.resilience.lease_timeout, force=force)  # before any store write
    try:
        publish_run(factory.store, run)  # so islands and coordinators given only the URL can run (store-only)
        return _train(config, run, factory, lease, local_islands=local_islands)
    finally:
        lease.release()


def finished_summary(config: Config, run: RunDir, factory: PathFactory) -> dict | None:
    """train.json when the run is finished as `config` plans it (the store's last commit marked the run
    finished, train.json records that commit and every path has had run.rounds x inner.steps inner steps
    applied), else None: there is training to do, or to record."""
    if not run.train_summary.exists() or not run_finished(factory.store):
        return None
    try:
        summary = json.loads(run.train_summary.read_text())
        trained, committed = int(summary["inner_steps_per_path"]), int(summary["rounds_completed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # train.json unreadable: training again writes it
    planned = config.run.rounds * config.inner.steps
    return summary if committed == factory.store.current_round() and trained >= planned else None


def _train(config: Config, run: RunDir, factory: PathFactory, lease: Lease, *, local_islands: bool) -> dict:
    """Run the rounds left with the task-board coordinator (and, with `local_islands`, its island processes on
    this machine or as Ray tasks), then write train.json with the run's totals; returns it as written."""
    done = start_or_resume_store(factory)
    store, topology = factory.store, factory.topology
    summary = _load_summary(run.train_summary)
    on_ray = local_islands and config.launcher.kind == "ray"
    processes, threads = _island_plan(config, topology.n_paths, on_ray=on_ray)
    log.info("%d paths, %d rounds of %d inner steps; %d island processes x %d threads",
             topology.n_paths, config.run.rounds, config.inner.steps, processes, threads)
    started = time.perf_counter()
    service = _coordinator(config, factory, lease, expected_islands=processes if local_islands else 0)
    rounds = summary["rounds"] = resumed_rounds(summary["rounds"], service.last_stats, done=done)

    def more() -> bool:  # the run's length is the policy's (run.rounds results per path); stop_after_round a version
        return not service.done and not (config.run.stop_after_round and service.committed >= config.run.stop_after_round)

    if more():  # this session trains rounds: the code it trains them with
        summary["code"] = code_sessions(summary.get("code", []), code_version(), first_round=service.committed + 1)
    islands = None
    metrics = RunMetrics(run.tensorboard, enabled=config.run.tensorboard)
    nominal = _paced_speed(config, seq_len=factory.reader.seq_len)
    if local_islands and more():
        islands = _start_islands(config, run, processes, threads=threads, on_ray=on_ray)
    try:
        finished_at = _run_rounds(config, run, factory, service, summary, more=more, islands=islands, metrics=metrics,
                                  processes=processes, local_islands=local_islands, nominal=nominal)
    finally:
        metrics.close()
        if islands:
            islands.terminate()
    workers = processes if local_islands else max(1, len(service.seen))  # the run's islands
    summary.update(_totals(rounds, service, n_paths=topology.n_paths, inner_steps=config.inner.steps, workers=workers),
                   rounds_completed=store.current_round(), last_session_seconds=time.perf_counter() - started)
    log.info("outer steps: %s", describe_outer_steps(outer_spans(rounds)))
    if islands:
        island_seconds = finished_at - (service.first_beat or finished_at)  # first heartbeat to last commit
        summary["goodput"] = goodput(store, islands=processes, seconds=island_seconds, tokens_per_second=nominal)
    return _write_summary(run.train_summary, summary)


def _island_plan(config: Config, n_paths: int, *, on_ray: bool) -> tuple[int, int]:
    """(island processes, threads each): as Ray tasks when `on_ray` (connecting to the Ray cluster), else
    `hardware.islands` processes on this machine."""
    if on_ray:  # the coordinator task of a launcher.kind=ray driver: islands are Ray tasks
        launch_ray.connect(os.environ.get(launch_ray.ADDRESS_ENV, "auto"))
        processes = launch_ray.island_plan(n_paths=n_paths, islands=config.hardware.islands,
                                           cpus=config.launcher.ray_island_cpus, gpus=config.launcher.ray_island_gpus,
                                           coordinator_cpus=config.launcher.ray_coordinator_cpus)
        return processes, config.launcher.ray_island_cpus
    return plan_parallelism(n_paths, processes=config.hardware.islands, threads=config.hardware.threads_per_island)


def _coordinator(config: Config, factory: PathFactory, lease: Lease, *, expected_islands: int) -> Coordinator:
    """The task-board coordinator of the run's store, holding `lease`, checking results as the config says;
    `expected_islands`: the island processes it starts itself (0: islands run elsewhere)."""
    checks = ResultChecks(factory.store, factory.topology, resilience=config.resilience, inner_steps=config.inner.steps,
                          tokens_per_step=config.inner.batch_size * factory.reader.seq_len, inner=InnerRun.of(config))
    settings = dataclasses.replace(CoordinatorSettings.from_config(config), expected_islands=expected_islands)
    return Coordinator(factory.store, factory.topology, settings=settings, sizes=factory.path_sizes, checks=checks,
                       lease=lease)


def _start_islands(config: Config, run: RunDir, processes: int, *, threads: int,
                   on_ray: bool) -> launch_ray.RayIslands | WorkerPool:
    """`processes` pull-based island processes on this machine, or as Ray tasks when `on_ray`."""
    tasks = pull_island_tasks(run, processes)
    if on_ray:
        return launch_ray.RayIslands(tasks, threads=threads, cpus=threads, gpus=config.launcher.ray_island_gpus,
                                     restarts=config.launcher.ray_island_restarts)
    return WorkerPool(tasks, threads=threads)


def _run_rounds(config: Config, run: RunDir, factory: PathFactory, service: Coordinator, summary: dict, *,
                more: Callable[[], bool], islands: launch_ray.RayIslands | WorkerPool | None, metrics: RunMetrics,
                processes: int, local_islands: bool, nominal: float | None) -> float:
    """Run rounds while `more()`: each committed round goes into train.json's rows (written after each), the
    metrics and the progress bar. When the run is done, the islands are stopped and the last version is
    validated (`finish_run`). Returns the time.monotonic() of the last commit."""
    store, topology, policy = factory.store, factory.topology, service.policy
    rounds = summary["rounds"]
    trained: list[tuple[int, float]] = []  # (tokens, inner-loop seconds) of every result received so far
    bar = tqdm(desc="results applied", unit="result", total=config.run.rounds * topology.n_paths,
               initial=sum(policy.applied_results(p) for p in range(topology.n_paths)),
               dynamic_ncols=True, disable=None)
    while more():
        round = service.committed + 1
        stats = service.run_round(round, check=islands.check_any_alive if islands else None)
        rounds.append(stats)
        _write_summary(run.train_summary, summary)
        trained += [(meta.tokens, meta.seconds) for meta in service.last_metas.values()]
        metrics.round(store, stats, norms=service.last_norms, metas=service.last_metas,
                      goodput=_goodput_so_far(rounds, islands=processes if islands else len(service.seen),
                                              first_beat=service.first_beat,
                                              tokens_per_second=nominal or median_rate(trained)),
                      traffic=service.traffic,
                      workers=processes if local_islands else max(1, len(service.seen)))
        _show_round(bar, stats)
    finished_at = time.monotonic()
    bar.close()
    if islands and service.done:
        islands.stop()  # they stop by themselves after the run's last round
    if service.done:  # so the last round can be a path's best (eval --best)
        finish_run(store, topology, factory.spec, factory.validation, keep_rounds=config.store.keep_versions,
                   device=resolve_device(config.hardware.device))
        metrics.final(store, version=store.current_round())
    return finished_at


def _show_round(bar: tqdm, stats: RoundStats) -> None:
    """A committed round on the progress bar and in the log."""
    bar.update(stats.applied)
    bar.set_postfix(round=stats.round, train_loss=f"{stats.mean_train_loss:.3f}")
    log.info("round %d: mean train loss %.3f, %d tokens, %.2f MB pseudo-gradients (%.2f MB in float32), "
             "%d results applied (%d stale, %d dropped), %d tasks in flight, %d cancelled, outer step: %s, %.1fs",
             stats.round, stats.mean_train_loss, stats.tokens, stats.bytes_up / 1e6, stats.bytes_float32 / 1e6,
             stats.applied, stats.stale, stats.dropped, stats.in_flight, stats.cancelled,
             describe_step(stats.outer, stats.outer_step), stats.seconds)


def _totals(rounds: list[RoundStats], service: Coordinator, *, n_paths: int, inner_steps: int, workers: int) -> dict:
    """train.json's totals over the run's rounds: results, tokens, bytes each way, the outer steps, the traffic."""
    policy = service.policy
    return dict(
        n_paths=n_paths,
        inner_steps_per_path=min(policy.applied_results(p) for p in range(n_paths)) * inner_steps,
        results_applied=sum(policy.applied_results(p) for p in range(n_paths)),
        tokens=sum(r.tokens for r in rounds),
        seconds=sum(r.seconds for r in rounds),
        bytes_up=sum(r.bytes_up for r in rounds),
        bytes_up_peak_round=max((r.bytes_up for r in rounds), default=0),  # the most one round uploaded
        bytes_up_peak_round_excluding_final=max((r.bytes_up - r.bytes_up_final for r in rounds), default=0),  # the steady state: paths' last tasks (which sync every module) left out
        bytes_up_final=sum(r.bytes_up_final for r in rounds),
        bytes_float32=sum(r.bytes_float32 for r in rounds),  # float32 DiLoCo, the same results
        # data parallel on the run's islands, each way: each worker all-reduces a float32 gradient per inner step
        bytes_data_parallel=int(ring_allreduce_bytes(sum(r.bytes_data_parallel for r in rounds), workers)),
        data_parallel_workers=workers,
        outer_steps=[span.to_json() for span in outer_spans(rounds)],  # what each round applied
        module_fallbacks=sum(r.module_fallbacks for r in rounds),  # full module reads in place of updates (compression.download)
        bytes_module_updates=sum(r.downloads.bytes for r in rounds if r.downloads),  # the updates published (one copy)
        download_flush=next((r.downloads.to_json() for r in rounds if r.downloads and r.downloads.flush), None),  # the residual the last version sent, its bytes
        traffic=service.report_traffic(),  # measured at the store: every process's counts (islands stopped: their last)
    )


def _train_on_ray(config: Config, run: RunDir, *, force: bool) -> dict:
    """`launcher.kind=ray`: the coordinator (this stage over the run's config.yaml) and its islands run
    as Ray tasks (`dipaco.islands.launch_ray`); returns train.json as the coordinator wrote it."""
    check(run, config, ("route", "shard", "train"))  # refused here, before any Ray task starts
    save_config(config, run.config)
    root = run.root.resolve()
    args = ["train", "--config", str(root / "config.yaml"), "--run", str(root), *(["--force"] if force else [])]
    launch_ray.run_coordinator(args, address=config.launcher.ray_address, cpus=config.launcher.ray_coordinator_cpus,
                               log_file=run.logs.resolve() / "coordinator.log")
    return json.loads(run.train_summary.read_text())


def _paced_speed(config: Config, *, seq_len: int) -> float | None:
    """An island's failure-free tokens per second where it is known: islands paced to `faults.step_seconds`
    (inner.batch_size x seq_len tokens a step, every data-parallel rank's together); None otherwise (goodput
    by work then takes the median result's speed: `dipaco.store.goodput`)."""
    pace = config.faults.step_seconds
    return config.inner.batch_size * seq_len / pace if pace else None


def _goodput_so_far(rounds: list[RoundStats], *, islands: int, first_beat: float | None,
                    tokens_per_second: float | None) -> float | None:
    """Goodput by work so far: applied tokens of `rounds` / (islands x seconds since the first heartbeat x an
    island's failure-free `tokens_per_second`), as train.json's counts at the end (the coordinator's clock:
    time.monotonic); None before any heartbeat or any speed known."""
    if first_beat is None or not islands or not tokens_per_second:
        return None
    elapsed = time.monotonic() - first_beat
    value = by_work(tokens=sum(r.tokens for r in rounds), seconds=elapsed, islands=islands,
                    tokens_per_second=tokens_per_second)
    return None if math.isnan(value) else value


def code_sessions(sessions: list[dict], code: dict | None, *, first_round: int) -> list[dict]:
    """train.json's `code`: `{"commit", "clean", "first_round"}` of each session that trained rounds with
    other code than the one before (commit and clean None outside a git checkout); a session's entry from
    `first_round` on replaces later ones (a reset store trains them again)."""
    entry = {"commit": None, "clean": None, **(code or {})}
    kept = [s for s in sessions if s.get("first_round", 1) < first_round]
    if kept and (kept[-1].get("commit"), kept[-1].get("clean")) == (entry["commit"], entry["clean"]):
        return kept
    return [*kept, {**entry, "first_round": first_round}]


def resumed_rounds(rounds: list[RoundStats], committed: RoundStats | None, *, done: int) -> list[RoundStats]:
    """train.json's rows for rounds 1..`done`: the rows it holds (a reset store's later rounds dropped),
    plus the last committed round's row from the commit when a crash came before train.json was written."""
    rounds = [r for r in rounds if r.round <= done]
    if committed is not None and committed.round == done and all(r.round != done for r in rounds):
        rounds.append(committed)
    return rounds


def pull_island_tasks(run: RunDir, processes: int) -> list[Task]:
    """`processes` pull-based islands (`dipaco island`, unpinned) named island-0, island-1, ..."""
    return [Task(name=f"island-{i}", log=run.logs / f"island-{i}.log",
                 args=["island", "--config", str(run.config), "--run", str(run.root), "--name", f"island-{i}"])
            for i in range(processes)]


def _tokenizer_fingerprint(factory: PathFactory) -> str:
    from sharding.tokenizer import tokenizer_fingerprint

    return tokenizer_fingerprint(factory.tokenizer)


def _load_summary(path: Path) -> dict:
    """What train.json holds, its rounds as `RoundStats` (no rounds when it does not exist)."""
    if not path.exists():
        return {"rounds": []}
    summary = json.loads(path.read_text())
    summary["rounds"] = [RoundStats.from_json(r, file=str(path), where=f"rounds[{i}]")
                         for i, r in enumerate(summary["rounds"])]
    return summary


def _write_summary(path: Path, summary: dict) -> dict:
    """Write train.json (atomically); returns the summary as written (rounds as JSON objects)."""
    summary = {**summary, "rounds": [r.to_json() for r in summary["rounds"]]}
    atomic.write_json(path, summary)
    return summary


def command_train(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    summary = train(config, run, force=args.force)
    print(f"trained {summary['n_paths']} paths for {summary['rounds_completed']} rounds "
          f"({summary['inner_steps_per_path']} inner steps each, {summary['tokens']:,} tokens) "
          f"in {summary['seconds']:.0f}s; summary in {run.train_summary}")
    print(f"outer steps: {describe_rows(summary['rounds'], file=str(run.train_summary))}")


def command_coordinator(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    summary = train(config, run, local_islands=False, force=args.force)
    print(f"coordinated {summary['rounds_completed']} rounds of {summary['n_paths']} paths "
          f"({summary['tokens']:,} tokens) in {summary['seconds']:.0f}s; summary in {run.train_summary}")
    print(f"outer steps: {describe_rows(summary['rounds'], file=str(run.train_summary))}")
