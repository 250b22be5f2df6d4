"""One worker of an elastic island (`hardware.workers_per_island` > 1): every worker trains the island's task with
its quorum, and one live worker at a time does the island's store work.

    TORCHFT_LIGHTHOUSE=http://host:29510 dipaco island --config c.yaml --run r --name island-0 --worker 1
    ElasticIsland(setup, name="island-0", worker=1, workers=2).run()

`dipaco island` starts the island's lighthouse and its workers (`dipaco.islands.elastic_group`). The workers
go through rounds, each one torchft quorum (`start_quorum` ... `should_commit`), of the kind the island's state
says (`elastic_state.IslandState`, which a worker behind heals from a live peer as it joins):
- between tasks, a boundary round: its leader (the lowest rank that holds the last task's result not pushed
  yet, else rank 0) pushes that result unless the store has it already, beats, reads the board, hands its held
  carried state off when asked, and tells every member the next task, to wait, or to stop (the run is over);
- in a task, a step round: one try of an inner step, the rows of its batch split over the quorum, each member
  taking at most its share at the full island (`elastic.rows_left`: a shrunk island's step takes several tries, and
  a worker that returns joins at the next; a try that failed keeps the rows its survivors computed,
  `elastic.KeptRows`); the step leader's board watch (cut, cancelled) travels with the gradients, so every member
  stops at the same step;
- after the task's last step, a seal round: every member computes the result (`training.finish_task`) and the
  members check that their pseudo-gradients and carried states are identical by digest (`elastic_messages`):
  an island whose workers disagree stops rather than push one of them.
With `resilience.checkpoint_steps` k, the step leader writes the island's inner checkpoint every k committed steps
(`<run>/islands/<island>.safetensors`, as a one-process island's); a worker that begins a task alone, as the first
worker back after the whole island died does, resumes it from there when it is the same task (and asks for the
checkpoint's path first). Members that begin a task together start it afresh: on several hosts each holds its own.
The leader of the latest round writes the island's heartbeat, `world` its quorum's size; when it dies, the
next round's leader takes the role, and the result it held is pushed by another member at the next boundary.
A failed round (a member died in it) is tried again by the others; every committed step trained its whole batch.

Paced (`faults.step_seconds`), a step (its compute and all-reduce) takes the pace times this worker's rows over
its share of the batch at the full island (a worker of 2 left alone takes twice as long), padded before the
gradients are summed, so a death in it loses the step. Injected failures (`faults.mtbf`, mode `die`, each worker on its own schedule): the worker
leaves the quorum at once, forgets what it held (the task, the path's state, the modules), is away
`faults.return_after` seconds and joins again, healing from a live peer; the others go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed

from dipaco.device import resolve_device
from dipaco.islands.island import elastic
from dipaco.islands.island.cancellation import TaskCancelled, TaskCut
from dipaco.islands.island.elastic_messages import digest_of, lowest_holder, same_everywhere, share_json
from dipaco.islands.island.elastic_state import IslandState, Progress, presence_of, restore_presence
from dipaco.islands.island.elastic_time import WorkerTime
from dipaco.islands.island.faults import FaultClock, IslandFailure, no_faults
from dipaco.islands.island.held import awaiting_handoff
from dipaco.islands.island.pacing import Pacer
from dipaco.islands.island.polling import IslandWorker
from dipaco.islands.island.training import (
    IslandSetup,
    TaskStart,
    TrainedTask,
    data_seed,
    finish_task,
    progress_checkpoint,
    push_result,
    start_from_drift,
    start_task,
)
from dipaco.optim.inner import lr_at, phase_steps
from dipaco.store.board import inner_ref, result_exists
from dipaco.store.module_store import StoreError
from dipaco.store.records import Task
from dipaco.store.run_state import run_finished

log = logging.getLogger(__name__)

RESUMED = "resumed from the island's inner checkpoint"  # the log line's words (bench/islands_applied.py counts them)
COMMITS_SEEN = 5  # a paced step counts the least all-reduce time of the last this many (not a wait for a peer)


class ElasticIsland:
    """One worker of an elastic island: its rounds, and the island's store work while it leads."""

    def __init__(self, setup: IslandSetup, *, name: str, worker: int, workers: int, pinned: list[int] | None = None,
                 poll_seconds: float = 0.1, join: Callable[..., elastic.ElasticContext] = elastic.join,
                 faults: FaultClock | None = None):
        self.setup, self.store, self.poll_seconds = setup, setup.store, poll_seconds
        self.replica, self.workers, self.join = f"{name}-w{worker}", workers, join
        self.faults = faults or no_faults()
        self.failed_tries = 0  # step tries that did not commit (a member died in them)
        self.kept_rows = 0  # rows of those tries kept for the next (not trained again)
        self.commits: list[float] = []  # its last steps' all-reduce and commit seconds (the pace covers the least)
        self.time = WorkerTime()  # its wall seconds by kind of round, logged at each seal and at the end
        self.island = IslandWorker(setup, name=name, pinned=pinned)  # its board, presence, held state and modules
        self.presence = self.island.presence
        self.presence.silent, self.presence.workers = True, workers  # it beats only while it leads
        self.state = IslandState(presence=self.presence, held=self.island.held, begin=self._begin)
        for noisy in ("torchft", "torchft_quorums", "torchft_commits"):  # each logs a line a step
            logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
        self.ctx = self._join()
        self.unpushed: tuple[Task, TrainedTask] | None = None  # its last task's result until the store has it
        self.watch: Callable[[], None] = lambda: None  # the board watch of its task (called while it leads)
        self.waiting: dict[str, float] = {}  # "key#attempt" -> since when its leader waits for a hand-off
        self.stopped = False
        self.trained: list[str] = []  # "key#attempt" of the tasks it sealed

    @property
    def name(self) -> str:
        return self.island.name

    @property
    def checkpoint(self) -> Path | None:
        """The island's inner checkpoint file (None: `resilience.checkpoint_steps` 0)."""
        return self.island.checkpoint

    def run(self) -> int:
        """Rounds until the run's last round is committed; returns the tasks it sealed."""
        try:
            with self.presence.beating(self.setup.resilience.heartbeat_seconds):
                while not self.stopped:
                    try:
                        self.round()
                    except IslandFailure:
                        self._go_down()
        finally:
            if not self.presence.silent:  # its leader, stopped before the run's end: the path moves on exactly
                self._hand_off_on_stop()
            self.ctx.shutdown()
            log.info("island %s (%s): %s", self.name, self.replica, self.time.line())
        return len(self.trained)

    def _hand_off_on_stop(self) -> None:
        try:
            if not run_finished(self.store):
                self.island.held.hand_off()
        except (StoreError, OSError) as err:
            log.warning("island %s: could not hand path %s's carried state off (%s)", self.name,
                        self.island.held.path, err)

    def _join(self) -> elastic.ElasticContext:
        return self.join(self.replica, resolve_device(self.setup.hardware.device), live=self.state)

    def _check_faults(self) -> None:
        """Raise `IslandFailure` when this worker's injected failure is due."""
        if self.faults.due():
            self.faults.fail()
            raise IslandFailure(f"island {self.name} worker {self.replica}: injected failure")

    def _go_down(self) -> None:
        """An injected death: out of the quorum at once, nothing kept, back after `faults.return_after` as a new
        incarnation (a live peer's state replaces it when it heals; with none, the island lost its task)."""
        self.ctx.leave()
        self.presence.silent = True
        self.presence.reincarnate()
        self.state.progress, self.unpushed = None, None
        self.setup.models.release_gradients()
        self.island.held.forget()
        self.island.modules.forget()
        time.sleep(self.faults.return_after)
        self.island.ask_for_checkpointed_path()  # a peer's state replaces it when one is live
        log.warning("island %s (%s) is back after an injected failure; it joins and heals from a live peer",
                    self.name, self.replica)
        self.ctx = self._join()
        self.time.add("down")

    def round(self) -> None:
        """One quorum and the round the island's state calls for (its seconds counted in `self.time`)."""
        self._check_faults()
        manager, healed = self.ctx.manager, self.state.healed
        self.time.add("between" if self.state.progress is None else "steps")  # the last round's bookkeeping
        try:
            manager.start_quorum()  # a worker behind heals here: `self.state` is then its peer's
            self.time.add("heal" if self.state.healed > healed else "quorum")
            rank, world = manager.participating_rank(), max(manager.num_participants(), 1)
            progress = self.state.progress
            if progress is None:
                kind = "between"
                self._boundary(rank, world)
            elif progress.done < progress.steps:
                kind = "steps"
                self._step(progress, rank, world)
            else:
                kind = "seal"
                self._seal(progress, rank, world)
            self.ctx.end_round()
        except IslandFailure:
            self.time.add("failed")  # a death in the round: what it did is lost
            raise
        self.time.add(kind)

    def _lead(self, leading: bool, world: int) -> None:
        self.presence.silent, self.presence.world = not leading, world

    # --- between tasks ---------------------------------------------------------------------------------
    def _boundary(self, rank: int | None, world: int) -> None:
        manager = self.ctx.manager
        leader = lowest_holder(manager, rank=rank, world=world, holds=self.unpushed is not None)
        self._lead(rank == leader, world)
        message = share_json(manager, self._decide() if rank == leader else None)
        if not manager.should_commit():
            return
        if message is None:
            raise elastic.ElasticError(f"island {self.name}: a committed boundary round lost its leader's message")
        self._apply(message, alone=world == 1)

    def _decide(self) -> dict:
        """The leader's store work between tasks, and what it tells the other members."""
        island, held = self.island, self.island.held
        pushed = self._push() if self.unpushed is not None else None
        stop = run_finished(self.store)
        task = None if stop else island.next_task()  # hands the held state off when the board asks
        if task is not None and self._awaiting_handoff(task):
            task = None
        if task is not None:
            if held.path != task.path:
                held.hand_off()  # it lets its last path go
            self.presence.training(task)
        else:
            self.presence.idle()  # between tasks: no task in training, whatever a peer it healed from was doing
        island.heartbeat()
        return {"stop": stop, "task": task.to_json() if task is not None else None, "pushed": pushed,
                "presence": presence_of(self.presence), "held_uploaded": held.uploaded}

    def _apply(self, message: dict, *, alone: bool) -> None:
        """Every member: the leader's decision (`alone`: this worker is the quorum, and may resume a task from the
        island's inner checkpoint)."""
        restore_presence(self.presence, message["presence"])
        self.island.held.uploaded = message["held_uploaded"]
        if self.unpushed is not None and message["pushed"] == _key(self.unpushed[0]):
            self.unpushed = None
        if message["stop"]:
            self.stopped = True
            if not self.trained and not self.state.healed:
                self.presence.silent = True  # it never was the island (it started after the others ended): no "done"
            elif not self.presence.silent:
                self.island.report_traffic()
        elif message["task"] is None:
            time.sleep(self.poll_seconds)
        else:
            task = Task.from_json(message["task"], file=f"island {self.name}'s leader")
            self.state.progress = self._begin(task, None, checkpoint=self.checkpoint if alone else None)
            self.watch = self.island.board.watch(task)

    def _push(self) -> str:
        """Push the last task's result unless the store has it already (its leader then died after the push)."""
        task, out = self.unpushed
        if not result_exists(self.store, round=task.round, path=task.path, attempt=task.attempt, link=task.link):
            meta, _, _ = push_result(self.setup, task, out, island=self.name, handing_off=not task.keep_inner)
            log.info("island %s (%s): %s attempt %d pushed, loss %.3f, %d bytes up, trained by %d workers at the "
                     "end", self.name, self.replica, task.key, task.attempt, meta.train_loss, meta.bytes,
                     meta.data_parallel_ranks)
            self.island.report_traffic()
        self.island.drop_checkpoint()  # the result is in the store
        return _key(task)

    def _awaiting_handoff(self, task: Task) -> bool:
        """As `IslandWorker`: wait for the live island holding `task`'s carried state to hand it off, at most
        `resilience.heartbeat_timeout` (then the task resumes from the path's checkpoint)."""
        if not awaiting_handoff(self.store, task, held=self.island.held):
            self.waiting.pop(_key(task), None)
            return False
        since = self.waiting.setdefault(_key(task), time.monotonic())
        return time.monotonic() - since < self.setup.resilience.heartbeat_timeout

    def _begin(self, task: Task, val_loss: float | None, *, checkpoint: Path | None = None) -> Progress:
        """Start `task` on this worker: its modules, model, optimizer and carried state (`training.start_task`),
        the score of its base version (`val_loss` when a peer has it), and its batches; from the inner checkpoint
        in `checkpoint` when that holds this task (its steps done count as committed)."""
        setup = self.setup
        begun = start_task(setup, task, ctx=self.ctx, held=self.island.held, timings=None, checkpoint=checkpoint,
                           modules=self.island.modules)
        if begun.resume is not None:
            return self._resumed(task, begun)
        if val_loss is None:
            val_loss = float("nan") if task.chain else setup.validation.loss(begun.model, path=task.path)
        if begun.carried.drift:
            start_from_drift(begun.params, begun.carried.drift, setup.topology, path=task.path)
        return self._progress(task, begun, val_loss=val_loss)

    def _progress(self, task: Task, begun: TaskStart, *, val_loss: float) -> Progress:
        """`task` begun, at its first step: the model in training mode, the path's batches from the task's offset."""
        setup, inner = self.setup, self.setup.inner
        begun.model.train()
        batches = setup.reader.iter_batches(task.path, "train", batch_size=inner.batch_size,
                                            seed=data_seed(setup.run.seed, path=task.path),
                                            skip_batches=task.step_offset)
        first, total = phase_steps(inner, steps=setup.run.rounds * inner.steps, after=setup.warm_start_steps)
        return Progress(task=task, begun=begun, cursor=elastic.BatchCursor(batches), val_loss=val_loss,
                        pacer=Pacer(step_seconds=setup.step_seconds, slowdown=setup.slowdown),
                        first=first + task.step_offset, total=total, steps=task.steps or inner.steps)

    def _resumed(self, task: Task, begun: TaskStart) -> Progress:
        """`_begin` from the island's inner checkpoint of `task`: its committed steps, their losses and tokens."""
        resume = begun.resume
        self.island.resumed.append((task.key, resume.steps))
        progress = self._progress(task, begun, val_loss=resume.val_loss_start)
        progress.done, progress.losses, progress.tokens = resume.steps, list(resume.losses), resume.tokens
        progress.seconds = resume.seconds
        log.info("island %s (%s): %s %s at step %d", self.name, self.replica, task.key, RESUMED, resume.steps)
        return progress

    # --- in a task -------------------------------------------------------------------------------------
    def _step(self, pr: Progress, rank: int | None, world: int) -> None:
        """One try of an inner step: the rows of its batch that no member keeps from a failed try, split over the
        quorum; the leader's cut / cancel flags ride along. A try that fails keeps this worker's rows for the next."""
        self._lead(rank == 0, world)
        started = time.perf_counter()
        cut, cancelled = self._flags() if rank == 0 else (0.0, 0.0)
        batch, begun, manager = pr.cursor.at(pr.done), pr.begun, self.ctx.manager
        kept = pr.kept if pr.kept is not None and pr.kept.step == pr.done else elastic.KeptRows(step=pr.done)
        covered = torch.zeros(batch.shape[0], dtype=torch.float32)
        covered[kept.rows] = 1.0
        manager.allreduce(covered, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        share = -(-batch.shape[0] // self.workers)  # a member's rows at the full island: a try of a shrunk island
        rows = [] if manager.errored() else elastic.rows_left(covered, rank=rank, world=world, share=share)
        whole = elastic.completes_step(covered, world=world, share=share)  # else its rows wait, kept, for the next
        for name, param in begun.params.items():  # the kept rows' gradients, this try's added to them
            param.grad = kept.grads[name].clone() if name in kept.grads else None
        loss = elastic.accumulate_rows(begun.model, batch, rows, device=begun.device,
                                       precision=self.setup.hardware.precision)
        if rows:
            pr.kept = elastic.KeptRows(step=pr.done, rows=kept.rows + rows, loss=kept.loss + loss,
                                       grads={n: p.grad.detach().clone() for n, p in begun.params.items()
                                              if p.grad is not None})
        busy = time.perf_counter() - started + min(self.commits, default=0.0)  # compute, and the all-reduce's cost
        pr.pacer.pad(busy, check=self._check_faults, scale=len(rows) / batch.shape[0] * self.workers)
        held = pr.kept if pr.kept is not None and pr.kept.step == pr.done else kept
        control = torch.tensor([held.loss if rank is not None else 0.0, cut, cancelled], dtype=torch.float64)
        summing = time.perf_counter()
        self.time.add("steps")
        committed = self._commit(pr, control) if whole else self._commit_part(pr, control)
        if not committed:
            self.time.add("failed")
        elif rows:
            self.time.add("sync", paced=min(self.commits, default=0.0))
        else:
            self.time.add("idle")  # no rows of its own in this try (a shrunk island's last): it waits for the others'
        self.commits = [*self.commits[-COMMITS_SEEN + 1:], time.perf_counter() - summing]
        if not committed:
            self.failed_tries += 1
            self.kept_rows += len(pr.kept.rows) if pr.kept is not None and pr.kept.step == pr.done else 0
        elif whole or control[1:].any():
            pr.kept = None
            if control[2] > 0:
                self._drop(pr)
                return
            if control[1] > 0:
                pr.steps = pr.done  # cut: it reports the steps trained so far
            else:
                pr.done += 1
                pr.losses.append(float(control[0]))
                pr.tokens += int(batch.size)
                if self.ctx.on_commit is not None:
                    self.ctx.on_commit(elastic.StepRecord(task=pr.task.key, step=pr.done - 1, world=world,
                                                          rank=-1 if rank is None else rank,
                                                          loss=held.loss * batch.shape[0] / len(held.rows)
                                                          if held.rows else float("nan")))
                self._save_progress(pr, rank)
        pr.seconds += time.perf_counter() - started

    def _save_progress(self, pr: Progress, rank: int | None) -> None:
        """The step leader writes the island's inner checkpoint every `resilience.checkpoint_steps` committed steps
        (not after the task's last: its result follows)."""
        every = self.setup.resilience.checkpoint_steps
        if self.checkpoint is None or rank != 0 or pr.done % every != 0 or pr.done >= pr.steps:
            return
        progress_checkpoint(pr.task, pr.begun, steps=pr.done, losses=pr.losses, tokens=pr.tokens,
                            seconds=pr.seconds, val_loss=pr.val_loss).save(self.checkpoint)

    def _flags(self) -> tuple[float, float]:
        try:
            self.watch()
        except TaskCut:
            return 1.0, 0.0
        except TaskCancelled:
            return 0.0, 1.0
        return 0.0, 0.0

    def _commit(self, pr: Progress, control: torch.Tensor) -> bool:
        """Sum `control` and the gradients over the quorum; when every member finished the round, take the step
        (unless a flag stops the task). False: the round failed (it is tried again)."""
        manager, params = self.ctx.manager, pr.begun.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params.values()]
        for param, grad in zip(params.values(), grads, strict=True):
            param.grad = grad
        elastic.sum_flat(manager, [control, *grads])  # one all-reduce: a collective's cost is per call, not per byte
        committed = manager.should_commit()
        if committed and not control[1:].any():
            inner = self.setup.inner
            if inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(list(params.values()), inner.grad_clip)
            for group in pr.begun.optimizer.param_groups:
                group["lr"] = lr_at(pr.first + pr.done, config=inner, total_steps=pr.total)
            pr.begun.optimizer.step()
        pr.begun.optimizer.zero_grad(set_to_none=True)
        return committed

    def _commit_part(self, pr: Progress, control: torch.Tensor) -> bool:
        """A try that leaves rows of its step to the next (each member took its share at the full island, so a
        worker that returns to a shrunk island joins within a pace): only `control` is summed, no step is taken,
        the members keep their rows' gradients (`pr.kept`). False: the round failed."""
        elastic.sum_flat(self.ctx.manager, [control])
        committed = self.ctx.manager.should_commit()
        pr.begun.optimizer.zero_grad(set_to_none=True)
        return committed

    def _drop(self, pr: Progress) -> None:
        """The board no longer wants the task: every member leaves it without a result."""
        self.state.progress = None
        self.island.drop_checkpoint()  # it can never be resumed
        self.setup.models.release_gradients()
        self.island.cancelled.append(pr.key)
        self.presence.idle()
        log.warning("island %s (%s): stopped %s (the board no longer wants its result)", self.name, self.replica,
                    pr.key)

    # --- after a task ----------------------------------------------------------------------------------
    def _seal(self, pr: Progress, rank: int | None, world: int) -> None:
        """The task's result on every member, checked identical by digest; then it is held until pushed."""
        self._lead(rank == 0, world)
        task = pr.task
        if pr.out is None:  # once: finish_task consumes the task's θ_start
            resume = pr.begun.resume  # its steps before the checkpoint: finish_task adds them
            before = (len(resume.losses), resume.tokens, resume.seconds) if resume is not None else (0, 0, 0.0)
            stats = {"losses": pr.losses[before[0]:], "tokens": pr.tokens - before[1], "seconds": pr.seconds - before[2],
                     "steps": pr.steps}
            pr.out = finish_task(self.setup, task, pr.begun, stats, val_loss=pr.val_loss, ctx=self.ctx, timings=None)
            self.setup.models.release_gradients()
            log.info("%s: %s", task.key, pr.pacer.summary())
        out = pr.out
        same = same_everywhere(self.ctx.manager, digest_of(out.pseudo_gradient, out.carried.to_tensors()[0]))
        if not self.ctx.manager.should_commit():
            return
        if not same:
            raise elastic.ElasticError(f"island {self.name}: its workers' pseudo-gradients or carried states of "
                                       f"{task.key} differ (by digest); it stops rather than push one of them")
        upload = self.setup.uploads.reason(step_offset=task.step_offset, steps=out.meta.steps,
                                           handing_off=not task.keep_inner)
        ref = inner_ref(path=task.path, round=task.round, attempt=task.attempt, link=task.link)
        self.island.held.keep(ref, task.path, out.carried, uploaded=upload is not None)
        self.presence.finished_task(task)
        self.unpushed, self.state.progress = (task, out), None
        self.trained.append(pr.key)
        log.info("island %s (%s): %s sealed, %d steps, loss %.3f, %d workers (this worker: %d failed tries, %.1f CPU "
                 "seconds so far)", self.name, self.replica, pr.key, out.meta.steps, out.meta.train_loss, world,
                 self.failed_tries, time.process_time())
        log.info("island %s (%s): %s", self.name, self.replica, self.time.line())


def _key(task: Task) -> str:
    return f"{task.key}#{task.attempt}"
