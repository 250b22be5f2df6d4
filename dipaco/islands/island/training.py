"""The island's training loop: one task's inner steps from its base modules, then its upload.

    meta, stats, ref = push_result(setup, task, train_task(setup, task, held=held), island="island-0")

A task is three named steps. `start_task` pulls the task's modules at its base version (from the
modules the island holds and the published updates, `held_modules`, with `compression.download: update`), starts from
θ_start = the base modules minus the Δ of its path's results that version does not hold yet (`Task.chain`,
async: the path goes on from its own latest parameters, merged with the newest version by this rebase),
and restores the path's carried state (`dipaco.carried.state`: AdamW moments, error-feedback residual,
drift) from the island's memory when it trained the path last, else from the store (`held.fetch_carried`).
`run_steps` scores the base version on validation and trains the task's steps on the path's shard,
continuing its data order and lr schedule at `step_offset` (fewer when the board cuts it). `finish_task`
returns the pseudo-gradient Δ = θ_start − θ_end with its metadata and the path's new carried state.
`push_result` uploads the carried state only when `UploadPlan` says so (a checkpoint every
`resilience.inner_checkpoint_every` tasks, the path's last task, a hand-off), then Δ compressed per
`compression.codec`, then the result JSON (the commit).

With fragments (`outer.fragments` K > 1, `dipaco.rounds.fragments`) a task sends only the modules its round
syncs (every module in the path's last task). Its path keeps training the others: their drift
d = θ_base − θ_end stays in the path's carried state (`dipaco.optim.drift`), and the path's next task starts
each module from its base − d (after scoring the base version on validation), so what a module sends when
its round comes holds all the training since its last sync.

With error feedback (`compression.codec: topk`, `compression.error_feedback`) the task also continues the
path's residual e from its carried state (or its inner checkpoint) and ends by encoding Δ + e: the residual
of that encoding is carried on with the path (`dipaco.codec.feedback`), and `push_result` uploads the
bytes it encoded; a module not sent keeps its residual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from dipaco.carried.state import MOMENTS_OF, CarriedState, UploadPlan
from dipaco.codec.codec import Codec
from dipaco.codec.feedback import encode_with_feedback, with_residual
from dipaco.config import CompressionConfig, HardwareConfig, InnerConfig, ResilienceConfig, RunConfig
from dipaco.device import resolve_device
from dipaco.eval.early_stopping import ValidationData
from dipaco.islands.island import ddp as ddp_mod
from dipaco.islands.island import elastic
from dipaco.islands.island.cancellation import TaskCut
from dipaco.islands.island.checkpoint import InnerCheckpoint, task_identity
from dipaco.islands.island.held import HeldState, fetch_carried
from dipaco.islands.island.held_modules import HeldModules
from dipaco.islands.island.model_slot import ModelSlot
from dipaco.islands.island.pacing import Pacer
from dipaco.islands.island.timing import checked, timed, waited
from dipaco.islands.update_codec import download_codec
from dipaco.model.path_model import PathSpec, path_parameters
from dipaco.model.topology import Topology
from dipaco.optim.drift import split_sent
from dipaco.optim.error_feedback import residual_bytes
from dipaco.optim.inner import make_optimizer, optimizer_state, phase_steps, train_steps
from dipaco.optim.prefetch import Prefetcher
from dipaco.rounds.fragments import FragmentSchedule
from dipaco.rounds.inputs import Grid
from dipaco.store.board import inner_ref, read_result_ref, result_file, write_encoded_result, write_inner
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ResultMeta, Task
from sharding.reader import ShardReader

log = logging.getLogger(__name__)

Parallel = ddp_mod.DDPContext | elastic.ElasticContext | None  # data parallelism inside the island

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
    step_seconds: float = 0.0  # pad every inner step to this wall time by sleeping (faults.step_seconds; 0 = off)
    checkpoints: Path | None = None  # local folder of the islands' inner checkpoints (resilience.checkpoint_steps)
    warm_start_steps: int = 0  # steps of the dense warm start the paths continue (`inner.schedule: wsd` counts on from them)
    fragments: int = 1  # outer.fragments: a task sends the modules of its round's fragment (1: every module)
    private_local: bool = False  # outer.private_modules local: the path's private modules are sent by its last task only
    models: ModelSlot = field(default_factory=ModelSlot, compare=False, repr=False)  # the path model tasks reuse

    @cached_property
    def validation(self) -> ValidationData:
        """Each path's validation batches (read once per island)."""
        return ValidationData(reader=self.reader, batch_size=self.inner.batch_size,
                              max_batches=self.inner.val_batches, precision=self.hardware.precision)

    @property
    def uploads(self) -> UploadPlan:
        """When the path's carried state is uploaded (`resilience.inner_checkpoint_every`)."""
        return UploadPlan(every=self.resilience.inner_checkpoint_every, inner_steps=self.inner.steps,
                          total_steps=self.run.rounds * self.inner.steps)

    @cached_property
    def schedule(self) -> FragmentSchedule:
        """Which modules each task sends (`outer.fragments`, `outer.private_modules`; the module sizes read once
        from the store when K > 1)."""
        return FragmentSchedule.of(count=self.fragments, sizes=lambda: self.store.module_sizes(self.topology.modules),
                                   paths=Grid.of(self.topology).modules, inner_steps=self.inner.steps,
                                   rounds=self.run.rounds, private_local=self.private_local)

    def codec_of(self, task: Task) -> str:
        """The codec `task`'s pseudo-gradient travels in: `compression.codec`, or for the path's last task
        `compression.last_task`'s (float32: nothing it trained, residual or drift, stays on the island)."""
        last_task = self.compression.last_task
        if last_task == "codec" or not self.schedule.last(step_offset=task.step_offset, steps=task.steps):
            return self.compression.codec
        return "none" if last_task == "float32" else last_task


