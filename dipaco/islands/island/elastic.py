"""Elastic islands: several worker processes train one path, and go on when one fails.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --heartbeat_timeout_ms 1000 &   # one per island
    TORCHFT_LIGHTHOUSE=http://host:29510 ... ctx = join("island-3-w0", device)
    out = train_task(setup, task, ctx=ctx)                            # every worker, the same task

Each worker is a torchft replica group of its own (`torchft.Manager`, one process, gloo on the CPU) and the
island's lighthouse forms a quorum of the live workers before every inner step. The step's batch of
`inner.batch_size` sequences is split over the quorum (participant r of w takes rows r, r + w, ...), each
worker's loss is weighted by its share of the rows and the gradients are summed over the quorum, so a step
of any world size follows the gradient of the whole batch's mean loss. A step commits only when every
member finished it (`Manager.should_commit`); a step that fails (a worker died in it) is tried again by
the others at the next quorum with the same batch, so every batch is trained exactly once (`StepRecord`s
say by which quorum; `stats["failed_steps"]` counts the failed tries). A worker that joins or returns behind
the quorum heals: torchft sends it the path's live state (`LiveState`: parameters, AdamW state, the task
and its steps done) from a live peer, not from the store. torchft's transport unpickles that state: the
workers of one island trust each other, as the ranks of a DDP island do (`ddp.broadcast`).

torchft is an optional dependency (`pip install 'dipaco[elastic]'`); `join` refuses by name without it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed

from dipaco.config import InnerConfig
from dipaco.device import autocast
from dipaco.optim.inner import lr_at

EXTRA = "pip install 'dipaco[elastic]' (torchft==0.2.0)"


class ElasticError(RuntimeError):
    """A worker of an elastic island cannot go on (healed into another task, no quorum, ...)."""


def require_torchft() -> Any:
    """The torchft module, or an ImportError that names it and how to install it."""
    try:
        import torchft
    except ImportError as err:
        raise ImportError(f"an elastic island needs torchft, which is not installed: {EXTRA}") from err
    return torchft


def start_lighthouse(*, join_timeout_ms: int, heartbeat_timeout_ms: int) -> Any:
    """A torchft lighthouse for one island, on any free port of this machine (`.address()`, `.shutdown()`):
    it forms a quorum of whichever workers are there (at least one) `join_timeout_ms` after the first asks, and
    counts a worker gone `heartbeat_timeout_ms` after its last heartbeat. Until then it waits for that worker
    (torchft forms no quorum of half its live workers or fewer), so this is the island's pause when one dies."""
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


@dataclass(frozen=True)
class StepRecord:
    """One committed inner step of a task, as a worker saw it."""

    task: str  # the task's key
    step: int  # the task's inner step (0 = its first)
    world: int  # workers in the quorum that trained it
    rank: int  # this worker's place in that quorum (it took rows rank, rank + world, ...)
    loss: float  # this worker's loss on its rows

    def to_json(self) -> dict:
        return {"task": self.task, "step": self.step, "world": self.world, "rank": self.rank, "loss": self.loss}


