"""A pull-based island: asks the coordinator for tasks through the store, trains, pushes results.

    dipaco island --config configs/tiny.yaml --run runs/tiny                 # any path
    dipaco island --config configs/tiny.yaml --run runs/tiny --pull --path 3 # pinned to path 3
    dipaco island ... --fail-mtbf 120 --return-after 30                      # with injected failures
    torchrun --nproc-per-node 2 -m dipaco -- island ...                         # DDP inside the island

The island writes only its `Heartbeat` (a background thread bumps `seq` every
`resilience.heartbeat_seconds`; status idle / training / done), its results and its inner optimiser
states (`dipaco.store.board` names the files). It reads the task board, and runs the task assigned
to it (by name and incarnation) that it has not finished yet:

- pull modules at the task's base version and the inner AdamW state the task names (from memory when
  this island wrote it, from the store otherwise: that is how inner state moves between islands);
- train `inner.steps` steps on the path's shard, continuing its data order and learning-rate
  schedule at the task's `step_offset` (after the warm start's steps under `inner.schedule: wsd`);
- upload the inner state, then the pseudo-gradient Δ = θ_base − θ_end compressed per
  `compression.codec`, then the result JSON (the commit), with the bytes it moved.

While it trains in async mode it looks at the board at most every `resilience.heartbeat_seconds` (between
inner steps, in the training thread; `result_wanted`): when the board no longer holds its task open or
assigned — the coordinator cancelled it because its result could no longer be applied
(`RoundPolicy.cancel`), or it was lost and replaced, or another attempt's result was taken — it stops
at once without uploading, deletes its inner checkpoint (the task can never be resumed), heart-beats
idle and asks for work. Sync mode never cancels and never looks (a DDP island does not look either:
its other ranks would wait in the step's all-reduce; it trains a cancelled task to the end, and the
coordinator ignores the result).

It stops when the store has committed the run's last round. In Python (the `dipaco island` stage
builds the `IslandSetup` from the config):

    setup = IslandSetup(store=store, topology=topology, spec=spec, reader=reader, inner=cfg.inner,
                        compression=cfg.compression, hardware=cfg.hardware, run=cfg.run, resilience=cfg.resilience)
    IslandWorker(setup, name="island-0").run()          # or, once: run_pinned_task(setup, path=3, island="x")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from dipaco.config import CompressionConfig, HardwareConfig, InnerConfig, ResilienceConfig, RunConfig
from dipaco.device import resolve_device
from dipaco.eval.early_stopping import ValidationData
from dipaco.islands import ddp as ddp_mod
from dipaco.islands.checkpoint import InnerCheckpoint, task_identity, task_path_of
from dipaco.islands.faults import FaultClock, IslandFailure, no_faults
from dipaco.islands.model_slot import ModelSlot
from dipaco.model.path_model import PathSpec, path_parameters
from dipaco.model.topology import Topology
from dipaco.optim.inner import (
    load_optimizer_state,
    make_optimizer,
    optimizer_state,
    phase_steps,
    train_steps,
)
from dipaco.optim.prefetch import Prefetcher
from dipaco.store.board import (
    inner_exists,
    inner_ref,
    read_board,
    read_inner,
    read_result_meta,
    result_exists,
    write_heartbeat,
    write_inner,
    write_result,
)
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Board, Heartbeat, PathState, ResultMeta, Task
from dipaco.store.run_state import first_inner, run_finished
from sharding.reader import ShardReader

log = logging.getLogger(__name__)

InnerState = tuple[dict[str, torch.Tensor], dict]  # an AdamW state: tensors and metadata (dipaco.optim.inner)


@dataclass(frozen=True)
class IslandSetup:
    """What an island needs to train paths: the store, the grid, the shape of a path model, the shards,
    and the settings it reads from the config."""

    store: ModuleStore
    topology: Topology
    spec: PathSpec
    reader: ShardReader
    inner: InnerConfig  # steps, batch size, AdamW, validation batches
    compression: CompressionConfig  # how it uploads pseudo-gradients
    hardware: HardwareConfig  # device, precision, compile, TF32
    run: RunConfig  # rounds (the lr schedule's length), seed (data order)
    resilience: ResilienceConfig  # heartbeats, inner checkpoints
    cancellable: bool = False  # watch the board for the cancellation of its task (rounds.mode async)
    slowdown: float = 1.0  # an injected straggler: every inner step takes this many times longer (faults.slowdown)
    checkpoints: Path | None = None  # local folder of the islands' inner checkpoints (resilience.checkpoint_steps)
    warm_start_steps: int = 0  # steps of the dense warm start the paths continue (`inner.schedule: wsd` counts on from them)
    models: ModelSlot = field(default_factory=ModelSlot, compare=False, repr=False)  # the path model tasks reuse

    @cached_property
    def validation(self) -> ValidationData:
        """Each path's validation batches (read once per island)."""
        return ValidationData(reader=self.reader, batch_size=self.inner.batch_size,
                              max_batches=self.inner.val_batches, precision=self.hardware.precision)