@dataclass(frozen=True)
class TrainedTask:
    """One task's outcome before it is uploaded."""

    pseudo_gradient: dict[str, torch.Tensor]  # "module/param" -> θ_base − θ_end of the modules it sends (+ the residual it started from, with error feedback)
    carried: CarriedState  # the path's carried state after the task (moments, new residual, drift of the modules not sent)
    meta: ResultMeta  # without the upload fields (island, bytes, ...)
    encoded: tuple[bytes, dict] | None = None  # with error feedback: the compressed pseudo-gradient and its stats
    codec: str = "none"  # the codec its pseudo-gradient travels in (`IslandSetup.codec_of`)


def data_seed(seed: int, *, path: int) -> int:
    """One data order per path for the whole run (tasks continue it, so each epoch is exact)."""
    return seed * 1_000_003 + path * 7919 + 17


@dataclass
class TaskStart:
    """A task at its first inner step: its model and optimizer, and what it continues."""

    start: dict[str, dict[str, torch.Tensor]]  # θ_start by module (base − chain); consumed by `pseudo_gradient_of`
    model: torch.nn.Module
    trained: torch.nn.Module  # what the steps run on (the model, or its DDP wrapper)
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    carried: CarriedState  # the path's carried state at the task's start (residual and drift used at the end)
    local: bool  # ... from the island's memory
    refused: str  # why the stored carried state was refused, so it started fresh ("": it was not)
    resume: InnerCheckpoint | None  # the island's inner checkpoint of this task, when it resumes one
    device: torch.device
    read_before: int  # the store's bytes read before the task
    module_bytes: int  # ... of which its modules
    fallbacks: int = 0  # modules read whole in place of their updates (`held_modules`)


