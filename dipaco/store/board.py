"""The task board: the files through which the coordinator hands out work and islands report.

Every file has exactly one writer, and holds one record of `dipaco.store.records`:

    tasks.json                                    coordinator: the `Board` (every `Task` and `PathState`)
    rounds/round-000004.t2.json                   coordinator: the `RoundManifest` of round 4's outer step, staged
                                                  under its lease token (`ModuleStore.version_name`)
    heartbeats/<island>.json                      island <island>: its `Heartbeat`
    results/round-000004/path-0002[.l1][.a1].json the island running attempt 1 of (path 2, round 4): `ResultMeta`
    results/round-000004/path-0002[.l1][.a1].<ext> its pseudo-gradient (.safetensors, .int8/.int4/.topk.safetensors)
    islands/path-0002/inner-round-000004[.l1][.a1].safetensors   its inner state after the task: AdamW
                                                  moments (and the error-feedback residual, codec topk)

Attempt 0 and link 0 have no suffix (`.lN`: the path's N-th further task from the same version, async). A task handed to another island (its island stopped heart-beating, or came
back as a new incarnation) gets the next attempt number and so its own files: a late result from the
old attempt never overwrites anything, and the coordinator accepts exactly one attempt per task. A
result's JSON is written after its pseudo-gradient, so a result whose JSON exists is complete.

Tasks and path states name an inner state by its reference (`inner_ref`), which only this module
turns into a file.

    write_result(store, task, pseudo_gradient, meta, compression="int8", level=1)
    tensors, meta = read_result(store, round=4, path=2, attempt=1)        # the whole pseudo-gradient
    reader = ResultReader(store, read_result_meta(store, round=4, path=2, attempt=1))
    reader.module("embeddings")                                            # only that module's bytes
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import TYPE_CHECKING

from dipaco.codec.registry import REGISTRY
from dipaco.store.heartbeat_files import (  # noqa: F401  (re-exported: the board's files, one module each)
    ISLAND_NAME,
    HeartbeatCache,
    _heartbeat_file,
    check_island_name,
    read_heartbeats,
    write_heartbeat,
)
from dipaco.store.module_store import ModuleStore, StoreError, parse_round, round_dir
from dipaco.store.records import Board, ResultMeta, RoundManifest, Task, task_key

if TYPE_CHECKING:  # the codec (torch, safetensors) loads in the functions that handle tensors: `dipaco status` needs neither
    import torch

    from dipaco.codec.compress import Index
    from dipaco.codec.sparse import TopK

TASKS = "tasks.json"
EXTENSIONS = {name: info.suffix for name, info in REGISTRY.items()}  # a pseudo-gradient's file suffix by codec


def _suffix(attempt: int, link: int = 0) -> str:
    return ("" if link == 0 else f".l{link}") + ("" if attempt == 0 else f".a{attempt}")


def _result_stem(round: int, path: int, attempt: int, link: int = 0) -> str:
    return f"results/{round_dir(round)}/path-{path:04d}{_suffix(attempt, link)}"



def _manifest_file(store: ModuleStore, round: int, *, staged: bool = False) -> str:
    """Round `round`'s manifest: the committed one (`ModuleStore.version_name`), or this store object's staging."""
    return f"rounds/{store.staged_name(round) if staged else store.version_name(round)}.json"


def _inner_folder(path: int) -> str:
    return f"islands/path-{path:04d}"


# --- the board -------------------------------------------------------------------------------------
def read_board(store: ModuleStore) -> Board | None:
    """tasks.json's board (None before the first), read only when it changed since this client read it
    (`read_fresh`: an unchanged board costs one metadata request)."""
    obj = store.read_fresh_json(TASKS)
    return None if obj is None else Board.from_json(obj, file=store.location(TASKS))


def write_board(store: ModuleStore, board: Board) -> None:
    store.write_json(TASKS, board.to_json())


# --- results ---------------------------------------------------------------------------------------
def write_result(store: ModuleStore, task: Task, tensors: dict[str, torch.Tensor], meta: ResultMeta, *,
                 compression: str, level: int, topk: TopK | None = None) -> tuple[ResultMeta, dict]:
    """Upload a pseudo-gradient (compressed; `topk` for compression "topk") then its metadata (the commit).

    Returns the metadata as written (with the file, its bytes and the compression) and the compression stats."""
    from dipaco.codec.compress import compress

    data, stats = compress(tensors, method=compression, level=level, topk=topk)
    return write_encoded_result(store, task, data, meta, compression=compression), stats


def write_encoded_result(store: ModuleStore, task: Task, data: bytes, meta: ResultMeta, *, compression: str) -> ResultMeta:
    """Upload a pseudo-gradient already compressed (`compress`'s bytes) then its metadata; returns the metadata as written."""
    stem = _result_stem(task.round, task.path, task.attempt, task.link)
    name = stem + EXTENSIONS[compression]
    store.write_bytes(name, data)
    meta = dataclasses.replace(meta, bytes=len(data), compression=compression, file=name.rsplit("/", 1)[-1],
                               attempt=task.attempt, link=task.link)
    store.write_json(stem + ".json", meta.to_json())
    return meta


def result_file(*, round: int, path: int, attempt: int, compression: str | None = None, link: int = 0) -> str:
    """The store name of a result's JSON, or with `compression` of its pseudo-gradient (KeyError: unknown)."""
    return _result_stem(round, path, attempt, link) + (".json" if compression is None else EXTENSIONS[compression])


def result_ref(*, round: int, path: int, attempt: int, link: int = 0) -> str:
    """The reference of a result (in `Task.chain`), which only this module turns into files."""
    return _result_stem(round, path, attempt, link)


def result_ref_base(ref: str) -> int:
    """The base version of the task whose result `ref` is."""
    round = parse_round(ref.split("/")[1]) if ref.count("/") == 2 else None
    if round is None:
        raise StoreError(f"{ref!r} is not a result reference")
    return round - 1


_REF = re.compile(r"results/round-(\d+)/path-(\d+)(?:\.l(\d+))?(?:\.a\d+)?")


def result_ref_key(ref: str) -> str:
    """The key of the task whose result `ref` is (`dipaco.store.records.task_key`)."""
    match = _REF.fullmatch(ref)
    if match is None:
        raise StoreError(f"{ref!r} is not a result reference")
    round, path, link = match.groups()
    return task_key(int(path), int(round) - 1, int(link or 0))


def read_result_ref(store: ModuleStore, ref: str) -> tuple[dict[str, torch.Tensor], ResultMeta]:
    """The result `ref` names: its float32 pseudo-gradient and its metadata."""
    relative = ref + ".json"
    meta = ResultMeta.from_json(store.read_json(relative), file=store.location(relative))
    return _decoded(store, meta), meta


def result_exists(store: ModuleStore, *, round: int, path: int, attempt: int, link: int = 0) -> bool:
    return store.exists(_result_stem(round, path, attempt, link) + ".json")


def reported_results(store: ModuleStore, round: int) -> dict[tuple[int, int], set[int]]:
    """`{(path, link): attempts}` whose result JSON is in round `round`'s results folder, from one listing
    (a result whose JSON exists is complete); what `result_exists` says of each, without a check per task."""
    reported: dict[tuple[int, int], set[int]] = {}
    for name in store.listdir(f"results/{round_dir(round)}"):
        if not (name.startswith("path-") and name.endswith(".json")):
            continue  # pseudo-gradients, temporary files
        path, *suffixes = name.removeprefix("path-").removesuffix(".json").split(".")
        marks = {s[:1]: s[1:] for s in suffixes}
        if not path.isdigit() or len(marks) != len(suffixes) or not all(k in "la" and v.isdigit() for k, v in marks.items()):
            continue
        attempt, link = int(marks.get("a", 0)), int(marks.get("l", 0))
        if _result_stem(round, int(path), attempt, link) + ".json" == f"results/{round_dir(round)}/{name}":
            reported.setdefault((int(path), link), set()).add(attempt)
    return reported


def read_result_meta(store: ModuleStore, *, round: int, path: int, attempt: int, link: int = 0) -> ResultMeta:
    relative = _result_stem(round, path, attempt, link) + ".json"
    return ResultMeta.from_json(store.read_json(relative), file=store.location(relative))


def read_result(store: ModuleStore, *, round: int, path: int, attempt: int,
                link: int = 0) -> tuple[dict[str, torch.Tensor], ResultMeta]:
    """A result's float32 pseudo-gradient `{"module/param": tensor}` and its metadata."""
    meta = read_result_meta(store, round=round, path=path, attempt=attempt, link=link)
    return _decoded(store, meta), meta


def _decoded(store: ModuleStore, meta: ResultMeta) -> dict[str, torch.Tensor]:
    from dipaco.codec.compress import decompress

    name = f"results/{round_dir(meta.round)}/{meta.file}"
    data = store.read_bytes(name)
    try:
        tensors, _ = decompress(data, method=meta.compression)
    except Exception as err:  # zstd / safetensors raise their own error types
        raise StoreError(f"store file {store.location(name)} is not a valid {meta.compression} pseudo-gradient: {err}") from None
    return tensors


@dataclasses.dataclass(frozen=True)
class StoredResult:
    """A result file as the coordinator's checks read it: its bytes, its index and the tensors its headers
    declare (names, dtypes, shapes), nothing decoded yet; `decode` decodes it."""

    location: str  # where the file is (for messages)
    compression: str
    data: bytes
    index: Index
    declared: dict[str, tuple[torch.dtype, list[int]]]  # "module/param" -> (dtype, shape), from the headers alone

    @property
    def digests(self) -> dict[str, str]:
        """The sha256 of the bytes `ResultReader` will read: the file's header and each module's span."""
        from dipaco.codec.compress import header_size

        size = header_size(self.data[:8])
        return {HEADER: _sha256(self.data[:size]), **{m: _sha256(self.data[s:e]) for m, (s, e) in self.index.spans.items()}}

    def decode(self, *, shapes: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
        """Its tensors as the file holds them (a `none` file's in their own dtypes, the others decoded to float32);
        with `shapes` (`{"module/param": shape}`) a module frame decompresses only when it declares exactly those
        shapes, and to no more bytes than they take. A StoreError naming the file when it cannot be decoded."""
        from safetensors.torch import load as load_safetensors

        from dipaco.codec.compress import decompress

        try:
            if self.compression == "none":
                return load_safetensors(self.data)
            return decompress(self.data, method=self.compression, shapes=shapes)[0]
        except Exception as err:  # safetensors / zstd raise their own error types
            raise StoreError(f"{self.location} is not a valid {self.compression} pseudo-gradient: {err}") from None


def open_result(store: ModuleStore, meta: ResultMeta) -> StoredResult:
    """A result's file read and its headers parsed, no tensor decoded (a frame's header is the first bytes it
    decompresses to); a StoreError naming the file when they are not valid."""
    from dipaco.codec.compress import declared_tensors, header_size, read_index

    name = f"results/{round_dir(meta.round)}/{meta.file}"
    data = store.read_bytes(name)
    try:
        index = read_index(data[:header_size(data[:8])], method=meta.compression)
        declared = declared_tensors(data, index)
    except Exception as err:  # json / safetensors / zstd raise their own error types
        raise StoreError(f"{store.location(name)} is not a valid {meta.compression} pseudo-gradient: {err}") from None
    return StoredResult(location=store.location(name), compression=meta.compression, data=data, index=index,
                        declared=declared)


def read_result_as_stored(store: ModuleStore, meta: ResultMeta) -> tuple[dict[str, torch.Tensor], str, dict[str, str]]:
    """A result's pseudo-gradient as its file holds it (`StoredResult.decode`), where the file is, and the sha256
    of the bytes `ResultReader` will read (`ResultReader(digests=...)` refuses any other bytes); a StoreError
    naming the file when it cannot be decoded. The coordinator's checks compare `open_result`'s declared tensors
    with the path's modules before they decode."""
    stored = open_result(store, meta)
    return stored.decode(), stored.location, stored.digests


HEADER = "__header__"  # the digest of a result file's header (its index)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ResultChanged(StoreError):
    """A result's bytes are not the ones its checks read (changed in the store after its receipt)."""

    def __init__(self, message: str, *, key: tuple[int, int, int, int]):
        super().__init__(message)
        self.key = key  # (round, path, link, attempt) of the result


class ResultReader:
    """A result's pseudo-gradient read one module at a time, for the coordinator's outer step.

    Opening it reads only the file's header (its index); `module(name)` then reads that module's
    byte range alone (a ranged GET on object stores) and decodes it, so memory holds one module of
    one result, never the whole pseudo-gradient. With `digests` (`read_result_as_stored`'s, taken when
    the result was checked) every byte it reads must be the byte that was checked: `ResultChanged` otherwise,
    also when the file is gone or now ends before the bytes checked (truncated after its receipt)."""

    def __init__(self, store: ModuleStore, meta: ResultMeta, *, digests: dict[str, str] | None = None):
        self.store, self.meta, self.digests = store, meta, digests
        self.name = f"results/{round_dir(meta.round)}/{meta.file}"
        from dipaco.codec.compress import header_size, read_index

        try:
            size = header_size(self._read(HEADER, 0, 8))
            head = self._read(HEADER, 0, size)
            self._verify(HEADER, head)
            self.index: Index = read_index(head, method=meta.compression)
        except StoreError:
            raise
        except Exception as err:  # json / safetensors header errors
            raise self._invalid(err) from None

    def module(self, name: str) -> dict[str, torch.Tensor]:
        """`{param: float32 tensor}`: this result's pseudo-gradient of module `name`."""
        chunk = self.module_bytes(name)
        from dipaco.codec.compress import decode_module

        try:
            return decode_module(self.index, name, chunk)
        except Exception as err:  # zstd / safetensors raise their own error types
            raise self._invalid(err) from None

    def module_bytes(self, name: str) -> bytes:
        """Module `name`'s bytes as stored (its span of the file, `index.spans[name]`), checked against `digests`."""
        if name not in self.index.spans:
            raise StoreError(f"store file {self.store.location(self.name)} has no module {name!r} "
                             f"(it has {sorted(self.index.spans)[:6]})")
        start, end = self.index.spans[name]
        chunk = self._read(name, start, end)
        self._verify(name, chunk)
        return chunk

    def _read(self, part: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file; with `digests`, a file that cannot give them (removed, truncated) is
        a `ResultChanged`: its checked bytes are not there any more."""
        try:
            return self.store.read_range(self.name, start, end)
        except StoreError as err:
            if self.digests is None:
                raise
            raise self._changed(part, str(err)) from None

    def _verify(self, part: str, data: bytes) -> None:
        if self.digests is not None and self.digests.get(part) != _sha256(data):
            raise self._changed(part, "its bytes differ")

    def _changed(self, part: str, how: str) -> ResultChanged:
        return ResultChanged(f"store file {self.store.location(self.name)} changed after it was checked "
                             f"({'its header' if part == HEADER else f'module {part}'}: {how}): it is not applied",
                             key=self.meta_key)

    @property
    def meta_key(self) -> tuple[int, int, int, int]:
        return (self.meta.round, self.meta.path, self.meta.link, self.meta.attempt)

    def _invalid(self, err: Exception) -> StoreError:
        return StoreError(f"store file {self.store.location(self.name)} is not a valid {self.meta.compression} "
                          f"pseudo-gradient: {err}")


def result_rounds(store: ModuleStore) -> list[int]:
    """The rounds that have a results folder, ascending."""
    return sorted(r for r in map(parse_round, store.listdir("results")) if r is not None)


def remove_results(store: ModuleStore, round: int) -> None:
    store.remove(f"results/{round_dir(round)}")


# --- round manifests -------------------------------------------------------------------------------
def write_manifest(store: ModuleStore, manifest: RoundManifest) -> None:
    """Stage the manifest of the round the coordinator is closing (read once committed)."""
    store.write_json(_manifest_file(store, manifest.round, staged=True), manifest.to_json())


def read_manifest(store: ModuleStore, round: int) -> RoundManifest | None:
    """Round `round`'s manifest; None when the round was committed without one (or not at all)."""
    relative = _manifest_file(store, round)
    if not store.exists(relative):
        return None
    return RoundManifest.from_json(store.read_json(relative), file=store.location(relative))


# --- inner optimiser states ------------------------------------------------------------------------
def inner_ref(*, path: int, round: int, attempt: int, link: int = 0) -> str:
    """The reference of the inner state the task (path, round, attempt, link) leaves (in tasks and path states)."""
    return f"{_inner_folder(path)}/inner-{round_dir(round)}{_suffix(attempt, link)}.safetensors"


def warm_start_inner_ref() -> str:
    """The reference of the dense warm start's AdamW state, which every path's first task continues
    (`warm_start.continue_optimizer`; written once by the coordinator, never pruned)."""
    return "islands/inner-warm-start.safetensors"


def write_inner(store: ModuleStore, ref: str, tensors: dict[str, torch.Tensor], meta: dict) -> int:
    """An inner AdamW state: tensors, with its metadata in the safetensors header; returns the bytes."""
    return store.write_tensors_with_meta(ref, tensors, meta)


def read_inner(store: ModuleStore, ref: str) -> tuple[dict[str, torch.Tensor], dict]:
    return store.read_tensors_with_meta(ref)


def inner_exists(store: ModuleStore, ref: str) -> bool:
    return store.exists(ref)


def inner_states(store: ModuleStore, path: int) -> list[tuple[int, str]]:
    """`(round, reference)` of every inner state stored for `path`."""
    folder = _inner_folder(path)
    states = []
    for name in store.listdir(folder):
        if name.startswith("inner-round-"):
            round = parse_round(name.removeprefix("inner-"))
            if round is not None:
                states.append((round, f"{folder}/{name}"))
    return states


def all_inner_states(store: ModuleStore) -> dict[int, list[tuple[int, str]]]:
    """`inner_states` of every path, `{path: [(round, reference)]}`, from one recursive listing of the
    store's `islands/` folder (not one listing per path)."""
    states: dict[int, list[tuple[int, str]]] = {}
    for ref in store.walk_files("islands"):
        parts = ref.split("/")
        if len(parts) != 3 or not parts[1].startswith("path-") or not parts[1][5:].isdigit():
            continue
        path, name = int(parts[1][5:]), parts[2]
        if name.startswith("inner-round-") and ref == f"{_inner_folder(path)}/{name}":
            round = parse_round(name.removeprefix("inner-"))
            if round is not None:
                states.setdefault(path, []).append((round, ref))
    return states


def remove_inner(store: ModuleStore, ref: str) -> None:
    store.remove(ref)
