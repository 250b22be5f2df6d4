"""An island's inner checkpoint: a task's progress on the island's local disk (`resilience.checkpoint_steps`).

    saved = InnerCheckpoint.load(path)                 # None when absent
    if saved is not None and saved.matches(task): ...
    InnerCheckpoint(task=..., steps=4, ...).save(path)

Every `resilience.checkpoint_steps` inner steps the island writes `<run>/islands/<island>.safetensors`
(atomically): the path model's parameters, the AdamW moments, and in its header the task and its
progress (steps, losses, tokens, seconds, the validation loss at the start). A restarted island handed
the same task (path, base, step offset, starting inner state; any attempt) resumes from it bit for bit
(with the error-feedback residual the task started from, `dipaco.optim.error_feedback`);
any other task starts afresh and replaces it. It is removed once the task's result is in the store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dipaco.atomic import replacing
from dipaco.store.records import Task

PARAM, ADAM, RESIDUAL = "param/", "adam/", "residual/"


def task_identity(task: Task) -> dict:
    """What makes two attempts the same work: path, base version, step offset, starting inner state."""
    return {"key": task.key, "path": task.path, "base": task.base, "step_offset": task.step_offset,
            "inner_from": task.inner_from}


@dataclass(frozen=True)
class InnerCheckpoint:
    task: dict  # task_identity of the task it belongs to
    steps: int  # inner steps of the task done
    params: dict[str, torch.Tensor]  # the path model's parameters by name (CPU)
    adam: dict[str, torch.Tensor]  # dipaco.optim.inner.optimizer_state tensors
    adam_meta: dict  # ... and its metadata (step counts)
    losses: tuple[float, ...]
    tokens: int
    seconds: float  # inner-loop seconds of the steps done
    val_loss_start: float
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # error feedback: the residual the task started from

    def matches(self, task: Task) -> bool:
        return self.task == task_identity(task)

    def save(self, path: Path) -> None:
        meta = {"task": self.task, "steps": self.steps, "adam_meta": self.adam_meta, "losses": list(self.losses),
                "tokens": self.tokens, "seconds": self.seconds, "val_loss_start": self.val_loss_start}
        tensors = {PARAM + k: v.contiguous() for k, v in self.params.items()}
        tensors |= {ADAM + k: v.contiguous() for k, v in self.adam.items()}
        tensors |= {RESIDUAL + k: v.contiguous() for k, v in self.residual.items()}
        with replacing(path) as tmp:
            save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})

    @classmethod
    def load(cls, path: Path) -> InnerCheckpoint | None:
        """The checkpoint in `path`; None when there is none (a file that cannot be read is an error)."""
        if not path.exists():
            return None
        try:
            tensors = load_file(str(path))
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            meta = json.loads(header["__metadata__"]["meta"])
            return cls(task=meta["task"], steps=int(meta["steps"]),
                       params={k.removeprefix(PARAM): v for k, v in tensors.items() if k.startswith(PARAM)},
                       adam={k.removeprefix(ADAM): v for k, v in tensors.items() if k.startswith(ADAM)},
                       adam_meta=meta["adam_meta"], losses=tuple(meta["losses"]), tokens=int(meta["tokens"]),
                       seconds=float(meta["seconds"]), val_loss_start=float(meta["val_loss_start"]),
                       residual={k.removeprefix(RESIDUAL): v for k, v in tensors.items() if k.startswith(RESIDUAL)})
        except (SafetensorError, OSError, KeyError, ValueError, TypeError) as err:
            raise ValueError(f"inner checkpoint {path} cannot be read ({err}); delete it to start the task afresh") from None


def task_path_of(path: Path) -> int | None:
    """The path the checkpoint in `path` trains (None without one): a restarted island asks for it first."""
    saved = InnerCheckpoint.load(path)
    return None if saved is None else int(saved.task["path"])