def train_task(setup: IslandSetup, task: Task, *, ctx: Parallel = None,
               held: HeldState | None = None, check: Callable[[], None] | None = None,
               timings: dict[str, float] | None = None, checkpoint: Path | None = None,
               modules: HeldModules | None = None) -> TrainedTask:
    """Run one task's inner steps; returns the pseudo-gradient, its metadata and the path's new carried state.

    Three steps: `start_task` (modules, rebase, carried state: from `held` when this island holds it),
    `run_steps` (validation, then the inner steps), `finish_task` (Δ, error feedback, metadata).
    `checkpoint`: the island's inner checkpoint file (`checkpoint.InnerCheckpoint`), resumed from when it
    holds this task and written every `resilience.checkpoint_steps` steps (not inside a DDP island).
    `timings`, when given, receives the seconds of each phase (`timing.PHASES`; bench/bench_speed.py).
    `modules`: the path's modules this island (or DDP rank) holds, brought to the task's base version by the
    published updates (`held_modules`); None: read whole."""
    if ctx is not None or not setup.resilience.checkpoint_steps:
        checkpoint = None
    begun = start_task(setup, task, ctx=ctx, held=held, timings=timings, checkpoint=checkpoint, modules=modules)
    stats, val_loss = run_steps(setup, task, begun, ctx=ctx, check=check, timings=timings, checkpoint=checkpoint)
    return finish_task(setup, task, begun, stats, val_loss=val_loss, ctx=ctx, timings=timings)


def start_task(setup: IslandSetup, task: Task, *, ctx: Parallel, held: HeldState | None,
               timings: dict[str, float] | None, checkpoint: Path | None,
               modules: HeldModules | None = None) -> TaskStart:
    """Pull the task's modules at its base version, rebase them on its chain, load them into the path model,
    and restore the optimizer: from the island's inner checkpoint of this task, else the path's carried state."""
    store, hardware = setup.store, setup.hardware
    read_before = store.bytes_read
    device = _device(hardware, ctx)
    with timed(timings, "load_modules", device):
        start, fallbacks = fetch_modules(setup, task, modules)
        module_bytes = store.bytes_read - read_before
        rebase_on_chain(store, start, task)
        model, trained = setup.models.load(start, spec=setup.spec, device=device, compile=hardware.compile,
                                           wrap=(lambda m: ddp_mod.wrap(m, device)) if isinstance(ctx, ddp_mod.DDPContext) else None)
    params = path_parameters(model)
    resume = InnerCheckpoint.load(checkpoint) if checkpoint is not None else None
    if resume is not None and not resume.matches(task):
        resume = None  # another task's: this one starts afresh and replaces it
    shapes = residual_shapes(params, setup.topology, path=task.path)
    max_step, betas = setup.warm_start_steps + task.step_offset, (setup.inner.beta1, setup.inner.beta2)
    refused = ""  # why the stored carried state was refused ("": it was not)
    with timed(timings, "restore_inner", device):
        optimizer = make_optimizer(model, setup.inner, fused=setup.inner.fused)
        if resume is not None:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(resume.params[name])
            carried, where, local = CarriedState(adam=resume.adam, steps=resume.adam_meta["step"],
                                                 residual=resume.residual), f"inner checkpoint {checkpoint}", False
            log.info("%s: resuming from the inner checkpoint after %d steps", task.key, resume.steps)
            carried.check(shapes, where=where, max_step=max_step + resume.steps, betas=betas)
        else:
            carried, where, local, refused = fetch_carried(store, task, held=held, shapes=shapes, max_step=max_step,
                                                           betas=betas)
        if not setup.compression.feeds_back:
            carried = dataclasses.replace(carried, residual={})
        carried.load_into(optimizer, params)
    return TaskStart(start=start, model=model, trained=trained, params=params, optimizer=optimizer, carried=carried,
                     local=local, refused=refused, resume=resume, device=device, read_before=read_before,
                     module_bytes=module_bytes, fallbacks=fallbacks)


def fetch_modules(setup: IslandSetup, task: Task,
                  held: HeldModules | None) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """The task's path's modules at its base version (copies: `rebase_on_chain` changes them) and the fallbacks
    taken: from the `held` modules and the published updates (`compression.download: update`), else read whole."""
    names = setup.topology.modules_of_path(task.path)
    codec = download_codec(setup.compression)
    if codec is None or held is None:
        return setup.store.read_modules(task.base, names), 0
    return held.fetch(setup.store, version=task.base, names=names, codec=codec)


