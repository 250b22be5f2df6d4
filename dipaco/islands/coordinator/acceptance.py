"""Which island results the coordinator accepts: it trusts no island, so each result is checked before
any shared module sees it.

    checks = ResultChecks(store, topology, resilience=cfg.resilience, inner_steps=steps, tokens_per_step=batch * seq_len)
    reason = checks.check(task, attempt)          # None: apply it; else why it is rejected
    reason = checks.check(task, attempt, modules=["embeddings"])  # with fragments: the modules its round syncs
    task = checks.requeue(task, reason)           # the task as the next attempt (logged)
    checks.moved(task, fresh)                     # ... replaced by one from a newer version (async)

A result is accepted when its `ResultMeta` names this task (path, round, base, link, attempt) and this
attempt's own file; its tensors are exactly the parameters of the path's modules the task syncs (all of
them, or with `outer.fragments` those of its round's fragment: `dipaco.rounds.fragments`; names, shapes,
float32) with finite values; it trained the task's steps (fewer only when the task was cut, at least one) and its
token count is those steps × inner.batch_size × sharding.seq_len; no module of it is larger than
`resilience.max_update_ratio` × that module's norm at the task's base version (so a path's first result,
and the first after a restart, are bounded too); and its norm is at most `resilience.max_norm_ratio` ×
the median of the path's last accepted norms (of results that synced the same modules). No module may move
more than `resilience.max_update_scale` × what honest results of its role move (the poison bound,
`update_bound.UpdateBound`: a run's first results are held until another path's result gives a reference).
The carried state the task uploaded, when it did (`ResultMeta.inner_upload`: most tasks leave it on their
island; its moments, residual, drift), is read and checked too (`dipaco.carried.validate.check_inner_state`: names, shapes, finiteness, AdamW consistency, the residual and
drift bounded by `resilience.max_carried_ratio` × the path's accepted norms): a result whose inner state is
bad is refused like a bad result, so no island ever starts from it. After `resilience.max_rejections` rejections of one task
the run stops with the reasons. The tensors a file declares (its header, each module frame's header) are
compared with the path's modules before anything is decoded, so a result declaring a huge tensor costs
nothing (`open_result`). The sha256 of the bytes checked go with an
accepted result (`accepted_digests`), and the outer step applies exactly those bytes or none.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable

import torch

from dipaco.carried.validate import carried_norms, check_inner_state
from dipaco.config import ResilienceConfig
from dipaco.islands.coordinator.update_bound import HELD, InnerRun, UpdateBound
from dipaco.model.topology import Topology
from dipaco.store.board import inner_ref, open_result, read_inner, read_result_meta, result_file
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import PathState, ResultMeta, Task

log = logging.getLogger(__name__)

HISTORY = 8  # accepted norms per path the outlier test compares with


class ResultChecks:
    def __init__(self, store: ModuleStore, topology: Topology, *, resilience: ResilienceConfig,
                 inner_steps: int | None = None, tokens_per_step: int | None = None, inner: InnerRun | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`inner_steps`: a whole task's steps; `tokens_per_step`: inner.batch_size × sharding.seq_len (None:
        not checked, for a caller that does not know the batch shape); `inner`: the islands' AdamW and lr schedule
        (None: inner states are not checked, and the poison bound counts steps, not lr); `clock`: for the hold
        of a result with no reference yet (`resilience.hold_seconds`)."""
        self.store, self.topology, self.resilience, self.inner = store, topology, resilience, inner
        self.bound = UpdateBound(topology, scale=resilience.max_update_scale, hold_seconds=resilience.hold_seconds,
                                 clock=clock, inner=inner)
        self._held: dict[tuple[str, int], tuple] = {}  # (task key, attempt) -> its checks' outcome while held
        self._scales: dict[tuple[str, int], dict[str, float]] = {}  # (task key, attempt) -> accepted update scales
        self.inner_steps, self.tokens_per_step = inner_steps, tokens_per_step
        self.norms: dict[int | tuple, list[float]] = {}  # path (fragments: path and modules) -> accepted norms, oldest first
        self.verdicts: dict[tuple[str, int], str | None] = {}  # (task key, attempt) -> None or the reason
        self.rejections: dict[str, list[str]] = {}  # task key -> reasons of its rejected attempts
        self._shapes: dict[str, dict[str, tuple[list[int], str]]] = {}  # module -> param -> (shape, dtype)
        self._accepted: dict[tuple[str, int], ResultMeta] = {}  # (task key, attempt) -> its metadata, until taken
        self._digests: dict[tuple[str, int], dict[str, str]] = {}  # (task key, attempt) -> the bytes' sha256
        self._module_norms: dict[tuple[int, str], float] = {}  # (version, module) -> its parameters' norm
        self._carried: dict[str, dict[str, float]] = {}  # inner state ref -> {module: its residual's + drift's norm}

    def check(self, task: Task, attempt: int, *, modules: list[str] | None = None, hold: bool = True) -> str | None:
        """None when attempt `attempt` of `task` may be applied, else the reason it may not (checked once).
        `modules`: the modules the result must carry (the task's fragment); None: every module of its path.
        `HELD` (`update_bound`) when it waits for a reference (never when not `hold`: a restart's recheck)."""
        key = (task.key, attempt)
        if key not in self.verdicts:
            path_modules = self.topology.modules_of_path(task.path)
            modules = path_modules if modules is None else modules
            history = task.path if modules == path_modules else (task.path, *modules)
            try:
                norm, meta, digests, moved = self._held.pop(key, None) or self._check(task, attempt, modules)
            except StoreError as err:
                self.verdicts[key] = str(err)
            else:
                verdict = self.bound.judge(task, attempt, moved=moved, steps=meta.steps, hold=hold)
                if verdict is HELD:
                    self._held[key] = (norm, meta, digests, moved)
                    return HELD
                if verdict is not None:  # the poison bound's reason, naming the file
                    where = result_file(round=task.round, path=task.path, attempt=attempt, link=task.link)
                    verdict = f"{self.store.location(where)}: {verdict}"
                self.verdicts[key] = verdict or self._outlier(history, norm)
                if self.verdicts[key] is None:
                    self.norms[history] = (self.norms.get(history, []) + [norm])[-HISTORY:]
                    self._accepted[key] = meta
                    self._digests[key] = digests
                    self._scales[key] = self.bound.accept(task, attempt)
                    if meta.inner_refused:
                        log.warning("%s attempt %d started from fresh moments: its island refused the path's inner "
                                    "state (%s)", task.key, attempt, meta.inner_refused)
            if self.verdicts[key] is not None:
                log.warning("rejected the result of %s attempt %d: %s", task.key, attempt, self.verdicts[key])
        return self.verdicts[key]

    def accepted_meta(self, task: Task, attempt: int) -> ResultMeta | None:
        """The `ResultMeta` that `check` read and accepted (or holds) for this attempt, handed over once (so the
        coordinator need not read it again); None when it was not accepted or was already taken."""
        held = self._held.get((task.key, attempt))
        return self._accepted.pop((task.key, attempt), None) or (held[1] if held else None)

    def accepted_digests(self, task: Task, attempt: int) -> dict[str, str] | None:
        """The sha256 of the bytes `check` accepted for this attempt (its file's header and each module's span)."""
        return self._digests.get((task.key, attempt))

    def accepted_scales(self, task: Task, attempt: int) -> dict[str, float] | None:
        """The update scale of each module of this accepted attempt (`PathState.update_scales`), handed over once."""
        return self._scales.pop((task.key, attempt), None)

    def seed(self, paths: dict[int, PathState]) -> None:
        """A (re)started coordinator's reference for the poison bound: the paths' last accepted update scales."""
        self.bound.seed(paths)

    def forget(self, task: Task, attempt: int) -> None:
        """Check this attempt again next time it is asked (a coordinator's restart, or bytes that changed)."""
        self.bound.forget(task, attempt)
        self._held.pop((task.key, attempt), None)
        self._scales.pop((task.key, attempt), None)
        self.verdicts.pop((task.key, attempt), None)
        self._digests.pop((task.key, attempt), None)
        self._accepted.pop((task.key, attempt), None)

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
    def _check(self, task: Task, attempt: int, modules: list[str]) -> tuple[float, ResultMeta, dict[str, str], dict]:
        """The result's pseudo-gradient norm, its metadata, its bytes' digests and how far it moves each module
        ({module: (‖Δ_m‖, ‖θ_m‖ at its base)}); a StoreError says what is wrong with it or its inner state."""
        meta = read_result_meta(self.store, round=task.round, path=task.path, attempt=attempt, link=task.link)
        where = self.store.location(result_file(round=task.round, path=task.path, attempt=attempt, link=task.link))
        _check_meta(meta, task, attempt, where=where, inner_steps=self.inner_steps, tokens_per_step=self.tokens_per_step)
        stored = open_result(self.store, meta)  # headers only: nothing is decoded before they are checked
        expected = {f"{module}/{param}": shape for module in modules
                    for param, (shape, _) in self._module_shapes(module).items()}
        what = (f"path {task.path}'s modules" if modules == self.topology.modules_of_path(task.path) else
                f"the modules path {task.path} syncs in round {task.round} ({', '.join(modules) or 'none'})")
        _check_declared(stored.declared, expected, where=stored.location, what=what)
        tensors = stored.decode(shapes=expected)  # each frame decompresses to at most what these shapes take
        norm = self._check_tensors(tensors, expected, where=stored.location)
        moved = self._check_bounded(tensors, task.base, where=stored.location)
        self._check_inner(task, attempt, meta, norm=norm)
        carried = self._carried_from(task, meta, norm=norm)
        return norm, meta, stored.digests, {m: (*norms, carried.get(m, 0.0)) for m, norms in moved.items()}

    def _path_norms(self, task: Task, norm: float) -> list[float]:
        """The norms of the path's accepted pseudo-gradients, and this result's (`norm`)."""
        return [*(n for key, norms in self.norms.items() if (key if isinstance(key, int) else key[0]) == task.path
                  for n in norms), norm]

    def _check_inner(self, task: Task, attempt: int, meta: ResultMeta, *, norm: float) -> None:
        """The carried state the attempt uploaded (`meta.inner_upload`; most tasks upload none: it stays on
        their island) is one its AdamW and codec could leave (`check_inner_state`)."""
        if self.inner is None or not meta.inner_upload:
            return
        ref = inner_ref(path=task.path, round=task.round, attempt=attempt, link=task.link)
        tensors, stored = read_inner(self.store, ref)  # a missing or truncated file: StoreError naming it
        shapes = {f"{module}/{param}": shape for module in self.topology.modules_of_path(task.path)
                  for param, (shape, _) in self._module_shapes(module).items()}
        check_inner_state(tensors, stored, file=self.store.location(ref), expected_shapes=shapes,
                          max_step=self.inner.optimizer_steps + task.step_offset + meta.steps, betas=self.inner.betas,
                          delta_norms=self._path_norms(task, norm), max_ratio=self.resilience.max_carried_ratio)
        self._carried[ref] = carried_norms(tensors)

    def _carried_from(self, task: Task, meta: ResultMeta, *, norm: float) -> dict[str, float]:
        """{module: ‖residual‖ + ‖drift‖} of the carried state the task started from: as its island reports it
        (`meta.carried_norms`; untrusted, so each at most `resilience.max_carried_ratio` × the largest of the
        path's accepted norms, the validator's bound), else (an older result) from the file when it is in the
        store (noted when its result was checked, else read once); {} when none, unreadable (the island then
        starts fresh) or inner states are not checked."""
        ref = task.inner_from
        if ref is None or self.inner is None:
            return {}
        if meta.carried_norms is not None:
            ratio = self.resilience.max_carried_ratio
            bound = ratio * max(self._path_norms(task, norm)) if ratio else math.inf
            bound = bound if bound > 0 else math.inf  # no module sent yet: the validator does not bound it either
            return {module: min(float(n), bound) for module, n in meta.carried_norms.items()}
        if ref not in self._carried:
            try:
                self._carried[ref] = carried_norms(read_inner(self.store, ref)[0])
            except StoreError:
                self._carried[ref] = {}
        return self._carried[ref]

    def _check_bounded(self, tensors: dict[str, torch.Tensor], base: int, *, where: str) -> dict[str, tuple[float, float]]:
        """No module of the result moves more than `resilience.max_update_ratio` × its norm at `base` (the
        sanity bound; the poison bound is `update_bound`'s); returns {module: (‖Δ_m‖, ‖θ_m‖ at `base`)}."""
        ratio = self.resilience.max_update_ratio
        squares: dict[str, float] = {}
        moved: dict[str, tuple[float, float]] = {}
        for name, tensor in tensors.items():
            module = name.partition("/")[0]
            squares[module] = squares.get(module, 0.0) + float(tensor.double().square().sum())
        for module, square in squares.items():
            if (base, module) not in self._module_norms:
                params = self.store.read_module(base, module)
                self._module_norms[(base, module)] = math.sqrt(sum(float(t.double().square().sum()) for t in params.values()))
            size, step = self._module_norms[(base, module)], math.sqrt(square)
            moved[module] = (step, size)
            if ratio and size > 0 and step > ratio * size:
                raise StoreError(f"{where}: its pseudo-gradient of {module} has norm {step:.4g}, {step / size:.3g}x the "
                                 f"module's norm {size:.4g} at version {base} (resilience.max_update_ratio {ratio})")
        return moved

    def _check_tensors(self, tensors: dict[str, torch.Tensor], expected: dict[str, list[int]], *, where: str) -> float:
        """The decoded tensors are `expected`'s (as declared), float32 and finite; returns their norm."""
        if set(tensors) != set(expected):  # the declared names were checked: a file that decodes to others is broken
            raise StoreError(f"{where}: decodes to other tensors than it declares")
        total = 0.0
        for name, tensor in tensors.items():
            if list(tensor.shape) != expected[name]:
                raise StoreError(f"{where}: {name} has shape {list(tensor.shape)}, the module's is {expected[name]}")
            if tensor.dtype != torch.float32:
                raise StoreError(f"{where}: {name} is {tensor.dtype}, pseudo-gradients are float32")
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise StoreError(f"{where}: {name} has {bad} NaN or infinite values")
            total += float(tensor.double().square().sum())
        return math.sqrt(total)

    def _outlier(self, key: int | tuple, norm: float) -> str | None:
        history = self.norms.get(key)
        ratio = self.resilience.max_norm_ratio
        if not ratio or not history:
            return None
        median = statistics.median(history)
        if median > 0 and norm > ratio * median:
            path = key if isinstance(key, int) else key[0]
            return (f"pseudo-gradient norm {norm:.4g} is {norm / median:.1f}x the median {median:.4g} of path {path}'s "
                    f"last {len(history)} accepted results (resilience.max_norm_ratio {ratio})")
        return None

    def _module_shapes(self, module: str) -> dict[str, tuple[list[int], str]]:
        if module not in self._shapes:
            self._shapes[module] = self.store.module_shapes(module)
        return self._shapes[module]


