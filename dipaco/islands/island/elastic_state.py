"""What every worker of an elastic island holds alike, and how a worker behind heals it from a live peer.

    state = IslandState(presence=presence, held=held, begin=begin)    # torchft calls state_dict / load_state_dict
    state.progress = begin(task, None)                                # the task in progress (None: between tasks)

The state is the island's presence (incarnation, heartbeat `seq`, status, the tasks it finished), its held
carried state (`held.HeldState`: the path it trained last, in float32) and the task in progress (`Progress`: the
task, its steps done and their losses, the path's parameters, the optimizer's state and the error-feedback
residual it started from). A worker that returns, or starts late, receives it from a peer when it joins the
quorum (torchft heals a member whose step count is behind); when the peer is inside a task this worker does not
hold, it first begins that task from the store (`begin`: its modules and model) and then takes the peer's
parameters and optimizer over them. torchft's transport unpickles the state: the workers of one island trust
each other, as the ranks of a DDP island do.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dipaco.carried.state import CarriedState
from dipaco.islands.island.elastic import BatchCursor, KeptRows
from dipaco.islands.island.held import HeldState
from dipaco.islands.island.pacing import Pacer
from dipaco.islands.island.presence import Presence
from dipaco.islands.island.training import TaskStart, TrainedTask
from dipaco.store.records import Task

log = logging.getLogger(__name__)

PRESENCE = ("incarnation", "seq", "status", "current", "last_path", "finished")  # what the workers share of it


@dataclass
class Progress:
    """The task an elastic island trains, as one worker holds it."""

    task: Task
    begun: TaskStart  # its model, optimizer, θ_start and the carried state it started from
    cursor: BatchCursor  # the path's batches by inner step
    pacer: Pacer
    val_loss: float  # of its base version (NaN when it continues a chain)
    first: int  # the lr schedule's step at the task's first inner step
    total: int  # the lr schedule's length
    steps: int  # inner steps to train (fewer once the board cuts it)
    done: int = 0  # inner steps the island committed
    kept: KeptRows | None = None  # this worker's rows of step `done` from a try that failed
    losses: list[float] = field(default_factory=list)  # the whole batch's loss of each committed step
    tokens: int = 0
    seconds: float = 0.0  # in its rounds, padding included
    out: TrainedTask | None = None  # its result, once sealed

    @property
    def key(self) -> str:
        return f"{self.task.key}#{self.task.attempt}"


def presence_of(presence: Presence) -> dict:
    return {name: list(v) if isinstance(v := getattr(presence, name), list) else v for name in PRESENCE}


def restore_presence(presence: Presence, shared: dict) -> None:
    for name in PRESENCE:
        setattr(presence, name, list(shared[name]) if name == "finished" else shared[name])


def held_of(held: HeldState) -> dict:
    tensors, meta = held.state.to_tensors(moments="float32") if held.state is not None else (None, None)
    return {"ref": held.ref, "path": held.path, "uploaded": held.uploaded, "tensors": tensors, "meta": meta}


def restore_held(held: HeldState, shared: dict) -> None:
    state = (CarriedState.from_tensors(shared["tensors"], shared["meta"], where="a peer's held state")
             if shared["tensors"] is not None else None)
    held.ref, held.path, held.state, held.uploaded = shared["ref"], shared["path"], state, shared["uploaded"]


class IslandState:
    """The state torchft heals a worker behind with (`state_dict` on a live peer, `load_state_dict` here)."""

    def __init__(self, *, presence: Presence, held: HeldState, begin: Callable[[Task, float | None], Progress]):
        self.presence, self.held, self.begin = presence, held, begin
        self.progress: Progress | None = None
        self.healed = 0  # times this worker was healed from a peer

    def state_dict(self) -> dict:
        state = {"presence": presence_of(self.presence), "held": held_of(self.held), "task": None}
        pr = self.progress
        if pr is not None:
            state |= {"task": pr.task.to_json(), "done": pr.done, "steps": pr.steps, "losses": list(pr.losses),
                      "tokens": pr.tokens, "seconds": pr.seconds, "val_loss": pr.val_loss,
                      "optimizer": pr.begun.optimizer.state_dict(),
                      "params": {name: p.detach() for name, p in pr.begun.params.items()},
                      "residual": pr.begun.carried.residual}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.healed += 1
        restore_presence(self.presence, state["presence"])
        restore_held(self.held, state["held"])
        if state["task"] is None:
            self.progress = None
            return
        task = Task.from_json(state["task"], file="an elastic island peer's state")
        pr = self.progress
        if pr is None or pr.key != f"{task.key}#{task.attempt}" or pr.out is not None:
            pr = self.progress = self.begin(task, float(state["val_loss"]))  # the peers' score of its base
        params = pr.begun.params
        if set(state["params"]) != set(params):
            raise ValueError(f"{task.key}: a peer's state holds parameters {sorted(state['params'])[:4]}..., "
                             f"not this path's {sorted(params)[:4]}...")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state["params"][name])
        pr.begun.optimizer.load_state_dict(state["optimizer"])
        pr.begun.carried = dataclasses.replace(pr.begun.carried, residual=dict(state["residual"]))
        pr.done, pr.steps, pr.losses, pr.tokens = state["done"], state["steps"], list(state["losses"]), state["tokens"]
        pr.seconds = float(state["seconds"])  # the task's time so far, the peer's rounds before this worker's
        pr.kept = None  # gradients of the parameters it had: not the peer's
        log.info("healed from a live peer into %s attempt %d at its step %d of %d", task.key, task.attempt, pr.done,
                 pr.steps)