def run_steps(setup: IslandSetup, task: Task, begun: TaskStart, *, ctx: Parallel,
              check: Callable[[], None] | None, timings: dict[str, float] | None,
              checkpoint: Path | None) -> tuple[dict, float]:
    """Score the base version on validation, start from its drift, and train the task's steps on the path's
    shard (continuing its data order and lr schedule); returns (train_steps' stats, the validation loss).
    Each step is paced (`pacing.Pacer`): padded to `setup.step_seconds`, then `setup.slowdown` times its time."""
    inner, resume, device = setup.inner, begun.resume, begun.device
    done = resume.steps if resume is not None else 0
    steps = task.steps or inner.steps
    pacer = Pacer(step_seconds=setup.step_seconds, slowdown=setup.slowdown)
    saver = StepSaver(setup, task, begun, checkpoint=checkpoint, steps=steps, pacer=pacer, check=check)
    batches: Iterator[np.ndarray] = setup.reader.iter_batches(task.path, "train", batch_size=inner.batch_size,
                                                              seed=data_seed(setup.run.seed, path=task.path),
                                                              skip_batches=task.step_offset + done)
    if isinstance(ctx, ddp_mod.DDPContext):
        batches = ddp_mod.shard_batches(batches, ctx, batch_size=inner.batch_size)
    prefetch = (contextlib.nullcontext(batches) if isinstance(ctx, elastic.ElasticContext)  # steps are retried
                else Prefetcher(batches, count=steps - done, device=device))
    with prefetch as ahead:  # reads the shard during validation
        with timed(timings, "validation", device):
            saver.val_loss = (resume.val_loss_start if resume is not None else math.nan if task.chain else
                              setup.validation.loss(begun.model, path=task.path))  # of version `base` only
        if begun.carried.drift:
            start_from_drift(begun.params, begun.carried.drift, setup.topology, path=task.path)
        with timed(timings, "inner_loop", device):
            first, total = phase_steps(inner, steps=setup.run.rounds * inner.steps, after=setup.warm_start_steps)
            if isinstance(ctx, elastic.ElasticContext):
                stats = elastic.elastic_steps(ctx, begun.model, begun.optimizer, ahead, task=task.key,
                                              params=begun.params, start_step=first + task.step_offset, steps=steps,
                                              total_steps=total, config=inner, device=device,
                                              precision=setup.hardware.precision, check=check,
                                              after_step=saver.after_step if pacer.active else None)
            else:
                stats = train_steps(begun.trained, begun.optimizer, checked(waited(ahead, timings), check, stop=TaskCut),
                                    start_step=first + task.step_offset + done, steps=steps - done,
                                    total_steps=total, config=inner, device=device, precision=setup.hardware.precision,
                                    after_step=saver.after_step if checkpoint is not None or pacer.active else None)
    setup.models.release_gradients()
    if pacer.active:
        log.info("%s: %s", task.key, pacer.summary())
    stats["seconds"] -= saver.saving
    return stats, saver.val_loss


@dataclass
class StepSaver:
    """After each inner step: pad it to its paced time, and write the island's inner checkpoint every
    `resilience.checkpoint_steps` steps (the seconds that takes are overhead, not training: docs/islands.md#goodput)."""

    setup: IslandSetup
    task: Task
    begun: TaskStart
    checkpoint: Path | None
    steps: int  # the task's steps
    pacer: Pacer
    check: Callable[[], None] | None
    val_loss: float = math.nan
    saving: float = 0.0  # seconds spent writing inner checkpoints
    last_seconds: float = 0.0  # inner-loop seconds at the end of the previous step (its padding included)

    def after_step(self, steps: int, losses: torch.Tensor, seconds: float, tokens: int) -> None:
        seconds -= self.saving
        if self.pacer.active:  # pad the step to its paced time (a straggler: slowdown x that)
            seconds += self.pacer.pad(seconds - self.last_seconds, check=self.check, stop=TaskCut)
        self.last_seconds = seconds
        resume, every = self.begun.resume, self.setup.resilience.checkpoint_steps
        done = (resume.steps if resume is not None else 0) + steps
        if self.checkpoint is None or done % every != 0 or done >= self.steps:
            return
        started = time.perf_counter()
        progress_checkpoint(self.task, self.begun, steps=done,
                            losses=(resume.losses if resume else ()) + tuple(losses.tolist()),
                            tokens=(resume.tokens if resume else 0) + tokens,
                            seconds=(resume.seconds if resume else 0.0) + seconds,
                            val_loss=self.val_loss).save(self.checkpoint)
        self.saving += time.perf_counter() - started