def _check_declared(declared: dict[str, tuple[torch.dtype, list[int]]], expected: dict[str, list[int]], *,
                    where: str, what: str) -> None:
    """Refuse a file whose headers declare other tensors than `expected` (names, shapes, float32), naming the
    tensor, its declared and its expected shape, before anything is decoded (a frame declaring a huge tensor
    is never decompressed)."""
    missing, unexpected = sorted(set(expected) - set(declared)), sorted(set(declared) - set(expected))
    if missing or unexpected:
        raise StoreError(f"{where}: tensors do not match {what} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, (dtype, shape) in declared.items():
        if list(shape) != expected[name]:
            raise StoreError(f"{where}: {name} has shape {list(shape)}, the module's is {expected[name]}")
        if dtype != torch.float32:
            raise StoreError(f"{where}: {name} is {dtype}, pseudo-gradients are float32")


def _check_meta(meta: ResultMeta, task: Task, attempt: int, *, where: str, inner_steps: int | None,
                tokens_per_step: int | None) -> None:
    claimed = {"path": meta.path, "round": meta.round, "base": meta.base, "link": meta.link, "attempt": meta.attempt}
    wanted = {"path": task.path, "round": task.round, "base": task.base, "link": task.link, "attempt": attempt}
    for field, value in wanted.items():
        if claimed[field] != value:
            raise StoreError(f"{where}: {field} is {claimed[field]}, but the file belongs to {field} {value}")
    try:
        expected_file = result_file(round=task.round, path=task.path, attempt=attempt, link=task.link,
                                    compression=meta.compression).rsplit("/", 1)[-1]
    except KeyError:
        raise StoreError(f"{where}: unknown compression {meta.compression!r}") from None
    if meta.file != expected_file:
        raise StoreError(f"{where}: file {meta.file!r} is not this result's file {expected_file!r}")
    if inner_steps is not None:
        asked = task.steps or inner_steps
        if not 1 <= meta.steps <= asked or (meta.steps < asked and task.status != "cut"):
            raise StoreError(f"{where}: {meta.steps} inner steps (losses) where the task asks for {asked}"
                             + ("" if task.status == "cut" else " and was not cut"))
        if tokens_per_step is not None and meta.tokens != meta.steps * tokens_per_step:
            raise StoreError(f"{where}: tokens {meta.tokens} is not the {meta.steps * tokens_per_step} its "
                             f"{meta.steps} steps train (inner.batch_size x sharding.seq_len each)")
    numbers = {"train_loss": meta.train_loss, "seconds": meta.seconds, **{f"losses[{i}]": x for i, x in enumerate(meta.losses)}}
    for field, value in numbers.items():
        if not math.isfinite(value):
            raise StoreError(f"{where}: {field} is {value}")
    if math.isinf(meta.val_loss_start) or meta.seconds < 0:  # NaN val_loss_start: the path has no validation blocks
        raise StoreError(f"{where}: val_loss_start {meta.val_loss_start} / seconds {meta.seconds} out of range")
