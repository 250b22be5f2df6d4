"""The protocol records: what the coordinator and the islands tell each other through the store.

    task = Task.open(path=2, base=3, step_offset=12, inner_from=None)     # "train path 2 from version 3"
    obj = task.to_json()                                                   # a JSON object, with "schema": 1
    Task.from_json(obj, file="tasks.json")                                 # validated: a StoreError naming
                                                                           # the file and the field otherwise

| record          | file (written by)                                  | what it says                         |
|-----------------|----------------------------------------------------|--------------------------------------|
| `Board`         | tasks.json (coordinator)                           | every `Task` and every `PathState`   |
| `Heartbeat`     | heartbeats/<island>.json (that island)             | alive, idle or training, what it did |
| `ResultMeta`    | results/round-t/path-p[.aN].json (the island)      | a pseudo-gradient's metadata         |
| `RoundManifest` | rounds/round-t.json (coordinator)                  | which results round t applied, how   |
| `RoundStats`    | train.json's "rounds", and state.json's "stats"    | one round's tokens, losses, bytes    |

Each is a frozen dataclass; a new state is a new record (`dataclasses.replace`). `to_json()` writes the
class's `SCHEMA` as "schema"; `from_json(obj, *, file)` refuses another schema version, a missing or
unexpected field, or a value of the wrong type. A field added to a record after its schema version was
fixed is listed in the class's `ADDED` and has a default: a record written before it existed lacks it
and is read with that default (an old train.json or state.json still loads), any other missing field
is refused. Only `dipaco.store.board` (and the train stage, for
train.json) turns them into files; everything else uses their attributes.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from dipaco.config import OuterConfig
from dipaco.store.module_store import StoreError

R = TypeVar("R", bound="Record")


class Record:
    """Base of the records: JSON conversion and validation from the dataclass fields' types."""

    SCHEMA: ClassVar[int | None] = None  # None: a part of another record, with no version of its own
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}  # str fields that take one of a few values
    ADDED: ClassVar[tuple[str, ...]] = ()  # fields added within this schema version: missing = their default

    def to_json(self) -> dict[str, Any]:
        out = {} if self.SCHEMA is None else {"schema": self.SCHEMA}
        for f in dataclasses.fields(self):
            out[f.name] = _to_json(getattr(self, f.name))
        return out

    @classmethod
    def from_json(cls: type[R], obj: Any, *, file: str, where: str = "") -> R:
        """Build and validate a record from a JSON object read from `file` (named in every error)."""
        what = f"{cls.__name__} in {file}" + (f" at {where}" if where else "")
        if not isinstance(obj, dict):
            raise StoreError(f"{what}: expected a JSON object, got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if cls.SCHEMA is not None:
            if "schema" not in obj:
                raise StoreError(f"{what}: missing field 'schema' (written by another dipaco version?)")
            if obj["schema"] != cls.SCHEMA:
                raise StoreError(f"{what}: schema version {obj['schema']!r}; this dipaco reads version {cls.SCHEMA}")
            names.add("schema")
        unexpected = sorted(set(obj) - names)
        if unexpected:
            raise StoreError(f"{what}: unexpected field {unexpected[0]!r}")
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in obj:
                if f.name in cls.ADDED:  # written before the field existed
                    values[f.name] = f.default
                    continue
                raise StoreError(f"{what}: missing field {f.name!r}")
            field_where = f"{where}.{f.name}" if where else f.name
            values[f.name] = _from_json(obj[f.name], hints[f.name], file=file, where=field_where)
            if f.name in cls.CHOICES and values[f.name] not in cls.CHOICES[f.name]:
                raise StoreError(f"{cls.__name__} in {file}: field {field_where!r} is {values[f.name]!r}, "
                                 f"not one of {list(cls.CHOICES[f.name])}")
        return cls(**values)


def _to_json(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    return value


def _from_json(value: Any, hint: Any, *, file: str, where: str) -> Any:
    """`value` as type `hint` (int, float, str, bool, X | None, tuple[X, ...], dict[int | str, X], a Record)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)

    def wrong(expected: str) -> StoreError:
        return StoreError(f"{file}: field {where!r} should be {expected}, got {value!r}"[:400])

    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_json(value, inner, file=file, where=where)
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, file=file, where=where)
    if hint is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise wrong("a list")
        return tuple(_from_json(v, args[0], file=file, where=f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong("an object")
        key_type, value_type = args
        out = {}
        for k, v in value.items():
            if key_type is int:
                try:
                    key = int(k)
                except ValueError:
                    raise StoreError(f"{file}: field {where!r} has the key {k!r}, which is not an integer") from None
            else:
                key = k
            out[key] = _from_json(v, value_type, file=file, where=f"{where}[{k}]")
        return out
    raise TypeError(f"records cannot hold {hint!r}")  # a programming error in this module


# --- the task board (tasks.json) -------------------------------------------------------------------
TASK_STATUSES = ("open", "assigned", "cut", "received", "lost", "cancelled")


@dataclass(frozen=True)
class Task(Record):
    """"Train path `path` for inner.steps steps from module version `base`" (meant for round base + 1).

    open → assigned (to an island incarnation) → received (some attempt's result is in the store);
    a task whose island is lost is open again as the next attempt, or in async mode `lost` and
    replaced by a task from the newest version. Async: a running task may be `cut` (its island stops
    and reports the steps it trained), or, when its result could no longer be applied, `cancelled` and
    replaced by a task from the newest version. Lost and cancelled tasks leave the board at the next
    commit. Async, a path's next task may start before its last result is applied: it continues from
    that result (`chain`), and when it starts from the same version it is the next `link`."""

    SCHEMA: ClassVar[int] = 1
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"status": TASK_STATUSES}

    path: int
    base: int
    attempt: int  # 0, then one more each time the task is handed to another island
    status: str
    island: str | None  # the island it is assigned to
    incarnation: str | None  # ... and that island's incarnation (a restarted island is another one)
    step_offset: int  # inner steps the path has done before this task (data order, LR schedule)
    inner_from: str | None  # the inner AdamW state to start from (a store reference), None = fresh
    result_attempt: int | None  # the attempt whose result was received
    link: int = 0  # 0, or n: the path's n-th further task from the same base (async)
    chain: tuple[str, ...] = ()  # the path's received results not in `base` (references): it starts from base − their Δ
    steps: int = 0  # inner steps to train; 0 = inner.steps
    inner_checkpoint: str | None = None  # the path's last carried state in the store, when `inner_from` is not there
    handoff_from: str | None = None  # the live island holding `inner_from` in memory, which uploads it (a move)
    keep_inner: bool = True  # the island keeps the path's carried state after the task (False: it hands it off)

    ADDED: ClassVar[tuple[str, ...]] = ("link", "chain", "steps", "inner_checkpoint", "handoff_from", "keep_inner")

    @classmethod
    def open(cls, *, path: int, base: int, step_offset: int, inner_from: str | None, link: int = 0,
             chain: tuple[str, ...] = (), steps: int = 0, inner_checkpoint: str | None = None) -> Task:
        return cls(path=path, base=base, attempt=0, status="open", island=None, incarnation=None,
                   step_offset=step_offset, inner_from=inner_from, result_attempt=None, link=link, chain=chain,
                   steps=steps, inner_checkpoint=inner_checkpoint)

    @property
    def round(self) -> int:
        """The round whose outer step this task is meant for."""
        return self.base + 1

    @property
    def key(self) -> str:
        return task_key(self.path, self.base, self.link)


def task_key(path: int, base: int, link: int = 0) -> str:
    """The name of the task that trains `path` from version `base` (the same for every attempt)."""
    return f"path-{path:04d}-round-{base + 1:06d}" + (f".l{link}" if link else "")


@dataclass(frozen=True)
class PathState(Record):
    """Where a path's training stands: inner steps done, its latest carried state (`dipaco.carried.state`:
    in the store, or only in the memory of the island that trained it) and its last one in the store."""

    steps_done: int
    inner: str | None  # its reference (dipaco.store.board.inner_ref), None before the first task
    checkpoint: str | None = None  # the latest state uploaded (== inner when that one was), None: none yet
    holder: str | None = None  # the island holding `inner` in memory only (None: it is in the store)
    holder_incarnation: str | None = None  # ... that island's incarnation (a restarted island holds nothing)
    update_scales: dict[str, float] | None = None  # its last accepted result's update scale per module (the poison bound's reference)

    ADDED: ClassVar[tuple[str, ...]] = ("checkpoint", "holder", "holder_incarnation", "update_scales")


@dataclass(frozen=True)
class Board(Record):
    """tasks.json: the coordinator's every task in flight or waiting for its round, and every path's state."""

    SCHEMA: ClassVar[int] = 1

    round: int  # the last committed round when it was written
    tasks: dict[str, Task]  # by Task.key
    paths: dict[int, PathState]


# --- islands ---------------------------------------------------------------------------------------
ISLAND_STATUSES = ("idle", "training", "done")


@dataclass(frozen=True)
class Heartbeat(Record):
    """An island's latest word: it is alive (`seq` changes), what it is doing and what it has done."""

    SCHEMA: ClassVar[int] = 1
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"status": ISLAND_STATUSES}
    ADDED: ClassVar[tuple[str, ...]] = ("world", "workers")

    island: str
    incarnation: str  # new after each (injected) death: tasks of the old incarnation are lost
    seq: int  # bumped on every beat; the coordinator times beats by when `seq` last changed
    status: str
    task: str | None  # the key of the task being trained
    pinned: tuple[int, ...]  # the only paths it takes (`--path`), () = any
    last_path: int | None  # the path it trained last (its inner state is then local)
    finished: tuple[str, ...]  # "key#attempt" of the tasks this incarnation finished lately
    time: float  # island wall clock (information only)
    failures: int  # injected failures so far
    world: int = 1  # its workers in the quorum now (an elastic island: dipaco.islands.island.elastic; else 1)
    workers: int = 1  # its workers when whole (world < workers: it trains slower until they return)

    def __post_init__(self) -> None:
        if not 1 <= self.world <= self.workers:
            raise StoreError(f"heartbeat of island {self.island[:80]!r}: world {self.world!r} is not within "
                             f"1..workers ({self.workers!r})")


@dataclass(frozen=True)
class ResultMeta(Record):
    """An island's report of one task: what it trained, how, and the bytes it moved.

    The fields from `island` to `link` are filled in as the result is uploaded (`dipaco.islands.island.training.push_result`,
    `dipaco.store.board.write_result`)."""

    SCHEMA: ClassVar[int] = 2  # 2: int8 / int4 files hold one zstd frame per module (dipaco.codec.compress)

    path: int
    round: int
    base: int
    attempt: int
    tokens: int  # training tokens of all data-parallel ranks
    train_loss: float  # mean of the last five inner steps
    losses: tuple[float, ...]  # every inner step's loss
    val_loss_start: float  # validation loss of version `base` (NaN without validation blocks)
    seconds: float  # time in inner steps
    bytes_down_modules: int
    bytes_down_inner: int
    inner_state_local: bool  # the inner state came from the island's memory, not the store
    data_parallel_ranks: int
    island: str = ""
    finished: float = 0.0  # island wall clock when the upload started
    bytes_up_inner: int = 0
    bytes: int = 0  # the pseudo-gradient file's size
    compression: str = "none"
    file: str = ""  # the pseudo-gradient file, next to this one
    link: int = 0  # the task's link (`Task.link`)
    bytes_residual: int = 0  # the error-feedback residual's bytes in the path's carried state, uploaded or not (codec topk)
    inner_upload: str = "checkpoint"  # why its carried state was uploaded (dipaco.carried.state.UploadPlan): checkpoint | last | hand-off, "" = kept on the island
    inner_refused: str = ""  # why the carried state its task named was refused, so it started from fresh moments ("" = it was not)
    carried_norms: dict[str, float] | None = None  # per module, ‖residual‖ + ‖drift‖ of the carried state the task started from (the poison bound's c_m; None: not reported)
    module_fallbacks: int = 0  # modules its island read whole although it held an older version (an update missing, undecodable, or not matching the checksum)

    ADDED: ClassVar[tuple[str, ...]] = ("link", "bytes_residual", "inner_upload", "inner_refused", "carried_norms",
                                        "module_fallbacks")

    @property
    def steps(self) -> int:
        """Inner steps it trained."""
        return len(self.losses)


# --- rounds ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestEntry(Record):
    """One result a round's outer step applied (with its weight `factor`) or dropped (factor None)."""

    key: str
    path: int
    base: int
    attempt: int
    staleness: int  # versions between the result's base and the one it was applied to
    tokens: int
    seconds: float
    bytes: int
    train_loss: float
    val_loss_start: float
    factor: float | None  # its shared modules' staleness weight; None for a dropped result
    link: int = 0  # the task's link (`Task.link`)
    steps: int | None = None  # inner steps it trained; None in manifests written before it was recorded
    island: str = ""  # the island that trained it
    float32_bytes: int = 0  # its pseudo-gradient in float32 (the path's parameters x 4): what float32 DiLoCo sends
    module_bytes: dict[str, int] | None = None  # bytes of each module's part of its file (applied results)
    private_staleness: int = 0  # its own path's results applied since its base that its start did not hold
    private_factor: float | None = None  # its path-private modules' staleness weight (None: dropped, or none such)
    module_fallbacks: int = 0  # its island's full module reads in place of updates (`ResultMeta.module_fallbacks`)

    ADDED: ClassVar[tuple[str, ...]] = ("link", "steps", "island", "float32_bytes", "module_bytes", "private_staleness",
                                        "private_factor", "module_fallbacks")

    @property
    def data_parallel_bytes(self) -> int:
        """What data parallel sends for the same training: a float32 gradient of the path per inner step."""
        return self.float32_bytes * (self.steps or 0)


@dataclass(frozen=True)
class OuterStep(Record):
    """The settings of the outer step a round applied (`dipaco.optim.outer.outer_update`'s config)."""

    lr: float
    momentum: float  # 0: no momentum kept (plain averaging with lr 1 and no rescale)
    nesterov: bool
    rescale_by_paths: bool

    @classmethod
    def of(cls, config: OuterConfig) -> OuterStep:
        return cls(lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                   rescale_by_paths=config.rescale_by_paths)


@dataclass(frozen=True)
class DownloadUpdates(Record):
    """The module updates a round published (`compression.download: update`, `dipaco.codec.update`)."""

    bytes: int  # the update files' bytes (what one island holding the last version downloads for all of them)
    modules: int  # modules updated (a module no result touched gets none)
    float32_bytes: int  # those modules in float32: what a whole-module download costs
    residual_max: float  # the download residual's ‖r‖ / ‖θ‖ after the round, the largest over modules (before the flush, in a flush)
    residual_mean: float  # ... its mean over modules
    flush: bool = False  # the run's last version: the residual sent in full (float32 updates), none left
    gathered: int = 0  # ... of which published as the round's results themselves (compression.download: results)


@dataclass(frozen=True)
class RoundManifest(Record):
    """rounds/round-t.json: which results round t's outer step used, and the step (written before the commit)."""

    SCHEMA: ClassVar[int] = 1

    round: int
    applied: tuple[ManifestEntry, ...]
    dropped: tuple[ManifestEntry, ...]
    outer: OuterStep | None = None  # the step apply_round took; None in manifests written before it was recorded
    downloads: DownloadUpdates | None = None  # the module updates it published (None: compression.download full)

    ADDED: ClassVar[tuple[str, ...]] = ("outer", "downloads")

    @property
    def keys(self) -> set[str]:
        """The tasks this round is done with (applied or dropped)."""
        return {e.key for e in self.applied + self.dropped}


@dataclass(frozen=True)
class RoundStats(Record):
    """One committed round as train.json records it."""

    SCHEMA: ClassVar[int] = 1

    round: int
    tokens: int
    bytes_up: int  # pseudo-gradient bytes of the applied results
    train_loss: dict[int, float]  # by path
    val_loss_start: dict[int, float]
    island_seconds: dict[int, float]
    applied: int
    dropped: int
    stale: int  # applied results from an older version
    in_flight: int  # tasks assigned when the round closed
    seconds: float = 0.0  # time of the round on the coordinator's clock (since the previous commit or its start)
    cancelled: int = 0  # running tasks this commit cancelled (async: their results could no longer be applied)
    cut: int = 0  # running tasks cut since the previous commit (async: they report the steps trained so far)
    # the outer step this round took: the configured one, or a plain average in the inner lr's decay
    # (outer.decay: average, dipaco.optim.outer.round_outer_step)
    outer_step: str = "configured"
    bytes_float32: int = 0  # the applied results in float32: what float32 DiLoCo would have sent
    bytes_data_parallel: int = 0  # a float32 gradient per inner step of the applied results, one copy (data parallel's worker sends and receives `traffic.ring_allreduce_bytes` of it)
    outer: OuterStep | None = None  # its settings, from the manifest (as applied); None in rows written before
    bytes_up_final: int = 0  # of bytes_up, the results of paths' last tasks (with outer.fragments they sync every module)
    module_fallbacks: int = 0  # full module reads the islands of its results (applied or dropped) took in place of updates
    downloads: DownloadUpdates | None = None  # the module updates it published (from the manifest)

    ADDED: ClassVar[tuple[str, ...]] = ("cancelled", "outer_step", "cut", "bytes_float32", "bytes_data_parallel",
                                        "outer", "bytes_up_final", "module_fallbacks", "downloads")
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"outer_step": ("configured", "average")}

    @classmethod
    def of(cls, manifest: RoundManifest, *, in_flight: int, cancelled: int = 0, cut: int = 0,
           outer_step: str = "configured", last: frozenset[str] = frozenset()) -> RoundStats:
        """`last`: the keys of the tasks that were their path's last (`bytes_up_final`)."""
        applied = manifest.applied
        seconds: dict[int, float] = {}
        val_loss: dict[int, float] = {}  # a chained task's is NaN (it did not start from a version)
        for e in applied:  # a path's results of one round together (async: consecutive pieces of its training)
            seconds[e.path] = seconds.get(e.path, 0.0) + e.seconds
            if e.path not in val_loss or not math.isnan(e.val_loss_start):
                val_loss[e.path] = e.val_loss_start
        return cls(round=manifest.round, tokens=sum(e.tokens for e in applied), bytes_up=sum(e.bytes for e in applied),
                   train_loss={e.path: e.train_loss for e in applied},
                   val_loss_start=val_loss,
                   island_seconds=seconds, applied=len(applied),
                   dropped=len(manifest.dropped), stale=sum(1 for e in applied if e.staleness > 0), in_flight=in_flight,
                   cancelled=cancelled, cut=cut, outer_step=outer_step,
                   bytes_float32=sum(e.float32_bytes for e in applied),
                   bytes_data_parallel=sum(e.data_parallel_bytes for e in applied), outer=manifest.outer,
                   bytes_up_final=sum(e.bytes for e in applied if e.key in last),
                   module_fallbacks=sum(e.module_fallbacks for e in applied + manifest.dropped), downloads=manifest.downloads)

    @property
    def mean_train_loss(self) -> float:
        return sum(self.train_loss.values()) / len(self.train_loss) if self.train_loss else math.nan