def progress_checkpoint(task: Task, begun: TaskStart, *, steps: int, losses: tuple[float, ...] | list[float],
                        tokens: int, seconds: float, val_loss: float) -> InnerCheckpoint:
    """The island's inner checkpoint of `task` after its first `steps` inner steps: the path's parameters and
    optimizer state as they are now, the residual the task started from, and the steps' losses, tokens and seconds."""
    names = {param: name for name, param in begun.params.items()}
    adam, adam_meta = optimizer_state(begun.optimizer, names)
    return InnerCheckpoint(task=task_identity(task), steps=steps,
                           params={name: p.detach().cpu().clone() for name, p in begun.params.items()},
                           adam=adam, adam_meta=adam_meta, losses=tuple(losses), tokens=tokens, seconds=seconds,
                           val_loss_start=val_loss, residual=begun.carried.residual)


def finish_task(setup: IslandSetup, task: Task, begun: TaskStart, stats: dict, *, val_loss: float,
                ctx: Parallel, timings: dict[str, float] | None) -> TrainedTask:
    """Δ = θ_start − θ_end of the modules the task sends (+ the residual, encoded, with error feedback), the
    drift of the others, the result's metadata and the path's carried state after the task."""
    resume, device, path = begun.resume, begun.device, task.path
    losses, tokens, seconds = stats["losses"], stats["tokens"], stats["seconds"]
    if resume is not None:
        losses, tokens, seconds = list(resume.losses) + losses, resume.tokens + tokens, resume.seconds + seconds
    train_loss = sum(losses[-5:]) / len(losses[-5:]) if losses else math.nan  # none: an elastic worker healed past them
    if isinstance(ctx, ddp_mod.DDPContext):  # an elastic island's tokens are already the whole batches'
        train_loss = ddp_mod.all_mean(ctx, train_loss)
        tokens *= ctx.world
    encoded, residual = None, {}
    with timed(timings, "pseudo_gradient", device):
        synced = setup.schedule.synced(setup.topology.modules_of_path(path), round=task.round,
                                       step_offset=task.step_offset, steps=task.steps)
        delta = pseudo_gradient_of(begun.start, begun.params, setup.topology, path=path)
        pseudo_gradient, drift = split_sent(delta, set(synced))
        if setup.compression.feeds_back:  # Δ + e, encoded here: the residual it leaves is carried on
            started_from = begun.carried.residual
            pseudo_gradient = with_residual(pseudo_gradient, started_from, decay=setup.compression.ef_decay)
            codec = Codec.of(setup.codec_of(task), level=setup.compression.zstd_level, density=setup.compression.density,
                             bits=setup.compression.bits, chunk=setup.compression.chunk)
            data, encoded_stats, residual = encode_with_feedback(pseudo_gradient, codec=codec)
            encoded = (data, encoded_stats)
            residual |= {name: started_from[name] if name in started_from else torch.zeros_like(t)
                         for name, t in drift.items()}
    store = setup.store
    meta = ResultMeta(path=path, round=task.round, base=task.base, attempt=task.attempt, tokens=tokens,
                      train_loss=train_loss, losses=tuple(losses), val_loss_start=val_loss, seconds=seconds,
                      bytes_down_modules=begun.module_bytes,
                      bytes_down_inner=store.bytes_read - begun.read_before - begun.module_bytes,
                      inner_state_local=begun.local, data_parallel_ranks=ctx.world if ctx else 1,
                      bytes_residual=residual_bytes(residual), inner_refused=begun.refused,
                      carried_norms=None if begun.resume is not None else begun.carried.norms(),
                      module_fallbacks=begun.fallbacks)
    # resumed from its own inner checkpoint, the drift it started from is in the checkpoint's parameters, not
    # in `begun.carried`: the coordinator then reads the norms from the state `task.inner_from` names
    with timed(timings, "save_inner", device):
        names = {param: name for name, param in begun.params.items()}
        carried = CarriedState.of_optimizer(begun.optimizer, names, residual=residual, drift=drift)
    return TrainedTask(pseudo_gradient=pseudo_gradient, carried=carried, meta=meta, encoded=encoded,
                       codec=setup.codec_of(task))