@dataclass
class LiveState:
    """The path's state a healing worker receives from a live peer: the task, its steps done, the parameters
    (by name) and the optimizer's state."""

    task: str = ""
    done: int = 0
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None

    def state_dict(self) -> dict:
        if self.optimizer is None:
            raise ElasticError("a peer asked for this worker's state before it started a task")
        return {"task": self.task, "done": self.done, "optimizer": self.optimizer.state_dict(),
                "params": {name: p.detach() for name, p in self.params.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["task"] != self.task or self.optimizer is None:
            raise ElasticError(f"this worker trains task {self.task!r} but its island's quorum is in task "
                               f"{state['task']!r}: it joins at the next task")
        if set(state["params"]) != set(self.params):
            raise ElasticError(f"task {self.task}: a peer's state holds parameters {sorted(state['params'])[:4]}..., "
                               f"not this path's {sorted(self.params)[:4]}...")
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.done = int(state["done"])


@dataclass
class ElasticContext:
    """One worker's membership of its elastic island: its torchft manager and what it heals peers with."""

    manager: Any  # torchft.Manager
    replica: str  # this worker's name in the quorum
    live: Any  # a `LiveState`, or what the caller gave `join`
    on_commit: Callable[[StepRecord], None] | None = None  # told of every committed step (tests, logs)
    store: Any = None  # this replica group's TCPStore (the manager's rendezvous), kept alive with it
    pg: Any = None  # its gloo process group (torchft's), aborted when the worker leaves

    @property
    def world(self) -> int:
        """Workers in the current quorum (the island's world size for its heartbeat and result)."""
        return max(self.manager.num_participants(), 1)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def leave(self) -> None:
        """Leave the island at once, as a worker that dies does: its connections close (a peer's collective in
        flight fails instead of waiting for its timeout) and it stops answering the lighthouse."""
        self.drop_connections()
        self.shutdown()

    def drop_connections(self) -> None:
        """Close this worker's connections of the round's collectives (a round that failed here): a peer still
        waiting in one for data that will not come fails now and asks for the next quorum, instead of the others
        waiting for it at the lighthouse (`resilience.worker_join_seconds`). The next quorum connects afresh:
        a member that failed a round reports it, so the lighthouse gives that quorum a new id."""
        if self.pg is not None:
            self.pg.abort()

    def end_round(self) -> None:
        """After a round: when it failed here (a member died in it), `drop_connections`."""
        if self.manager.errored() is not None:
            self.drop_connections()


def join(replica: str, device: torch.device, *, lighthouse: str | None = None, timeout: float = 60.0,
         live: Any = None) -> ElasticContext:
    """Join the island's lighthouse (`lighthouse`, else torchft's TORCHFT_LIGHTHOUSE) as worker `replica`; `live`:
    what it heals peers with and is healed from (`state_dict`, `load_state_dict`; default a `LiveState`)."""
    require_torchft()
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    if device.type != "cpu":
        raise ValueError(f"elastic islands: workers train on the CPU (gloo) only so far, not on {device}")
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ValueError("elastic islands: no lighthouse; set TORCHFT_LIGHTHOUSE=http://host:port "
                         "(torchft_lighthouse --min_replicas 1)")
    host = socket.gethostname()
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's
    live = LiveState() if live is None else live
    wait = timedelta(seconds=timeout)
    pg = ProcessGroupGloo(timeout=wait)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=live.load_state_dict,
                      state_dict=live.state_dict, replica_id=replica, store_addr=host, store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse, hostname=host, use_async_quorum=False,
                      timeout=wait, quorum_timeout=wait, connect_timeout=wait)
    return ElasticContext(manager=manager, replica=replica, live=live, store=store, pg=pg)


def sum_flat(manager, tensors: list[torch.Tensor]) -> None:
    """Sum `tensors` over the quorum in place, as one float32 buffer (DDP's bucket, of one)."""
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM).wait()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


class BatchCursor:
    """The task's batches by inner step: a failed step's batch again, or ahead after a heal (forward only)."""

    def __init__(self, batches: Iterator[np.ndarray]):
        self.batches, self.next, self.last = batches, 0, None

    def at(self, step: int) -> np.ndarray:
        if step < self.next - 1:
            raise ElasticError(f"inner step {step} is behind this worker's data order (at {self.next - 1})")
        while self.next <= step:
            self.last = next(self.batches)
            self.next += 1
        return self.last


def elastic_steps(ctx: ElasticContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  batches: Iterator[np.ndarray], *, task: str, params: dict[str, torch.nn.Parameter], start_step: int,
                  steps: int, total_steps: int, config: InnerConfig, device: torch.device, precision: str,
                  check: Callable[[], None] | None = None,
                  after_step: Callable[[int, torch.Tensor, float, int], None] | None = None) -> dict:
    """`optim.inner.train_steps` with the island's quorum: `steps` inner steps of `task`, each on the quorum's
    share of its batch; returns the same stats (losses: this worker's, of the steps it trained; tokens: the
    island's) plus "failed_steps" and "records" (`StepRecord`s of the steps this worker committed)."""
    live = ctx.live
    live.task, live.done, live.params, live.optimizer = task, 0, params, optimizer
    model.train()
    cursor, losses, records, failed, tokens = BatchCursor(batches), [], [], 0, 0
    started = time.perf_counter()
    while live.done < steps:
        if check is not None:
            check()
        ctx.manager.start_quorum()  # may heal: `live` then holds a peer's state and steps done
        if live.done >= steps:
            break  # healed from a peer that had finished the task
        step, world, rank = live.done, ctx.manager.num_participants(), ctx.manager.participating_rank()
        batch = cursor.at(step)
        loss = accumulate(model, batch, rank=rank, world=world, device=device, precision=precision)
        lr = lr_at(start_step + step, config=config, total_steps=total_steps)
        if not _commit(ctx, optimizer, params, lr=lr, grad_clip=config.grad_clip):
            failed += 1
            ctx.end_round()
            continue
        live.done += 1
        tokens += int(batch.size)
        record = StepRecord(task=task, step=step, world=world, rank=-1 if rank is None else rank, loss=loss)
        records.append(record)
        if rank is not None:
            losses.append(loss)
        if ctx.on_commit is not None:
            ctx.on_commit(record)
        if after_step is not None:
            after_step(len(losses), torch.tensor(losses), time.perf_counter() - started, tokens)
    return {"losses": losses, "tokens": tokens, "seconds": time.perf_counter() - started, "steps": steps,
            "failed_steps": failed, "records": records}