class TaskCancelled(RuntimeError):
    """Raised inside an island's inner loop when the board no longer wants its task's result."""


def result_wanted(board: Board | None, task: Task) -> bool:
    """Could the coordinator still take `task`'s result? Only while its board holds the task open or
    assigned (any attempt: a late result of an older attempt is taken too); not when it is cancelled,
    lost or received from another attempt, nor when it has left a board newer than the task (one
    written at version `task.base` may predate it). No board: yes (nothing to go by)."""
    if board is None:
        return True
    held = board.tasks.get(task.key)
    if held is None:
        return board.round <= task.base
    return held.status in ("open", "assigned")


@dataclass(frozen=True)
class TrainedTask:
    """One task's outcome before it is uploaded."""

    pseudo_gradient: dict[str, torch.Tensor]  # "module/param" -> θ_base − θ_end
    inner: InnerState  # the AdamW state after the task
    meta: ResultMeta  # without the upload fields (island, bytes, ...)


def data_seed(seed: int, *, path: int) -> int:
    """One data order per path for the whole run (tasks continue it, so each epoch is exact)."""
    return seed * 1_000_003 + path * 7919 + 17


def train_task(setup: IslandSetup, task: Task, *, ctx: ddp_mod.DDPContext | None = None,
               cached_inner: tuple[str, dict, dict] | None = None,
               check: Callable[[], None] | None = None, timings: dict[str, float] | None = None,
               checkpoint: Path | None = None) -> TrainedTask:
    """Run one task's inner steps; returns the pseudo-gradient, its metadata and the new inner state.

    `checkpoint`: the island's inner checkpoint file (`dipaco.islands.checkpoint`), resumed from when it
    holds this task and written every `resilience.checkpoint_steps` steps (not inside a DDP island).
    `setup.slowdown` F > 1 sleeps (F − 1) × each step's time after it (an injected straggler).
    `timings`, when given, receives the seconds of each phase (`PHASES`; bench/bench_speed.py)."""
    store, inner, hardware, resilience = setup.store, setup.inner, setup.hardware, setup.resilience
    read_before = store.bytes_read
    device = _device(hardware, ctx)
    path = task.path
    with _timed(timings, "load_modules", device):
        start = store.read_modules(task.base, setup.topology.modules_of_path(path))
        module_bytes = store.bytes_read - read_before
        model, trained = setup.models.load(start, spec=setup.spec, device=device, compile=hardware.compile,
                                           wrap=(lambda m: ddp_mod.wrap(m, device)) if ctx is not None else None)
    params = path_parameters(model)
    names = {param: name for name, param in params.items()}
    if ctx is not None or not resilience.checkpoint_steps:
        checkpoint = None
    resume = InnerCheckpoint.load(checkpoint) if checkpoint is not None else None
    if resume is not None and not resume.matches(task):
        resume = None  # another task's: this one starts afresh and replaces it
    with _timed(timings, "restore_inner", device):
        optimizer = make_optimizer(model, inner, fused=inner.fused)
        inner_local = False
        if resume is not None:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(resume.params[name])
            load_optimizer_state(optimizer, params, resume.adam, resume.adam_meta)
        elif task.inner_from:
            if cached_inner is not None and cached_inner[0] == task.inner_from:
                saved, inner_local = cached_inner[1:], True
            else:
                saved = read_inner(store, task.inner_from)
            load_optimizer_state(optimizer, params, *saved)
    done = resume.steps if resume is not None else 0
    if resume is not None:
        log.info("%s: resuming from the inner checkpoint after %d of %d steps", task.key, done, inner.steps)

    last_seconds = 0.0  # inner-loop seconds at the end of the previous step (slowdown included)
    saving = 0.0  # seconds spent writing inner checkpoints: overhead, not training (docs/islands.md#goodput)

    def after_step(steps: int, losses: torch.Tensor, seconds: float, tokens: int) -> None:
        nonlocal last_seconds, saving
        seconds -= saving
        if setup.slowdown > 1:  # an injected straggler: each step takes slowdown x its time
            time.sleep((setup.slowdown - 1) * (seconds - last_seconds))
            seconds += (setup.slowdown - 1) * (seconds - last_seconds)
        last_seconds = seconds
        if checkpoint is not None and (done + steps) % resilience.checkpoint_steps == 0 and done + steps < inner.steps:
            save_started = time.perf_counter()
            adam, adam_meta = optimizer_state(optimizer, names)
            InnerCheckpoint(task=task_identity(task), steps=done + steps,
                            params={name: p.detach().cpu().clone() for name, p in params.items()},
                            adam=adam, adam_meta=adam_meta,
                            losses=(resume.losses if resume else ()) + tuple(losses.tolist()),
                            tokens=(resume.tokens if resume else 0) + tokens,
                            seconds=(resume.seconds if resume else 0.0) + seconds,
                            val_loss_start=val_loss).save(checkpoint)
            saving += time.perf_counter() - save_started

    batches: Iterator[np.ndarray] = setup.reader.iter_batches(path, "train", batch_size=inner.batch_size,
                                                              seed=data_seed(setup.run.seed, path=path),
                                                              skip_batches=task.step_offset + done)
    if ctx is not None:
        batches = ddp_mod.shard_batches(batches, ctx, batch_size=inner.batch_size)
    with Prefetcher(batches, count=inner.steps - done, device=device) as ahead:  # reads the shard during validation
        with _timed(timings, "validation", device):
            val_loss = resume.val_loss_start if resume is not None else setup.validation.loss(model, path=path)
        with _timed(timings, "inner_loop", device):
            first, total = phase_steps(inner, steps=setup.run.rounds * inner.steps, after=setup.warm_start_steps)
            stats = train_steps(trained, optimizer, _checked(_waited(ahead, timings), check),
                                start_step=first + task.step_offset + done, steps=inner.steps - done,
                                total_steps=total, config=inner, device=device,
                                precision=hardware.precision,
                                after_step=after_step if checkpoint is not None or setup.slowdown > 1 else None)
    setup.models.release_gradients()
    losses = stats["losses"]
    tokens, seconds = stats["tokens"], stats["seconds"] - saving
    if resume is not None:
        losses, tokens, seconds = list(resume.losses) + losses, resume.tokens + tokens, resume.seconds + seconds
    train_loss = sum(losses[-5:]) / len(losses[-5:])
    if ctx is not None:
        train_loss = ddp_mod.all_mean(ctx, train_loss)
        tokens *= ctx.world
    with _timed(timings, "pseudo_gradient", device):
        pseudo_gradient = pseudo_gradient_of(start, params, setup.topology, path=path)
    meta = ResultMeta(path=path, round=task.round, base=task.base, attempt=task.attempt, tokens=tokens,
                      train_loss=train_loss, losses=tuple(losses), val_loss_start=val_loss, seconds=seconds,
                      bytes_down_modules=module_bytes, bytes_down_inner=store.bytes_read - read_before - module_bytes,
                      inner_state_local=inner_local, data_parallel_ranks=ctx.world if ctx else 1)
    with _timed(timings, "save_inner", device):
        saved_inner = optimizer_state(optimizer, names)
    return TrainedTask(pseudo_gradient=pseudo_gradient, inner=saved_inner, meta=meta)