def residual_shapes(params: dict[str, torch.nn.Parameter], topology: Topology, *, path: int) -> dict[str, list[int]]:
    """`{"module/param": shape}` of the path's parameters: what its error-feedback residual must hold."""
    return {f"{topology.module_of_param(name, path)}/{name}": list(p.shape) for name, p in params.items()}


def start_from_drift(params: dict[str, torch.nn.Parameter], drift: dict[str, torch.Tensor], topology: Topology, *,
                     path: int) -> None:
    """θ_start = θ_base − d: subtract the path's drift `{"module/param": tensor}` from its model's parameters."""
    with torch.no_grad():
        for name, param in params.items():
            key = f"{topology.module_of_param(name, path)}/{name}"
            if key in drift:
                param.sub_(drift[key].to(param.device))


def rebase_on_chain(store: ModuleStore, start: dict[str, dict[str, torch.Tensor]], task: Task) -> None:
    """θ_start = the base version's modules (`start`, changed in place) minus the Δ of every result in
    `task.chain`: its path's results that version does not hold yet, each the progress of its own steps."""
    for ref in task.chain:
        tensors, _ = read_result_ref(store, ref)
        for name, delta in tensors.items():
            module, _, param = name.partition("/")
            start[module][param].sub_(delta)


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


def _device(hardware: HardwareConfig, ctx: Parallel) -> torch.device:
    """The device this island (or DDP rank) trains on; on CUDA, fp32 matmuls on TF32 as `hardware.tf32` says."""
    device = resolve_device(hardware.device)
    if isinstance(ctx, ddp_mod.DDPContext):
        device = ddp_mod.local_device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = hardware.tf32
    return device


def push_result(setup: IslandSetup, task: Task, out: TrainedTask, *, island: str, handing_off: bool = False,
                timings: dict[str, float] | None = None, modules: HeldModules | None = None
                ) -> tuple[ResultMeta, dict, str]:
    """Upload a trained task: its carried state when `setup.uploads` says so (a checkpoint, the path's last
    task, or `handing_off`: the island lets the path go), then the compressed pseudo-gradient, then the
    result metadata (the commit). Returns (the metadata as written, compression stats, the state's reference).
    `modules`: the island's held modules, told the result's bytes (it need not download its own contributions)."""
    ref = inner_ref(path=task.path, round=task.round, attempt=task.attempt, link=task.link)
    reason = setup.uploads.reason(step_offset=task.step_offset, steps=out.meta.steps, handing_off=handing_off)
    inner_bytes = 0
    if reason is not None:
        with timed(timings, "write_inner"):
            inner_bytes = write_inner(setup.store, ref, *out.carried.to_tensors(moments=MOMENTS_OF[reason]))
    meta = dataclasses.replace(out.meta, island=island, bytes_up_inner=inner_bytes, inner_upload=reason or "",
                               finished=time.time())
    with timed(timings, "write_result"):
        if out.encoded is not None:  # error feedback: the bytes whose residual the carried state holds
            data, stats = out.encoded
        else:
            c = setup.compression
            data, stats = Codec.of(out.codec, level=c.zstd_level, density=c.density, bits=c.bits,
                                   chunk=c.chunk).encode(out.pseudo_gradient)
        meta = write_encoded_result(setup.store, task, data, meta, compression=out.codec)
    if modules is not None:
        modules.uploaded(result_file(round=task.round, path=task.path, attempt=task.attempt, link=task.link,
                                     compression=out.codec), data)
    return meta, stats, ref
