"""Island results are checked before any shared module sees them: the coordinator trusts no island.

    validator = ResultValidator(store, topology, resilience=cfg.resilience, tokens_per_task=steps * batch * seq_len)
    reason = validator.check(task, attempt)          # None: apply it; else why it is rejected
    task = validator.requeue(task, reason)           # the task as the next attempt (logged)
    validator.moved(task, fresh)                     # ... replaced by one from a newer version (async)

A result (its `ResultMeta` JSON and its pseudo-gradient file) is accepted only when
- its JSON parses into a `ResultMeta` (types, schema) that names this task: path, round, base, attempt;
- its file is exactly the name this task's attempt writes (`dipaco.store.board.result_file`): no other
  folder, nothing outside the store (`ModuleStore` refuses such names too);
- its tensors are exactly the path's module parameters, `module/param`, each with the module file's
  shape and float32 (a 1×1 tensor is not broadcast over a 32×32 weight), every value finite;
- its token count is the coordinator's own, inner.steps × inner.batch_size × sharding.seq_len (what
  every task trains; data-parallel ranks split the batch), so a claimed 1e15 cannot dominate the
  weighted average; its losses and seconds are finite;
- its norm is not an outlier: at most `resilience.max_norm_ratio` times the median norm of the path's
  last accepted results (none to compare with: accepted; the history lives in the coordinator's
  memory and starts again after a restart).

A rejected result is logged with its reason and its task handed out again as the next attempt; after
`resilience.max_rejections` rejections of one task the run stops with the reasons (a deterministic island
would only repeat them). Each (task, attempt) is checked once, and the `ResultMeta` an accepted one was
checked with is handed to the coordinator (`accepted_meta`), so its JSON is read once per result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics

import torch
from safetensors.torch import load as load_safetensors

from dipaco.config import ResilienceConfig
from dipaco.model.topology import Topology
from dipaco.store.board import read_result_meta, result_file
from dipaco.store.compress import decompress
from dipaco.store.module_store import ModuleStore, StoreError, round_dir
from dipaco.store.records import ResultMeta, Task

log = logging.getLogger(__name__)

HISTORY = 8  # accepted norms per path the outlier test compares with


class ResultValidator:
    def __init__(self, store: ModuleStore, topology: Topology, *, resilience: ResilienceConfig,
                 tokens_per_task: int | None):
        self.store, self.topology, self.resilience = store, topology, resilience
        self.tokens_per_task = tokens_per_task  # None: not checked (a caller that does not know the batch shape)
        self.norms: dict[int, list[float]] = {}  # path -> norms of its accepted results, oldest first
        self.verdicts: dict[tuple[str, int], str | None] = {}  # (task key, attempt) -> None or the reason
        self.rejections: dict[str, list[str]] = {}  # task key -> reasons of its rejected attempts
        self._shapes: dict[str, dict[str, tuple[list[int], str]]] = {}  # module -> param -> (shape, dtype)
        self._accepted: dict[tuple[str, int], ResultMeta] = {}  # (task key, attempt) -> its metadata, until taken

    def check(self, task: Task, attempt: int) -> str | None:
        """None when attempt `attempt` of `task` may be applied, else the reason it may not (checked once)."""
        key = (task.key, attempt)
        if key not in self.verdicts:
            try:
                norm, meta = self._check(task, attempt)
            except StoreError as err:
                self.verdicts[key] = str(err)
            else:
                self.verdicts[key] = self._outlier(task.path, norm)
                if self.verdicts[key] is None:
                    self.norms[task.path] = (self.norms.get(task.path, []) + [norm])[-HISTORY:]
                    self._accepted[key] = meta
            if self.verdicts[key] is not None:
                log.warning("rejected the result of %s attempt %d: %s", task.key, attempt, self.verdicts[key])
        return self.verdicts[key]

    def accepted_meta(self, task: Task, attempt: int) -> ResultMeta | None:
        """The `ResultMeta` that `check` read and accepted for this attempt, handed over once (so the
        coordinator need not read it again); None when it was not accepted or was already taken."""
        return self._accepted.pop((task.key, attempt), None)

    def requeue(self, task: Task, reason: str) -> Task:
        """`task` open again as its next attempt; the run stops after `resilience.max_rejections` rejections."""
        reasons = self.rejections.setdefault(task.key, [])
        reasons.append(reason)
        if len(reasons) >= self.resilience.max_rejections:
            raise RuntimeError(f"{len(reasons)} results of {task.key} were rejected (resilience.max_rejections): "
                               + "; ".join(reasons))
        log.warning("%s is open again as attempt %d", task.key, task.attempt + 1)
        return dataclasses.replace(task, status="open", island=None, incarnation=None, attempt=task.attempt + 1)

    def moved(self, task: Task, to: Task) -> None:
        """`task`, open again after a rejection, was replaced by `to` from a newer version: its rejections
        count on (`resilience.max_rejections` is per path's piece of work, not per version it starts from)."""
        self.rejections[to.key] = self.rejections.pop(task.key, []) + self.rejections.get(to.key, [])

    # --- the checks ----------------------------------------------------------------------------------
    def _check(self, task: Task, attempt: int) -> tuple[float, ResultMeta]:
        """The result's pseudo-gradient norm and its metadata; a StoreError says what is wrong with it."""
        meta = read_result_meta(self.store, round=task.round, path=task.path, attempt=attempt)
        where = self.store.location(result_file(round=task.round, path=task.path, attempt=attempt))
        _check_meta(meta, task, attempt, where=where, tokens=self.tokens_per_task)
        name = f"results/{round_dir(task.round)}/{meta.file}"
        data = self.store.read_bytes(name)
        try:
            tensors = load_safetensors(data) if meta.compression == "none" else decompress(data, method=meta.compression)[0]
        except Exception as err:  # safetensors / zstd raise their own error types
            raise StoreError(f"{self.store.location(name)} is not a valid {meta.compression} pseudo-gradient: {err}") from None
        return self._check_tensors(tensors, task.path, where=self.store.location(name)), meta

    def _check_tensors(self, tensors: dict[str, torch.Tensor], path: int, *, where: str) -> float:
        expected = {f"{module}/{param}": spec for module in self.topology.modules_of_path(path)
                    for param, spec in self._module_shapes(module).items()}
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise StoreError(f"{where}: tensors do not match path {path}'s modules (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        total = 0.0
        for name, tensor in tensors.items():
            shape, _ = expected[name]
            if list(tensor.shape) != shape:
                raise StoreError(f"{where}: {name} has shape {list(tensor.shape)}, the module's is {shape}")
            if tensor.dtype != torch.float32:
                raise StoreError(f"{where}: {name} is {tensor.dtype}, pseudo-gradients are float32")
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise StoreError(f"{where}: {name} has {bad} NaN or infinite values")
            total += float(tensor.double().square().sum())
        return math.sqrt(total)

    def _outlier(self, path: int, norm: float) -> str | None:
        history = self.norms.get(path)
        ratio = self.resilience.max_norm_ratio
        if not ratio or not history:
            return None
        median = statistics.median(history)
        if median > 0 and norm > ratio * median:
            return (f"pseudo-gradient norm {norm:.4g} is {norm / median:.1f}x the median {median:.4g} of path {path}'s "
                    f"last {len(history)} accepted results (resilience.max_norm_ratio {ratio})")
        return None

    def _module_shapes(self, module: str) -> dict[str, tuple[list[int], str]]:
        """Each parameter's (shape, dtype) from module version 0's safetensors header (shapes never change)."""
        if module not in self._shapes:
            relative = f"modules/{round_dir(0)}/{module}.safetensors"
            versions = self.store.versions("modules")
            if not self.store.exists(relative) and versions:
                relative = f"modules/{round_dir(versions[-1])}/{module}.safetensors"
            size = int.from_bytes(self.store.read_range(relative, 0, 8), "little")
            header = json.loads(self.store.read_range(relative, 8, 8 + size))
            self._shapes[module] = {name: (spec["shape"], spec["dtype"]) for name, spec in header.items()
                                    if name != "__metadata__"}
        return self._shapes[module]


def _check_meta(meta: ResultMeta, task: Task, attempt: int, *, where: str, tokens: int | None) -> None:
    claimed = {"path": meta.path, "round": meta.round, "base": meta.base, "attempt": meta.attempt}
    wanted = {"path": task.path, "round": task.round, "base": task.base, "attempt": attempt}
    for field, value in wanted.items():
        if claimed[field] != value:
            raise StoreError(f"{where}: {field} is {claimed[field]}, but the file belongs to {field} {value}")
    try:
        expected_file = result_file(round=task.round, path=task.path, attempt=attempt,
                                    compression=meta.compression).rsplit("/", 1)[-1]
    except KeyError:
        raise StoreError(f"{where}: unknown compression {meta.compression!r}") from None
    if meta.file != expected_file:
        raise StoreError(f"{where}: file {meta.file!r} is not this result's file {expected_file!r}")
    if tokens is not None and meta.tokens != tokens:
        raise StoreError(f"{where}: tokens {meta.tokens} is not the {tokens} a task trains "
                         f"(inner.steps x inner.batch_size x sharding.seq_len)")
    numbers = {"train_loss": meta.train_loss, "seconds": meta.seconds, **{f"losses[{i}]": x for i, x in enumerate(meta.losses)}}
    for field, value in numbers.items():
        if not math.isfinite(value):
            raise StoreError(f"{where}: {field} is {value}")
    if math.isinf(meta.val_loss_start) or meta.seconds < 0:  # NaN val_loss_start: the path has no validation blocks
        raise StoreError(f"{where}: val_loss_start {meta.val_loss_start} / seconds {meta.seconds} out of range")