@dataclass
class KeptRows:
    """The rows of an inner step's batch whose gradients a worker computed in a round that failed (a member died):
    the step's next try computes only the rows no member keeps. `grads` by parameter name; `loss`: the rows' loss
    weighted by their share of the batch."""

    step: int
    rows: list[int] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: float = 0.0


def rows_left(covered: torch.Tensor, *, rank: int | None, world: int, share: int | None = None) -> list[int]:
    """This member's rows of a step's try: the rows no member keeps (`covered`, the quorum's sum of the members'
    kept-row masks, is 0 there), at most `share` each (the first `share` x `world` of them), split over the quorum
    as participant `rank` of `world` (none when not in it)."""
    if rank is None or world < 1:
        return []
    left = [int(i) for i in torch.nonzero(covered == 0).flatten()]
    return (left if share is None else left[:share * world])[rank::world]


def completes_step(covered: torch.Tensor, *, world: int, share: int) -> bool:
    """Whether a try of `world` members taking at most `share` rows each covers every row no member keeps."""
    return int((covered == 0).sum()) <= share * world


def accumulate_rows(model: torch.nn.Module, batch: np.ndarray, rows: list[int], *, device: torch.device,
                    precision: str) -> float:
    """Backward of `rows` of `batch`, their loss weighted by their share of the batch (so the members' gradients
    sum to the whole batch's mean loss); returns that weighted loss (0 for no rows)."""
    if not rows:
        return 0.0
    ids = torch.as_tensor(np.ascontiguousarray(batch[rows]), dtype=torch.long, device=device)  # (b, T)
    with autocast(device, precision):
        loss = model(input_ids=ids, labels=ids).loss
    weighted = loss * (len(rows) / batch.shape[0])
    weighted.backward()
    value = weighted.item()
    if not np.isfinite(value):
        raise FloatingPointError(f"elastic inner step: loss is {loss.item()}")
    return value


def accumulate(model: torch.nn.Module, batch: np.ndarray, *, rank: int | None, world: int, device: torch.device,
                precision: str) -> float:
    """Backward of this worker's rows of `batch` (rows rank, rank + world, ...), its loss weighted by its share
    of the rows (summed over the quorum: the whole batch's mean loss); its unweighted loss (NaN: no rows)."""
    if rank is None or world < 1:
        return float("nan")  # not in the quorum: its gradients are zeroed by the all-reduce
    rows = torch.as_tensor(np.ascontiguousarray(batch[rank::world]), dtype=torch.long, device=device)  # (b, T)
    with autocast(device, precision):
        loss = model(input_ids=rows, labels=rows).loss
    (loss * (rows.shape[0] / batch.shape[0])).backward()
    value = loss.item()
    if not np.isfinite(value):
        raise FloatingPointError(f"elastic inner step: loss is {value}")
    return value


def _commit(ctx: ElasticContext, optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], *,
            lr: float, grad_clip: float) -> bool:
    """Sum the gradients over the quorum and, when every member finished the step, take it; the gradients
    are cleared either way. False: the step failed (it is tried again at the next quorum)."""
    from torch.distributed import ReduceOp

    grads = []
    for param in params.values():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    works = [ctx.manager.allreduce(g, reduce_op=ReduceOp.SUM) for g in grads]
    for work in works:
        work.wait()
    committed = ctx.manager.should_commit()
    if committed:
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