def pseudo_gradient_of(start: dict[str, dict[str, torch.Tensor]], params: dict[str, torch.nn.Parameter],
                       topology: Topology, *, path: int) -> dict[str, torch.Tensor]:
    """Δ = θ_base − θ_end as `{"module/param": tensor}` (CPU float32), computed in place in the base
    tensors `start` (`{module: {param: tensor}}`, consumed): no copy of the trained parameters on the
    CPU, one device-to-host copy each from a GPU. Ordered module by module, as `split_into_modules`."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in params.items():
        module = topology.module_of_param(name, path)
        grouped.setdefault(module, {})[name] = start[module][name].sub_(param.detach().float().cpu())
    return {f"{module}/{name}": delta for module, tensors in grouped.items() for name, delta in tensors.items()}


def push_result(setup: IslandSetup, task: Task, out: TrainedTask, *, island: str,
                timings: dict[str, float] | None = None) -> tuple[ResultMeta, dict, str]:
    """Upload a trained task: its inner state, then the compressed pseudo-gradient, then the result
    metadata (the commit). Returns (the metadata as written, compression stats, the inner state's reference)."""
    ref = inner_ref(path=task.path, round=task.round, attempt=task.attempt)
    with _timed(timings, "write_inner"):
        inner_bytes = write_inner(setup.store, ref, *out.inner)
    meta = dataclasses.replace(out.meta, island=island, bytes_up_inner=inner_bytes, finished=time.time())
    with _timed(timings, "write_result"):
        meta, stats = write_result(setup.store, task, out.pseudo_gradient, meta, compression=setup.compression.codec,
                                   level=setup.compression.zstd_level)
    return meta, stats, ref


def run_pinned_task(setup: IslandSetup, *, path: int, island: str) -> ResultMeta:
    """Train `path` once for the next round, outside the board's assignment (`dipaco island --path P`).

    It runs the task the coordinator opens for that path (attempt 0, continuing the path's data order
    and inner state), so the coordinator picks the result up; a result already there is not redone."""
    store = setup.store
    committed = store.current_round()
    if run_finished(store):
        raise ValueError(f"the run in {store.url} is finished (every path has had run.rounds = "
                         f"{setup.run.rounds} results applied); nothing to train")
    if result_exists(store, round=committed + 1, path=path, attempt=0):
        log.info("round %d path %d already has a result; nothing to do", committed + 1, path)
        return read_result_meta(store, round=committed + 1, path=path, attempt=0)
    board = read_board(store)
    state = board.paths.get(path) if board else None
    if state is None:  # no coordinator has run: the path has trained every committed round
        previous = inner_ref(path=path, round=committed, attempt=0)
        state = PathState(steps_done=committed * setup.inner.steps,
                          inner=previous if inner_exists(store, previous) else
                          first_inner(store) if committed == 0 else None)
    task = Task.open(path=path, base=committed, step_offset=state.steps_done, inner_from=state.inner)
    meta, _, _ = push_result(setup, task, train_task(setup, task), island=island)
    return meta


# The phases `train_task` and `push_result` time when asked (`timings`); "shard_read" is the part of
# "inner_loop" the training thread spent waiting for the next batch (read ahead by `Prefetcher`).
PHASES = ("load_modules", "restore_inner", "validation", "inner_loop", "shard_read", "pseudo_gradient",
          "save_inner", "write_inner", "write_result")


@contextlib.contextmanager
def _timed(timings: dict[str, float] | None, phase: str, device: torch.device | None = None) -> Iterator[None]:
    """Add the block's wall time to `timings[phase]` and this process's CPU time to `timings[phase + ".cpu"]`
    (nothing when `timings` is None); on CUDA the device is synchronised at both ends, so queued kernels
    count in the phase that queued them."""
    if timings is None:
        yield
        return
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    _sync(device)
    timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - wall
    timings[f"{phase}.cpu"] = timings.get(f"{phase}.cpu", 0.0) + time.process_time() - cpu


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(hardware: HardwareConfig, ctx: ddp_mod.DDPContext | None) -> torch.device:
    """The device this island (or DDP rank) trains on; on CUDA, fp32 matmuls on TF32 as `hardware.tf32` says."""
    device = resolve_device(hardware.device)
    if ctx is not None:
        device = ddp_mod.local_device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = hardware.tf32
    return device


def _waited(batches: Iterator[torch.Tensor], timings: dict[str, float] | None) -> Iterator[torch.Tensor]:
    """`batches`, the time spent waiting for each added to `timings["shard_read"]`."""
    if timings is None:
        yield from batches
        return
    while True:
        with _timed(timings, "shard_read"):
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def _checked(batches: Iterator[torch.Tensor], check: Callable[[], None] | None) -> Iterator[torch.Tensor]:
    """`batches`, calling `check` (fault injection) before each, in the training thread."""
    for batch in batches:
        if check is not None:
            check()
        yield batch


class IslandWorker:
    def __init__(self, setup: IslandSetup, *, name: str, pinned: list[int] | None = None,
                 clock: Callable[[], float] = time.monotonic, faults: FaultClock | None = None,
                 ctx: ddp_mod.DDPContext | None = None):
        self.setup, self.store = setup, setup.store
        self.name, self.pinned, self.clock = name, sorted(pinned or []), clock
        self.faults = faults or no_faults()
        self.ctx = ctx
        self.incarnation = uuid.uuid4().hex[:12]
        self.seq = 0
        self.status = "idle"
        self.current: str | None = None
        self.last_path: int | None = None
        self.finished: list[str] = []  # "key#attempt" of tasks this incarnation completed
        self.cached_inner: tuple[str, dict, dict] | None = None
        self.silent = False  # failed: no heartbeats
        self.down_until: float | None = None
        self.tasks_done = 0
        self.checkpoint = (setup.checkpoints / f"{name}.safetensors"
                           if setup.checkpoints is not None and setup.resilience.checkpoint_steps else None)
        self.resumed: list[tuple[str, int]] = []  # (task key, steps) of the tasks resumed from the checkpoint
        self.cancelled: list[str] = []  # "key#attempt" of the tasks it stopped because the board no longer wanted them
        self._ask_for_checkpointed_path()
        self._lock = threading.Lock()

    # --- heartbeats ------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        if self.silent:
            return
        with self._lock:
            self.seq += 1
            write_heartbeat(self.store, Heartbeat(
                island=self.name, incarnation=self.incarnation, seq=self.seq, status=self.status,
                task=self.current, pinned=tuple(self.pinned), last_path=self.last_path,
                finished=tuple(self.finished[-8:]), time=time.time(), failures=self.faults.failures))

    # --- work --------------------------------------------------------------------------------------
    def next_task(self) -> Task | None:
        board = read_board(self.store)
        if board is None:
            return None
        for task in sorted(board.tasks.values(), key=lambda t: (t.base, t.path)):
            if (task.status == "assigned" and task.island == self.name and task.incarnation == self.incarnation
                    and f"{task.key}#{task.attempt}" not in self.finished):
                return task
        return None

    def execute(self, task: Task) -> ResultMeta | None:
        """Train `task` and push its result; None when an injected failure killed it or the board stopped
        wanting its result (`result_wanted`)."""
        self.status, self.current = "training", task.key
        self.heartbeat()
        if self.ctx is not None:
            ddp_mod.broadcast(self.ctx, task)
        saved = InnerCheckpoint.load(self.checkpoint) if self.checkpoint is not None else None
        if saved is not None and saved.matches(task):
            self.resumed.append((task.key, saved.steps))
        watch = self._watch(task)

        def check() -> None:
            self._check_faults()
            watch()

        try:
            out = train_task(self.setup, task, ctx=self.ctx, cached_inner=self.cached_inner, check=check,
                             checkpoint=self.checkpoint)
        except IslandFailure:
            self._go_down()
            return None
        except TaskCancelled as why:
            self._drop(task, str(why))
            return None
        except StoreError as err:  # e.g. its base version pruned: moot when the task was cancelled meanwhile
            if self._wanted(task):
                raise
            self._drop(task, f"{err}; the board no longer wants it")
            return None
        meta, stats, ref = push_result(self.setup, task, out, island=self.name)
        if self.checkpoint is not None:
            self.checkpoint.unlink(missing_ok=True)  # the result is in the store
        self.cached_inner = (ref, *out.inner)
        self.finished.append(f"{task.key}#{task.attempt}")
        self.last_path, self.status, self.current = task.path, "idle", None
        self.tasks_done += 1
        self.heartbeat()
        log.info("island %s: %s attempt %d done in %.1fs, loss %.3f, %d bytes up (%s)", self.name, task.key,
                 task.attempt, meta.seconds, meta.train_loss, meta.bytes, meta.compression)
        return meta

    def poll(self) -> bool:
        """One look at the board (running the assigned task, if any); True when a task ran."""
        if self.down_until is not None:
            if self.clock() < self.down_until:
                return False
            self.down_until, self.silent = None, False
            self._ask_for_checkpointed_path()
            log.warning("island %s is back as incarnation %s", self.name, self.incarnation)
        if self.faults.due():
            self.faults.fail()
            if self.faults.mode == "die":
                self._go_down()
                return False
        self.heartbeat()
        task = self.next_task()
        if task is None:
            return False
        return self.execute(task) is not None

    def _wanted(self, task: Task) -> bool:
        try:
            return result_wanted(read_board(self.store), task)
        except StoreError as err:  # a transient read error must not stop training
            log.warning("island %s: cannot read the board (%s); %s goes on", self.name, err, task.key)
            return True

    def _watch(self, task: Task) -> Callable[[], None]:
        """The check, before each inner step, that the board still wants `task`'s result: it reads the
        board at most every `resilience.heartbeat_seconds` (island clock), in async mode only (sync never
        cancels), not in a DDP island (its ranks would part ways); raises `TaskCancelled`."""
        if not self.setup.cancellable or self.ctx is not None:
            return lambda: None
        every, last = self.setup.resilience.heartbeat_seconds, self.clock()

        def watch() -> None:
            nonlocal last
            now = self.clock()
            if now - last < every:
                return
            last = now
            if not self._wanted(task):
                raise TaskCancelled(f"{task.key} attempt {task.attempt}: the board no longer wants its result")

        return watch

    def _drop(self, task: Task, why: str) -> None:
        """Stop `task` without a result: its inner checkpoint goes (it can never be resumed), then idle."""
        if self.checkpoint is not None:
            self.checkpoint.unlink(missing_ok=True)
        self.setup.models.release_gradients()
        self.cancelled.append(f"{task.key}#{task.attempt}")
        self.status, self.current = "idle", None
        self.heartbeat()
        log.warning("island %s: stopped %s (%s); asking for work", self.name, task.key, why)

    def _check_faults(self) -> None:
        if not self.faults.due():
            return
        away = self.faults.fail()
        if self.faults.mode == "die":
            raise IslandFailure(f"island {self.name}: injected failure")
        self.silent = True  # stall: the island hangs, then carries on
        time.sleep(away)
        self.silent = False

    def _ask_for_checkpointed_path(self) -> None:
        """A (re)started island with an inner checkpoint reports its path as the one it trained last, so
        the coordinator hands it that path's task first (it resumes when the task is the same)."""
        if self.checkpoint is not None:
            path = task_path_of(self.checkpoint)
            if path is not None:
                self.last_path = path

    def _go_down(self) -> None:
        """An injected death: silent for `return_after`, then a new incarnation with nothing cached."""
        self.silent = True
        self.down_until = self.clock() + self.faults.return_after
        self.incarnation = uuid.uuid4().hex[:12]
        self.status, self.current, self.last_path, self.cached_inner = "idle", None, None, None
        self.finished = []

    # --- the long-running loop ---------------------------------------------------------------------
    def run(self, *, poll_seconds: float = 0.1, max_tasks: int | None = None) -> int:
        """Work until the run's last round is committed (`run_finished`, or `max_tasks` are done); returns
        tasks done."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.setup.resilience.heartbeat_seconds):
                try:
                    self.heartbeat()
                except Exception as err:  # a transient store error must not kill the island
                    log.warning("island %s: heartbeat failed: %s", self.name, err)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            while not run_finished(self.store):
                if max_tasks is not None and self.tasks_done >= max_tasks:
                    break
                if not self.poll():
                    time.sleep(poll_seconds)
        finally:
            stop.set()
            self.status = "done"
            self.heartbeat()
            if self.ctx is not None:
                ddp_mod.broadcast(self.ctx, None)
        return self.tasks_done


def follow_leader(setup: IslandSetup, ctx: ddp_mod.DDPContext) -> int:
    """A non-zero DDP rank: train whatever task rank 0 broadcasts, until it broadcasts None."""
    done = 0
    while (task := ddp_mod.broadcast(ctx, None)) is not None:
        train_task(setup, task, ctx=ctx)
        done += 1
    return done
