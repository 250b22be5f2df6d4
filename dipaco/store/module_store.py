"""The module store: the only medium between the coordinator and the islands, and the only code (with
the rest of `dipaco.store`) that knows its file names.

An fsspec URL (a local directory by default; `s3://…`, `gs://…` or a shared filesystem when islands
sit on different machines). Layout under the root:

    state.json                                  last completed round (written last: the commit point)
    modules/round-000003/<module>.safetensors   every module after round 3's outer step
    modules/round-000003/checksums.json         the sha256 of each of those files (written at the commit)
    outer/round-000003/<module>.safetensors     the outer optimiser's momentum after round 3
    best.json                                   validation loss per path and version (dipaco.eval.early_stopping)
    tasks.json, rounds/, heartbeats/, results/, islands/   the task board (dipaco.store.board)
    lease.json                                  the coordinator's lease and fencing token (dipaco.store.lease)

Each file has one writer: the coordinator writes `state.json`, `modules/`, `outer/`, `best.json` and
the board's tasks, round manifests and `lease.json`; an island writes only its own heartbeat, results and inner
states. Writes are atomic (a temporary name then a rename on local disks, a single put on object
stores). Tensors are safetensors, never pickle. Every module read is checked against its version's
`checksums.json` (a file changed after its commit is an error naming it; versions committed before
checksums existed are read unchecked). Old versions are deleted by `dipaco.store.retention`.
The raw-file methods (`read_json`, `write_bytes`, `listdir`, ...) are for `dipaco.store`'s own modules.

    store = ModuleStore("runs/demo/store")
    store.write_module(0, "embeddings", {"model.embed_tokens.weight": w})
    store.commit(round=0, levels=[2, 2], modules=["embeddings", ...]); store.current_round()  # 0
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dipaco.store.errors import RetryingFileSystem, StoreError, check_reachable

log = logging.getLogger(__name__)

STORE_VERSION = 1
BEST_FILE = "best.json"
KINDS = ("modules", "outer")
CHECKSUMS = "checksums.json"
# listing fields that change when a file is rewritten: local disks (a rewrite is a rename of a new file: a new
# inode), memory://, s3fs, gcsfs, adlfs
STAMP_FIELDS = ("size", "mtime", "ino", "created", "ETag", "LastModified", "generation", "md5Hash", "updated", "etag",
                "last_modified")


class ModuleStore:
    def __init__(self, url: str):
        self.url = url
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        # Remote filesystems cache directory listings forever by default (s3fs, gcsfs): a coordinator would never
        # see an island's heartbeat or result that appeared after its first look. The store lists live.
        options = {} if protocol in ("file", "local", "memory") else {"use_listings_cache": False}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        except ImportError as err:
            raise StoreError(f"store {url}: the fsspec backend for {protocol}:// is not installed ({err}); install "
                             f"it (s3: `pip install s3fs`, gs: `pip install gcsfs`, az: `pip install adlfs`)") from None
        except ValueError as err:
            raise StoreError(f"store {url}: {err}; use a directory or an fsspec URL such as s3://bucket/run") from None
        if not isinstance(self.fs, LocalFileSystem) and protocol != "memory":
            self.fs = RetryingFileSystem(self.fs, url=url)  # transient failures retried, the others explained
        self.shared = protocol != "memory"  # seen by other processes (memory:// lives in this one only)
        self.bytes_written = 0
        self.bytes_read = 0
        self._written_sums: dict[int, dict[str, str]] = {}  # round -> module file -> sha256, of this process's writes
        self._committed_sums: dict[int, dict[str, str]] = {}  # round -> its checksums.json, once read

    @property
    def is_local(self) -> bool:
        """A directory on this machine's filesystem (not an object store)."""
        return isinstance(self.fs, LocalFileSystem)

    def check_reachable(self) -> None:
        """Refuse, before any work, a remote store whose bucket is missing or whose server cannot be reached."""
        if not self.is_local and self.shared:
            check_reachable(self.fs, self.root, url=self.url)

    # --- raw files -------------------------------------------------------------------------------
    def _path(self, relative: str) -> str:
        """The full name of a store file; a name that would lead outside the store is refused."""
        parts = relative.replace("\\", "/").split("/")
        if not relative or relative.startswith("/") or any(part in ("", ".", "..") for part in parts) or "\0" in relative:
            raise StoreError(f"store file name {relative!r} does not stay inside the store {self.url}")
        return f"{self.root.rstrip('/')}/{relative}"

    def location(self, relative: str) -> str:
        """The full name of a store file, for messages."""
        return self._path(relative)

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self._path(relative))

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Atomically write a file: readers see the old file, or the whole new one."""
        target = self._path(relative)
        parent = target.rsplit("/", 1)[0]
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, target)
        else:
            self.fs.pipe_file(target, data)  # an object-store put is atomic
        self.bytes_written += len(data)

    def read_bytes(self, relative: str) -> bytes:
        try:
            data = self.fs.cat_file(self._path(relative))
        except FileNotFoundError:
            raise StoreError(f"store file {self._path(relative)} does not exist") from None
        self.bytes_read += len(data)
        return data

    def read_range(self, relative: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (a ranged GET on object stores), counted in `bytes_read`."""
        try:
            data = self.fs.cat_file(self._path(relative), start=start, end=end)
        except FileNotFoundError:
            raise StoreError(f"store file {self._path(relative)} does not exist") from None
        if len(data) != end - start:
            raise StoreError(f"store file {self._path(relative)} ends before byte {end} (read {len(data)} "
                             f"bytes from {start})")
        self.bytes_read += len(data)
        return data

    def write_json(self, relative: str, obj: Any) -> None:
        self.write_bytes(relative, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, relative: str) -> Any:
        data = self.read_bytes(relative)
        try:
            return json.loads(data)
        except json.JSONDecodeError as err:
            raise StoreError(f"store file {self._path(relative)} is not valid JSON: {err}") from None

    def write_tensors(self, relative: str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        self.write_bytes(relative, data)
        return len(data)

    def read_tensors(self, relative: str) -> dict[str, torch.Tensor]:
        return self._decode_tensors(self.read_bytes(relative), relative)

    def _decode_tensors(self, data: bytes, relative: str) -> dict[str, torch.Tensor]:
        try:
            return load_safetensors(data)
        except Exception as err:  # safetensors raises its own error types
            raise StoreError(f"store file {self._path(relative)} is not a valid safetensors file: {err}") from None

    def listdir(self, relative: str) -> list[str]:
        """The names in a store folder, sorted ([] when it does not exist). One listing call (on object
        stores one LIST request), not an existence check first."""
        try:
            entries = self.fs.ls(self._path(relative), detail=False)
        except FileNotFoundError:
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def listdir_stamped(self, relative: str) -> dict[str, tuple]:
        """The files in a store folder, each with a stamp that changes when the file is rewritten (size,
        modification time and inode on a local disk; ETag / generation on object stores), from one listing
        call; {} when the folder does not exist. For skipping files that did not change since last read."""
        try:
            entries = self.fs.ls(self._path(relative), detail=True)
        except FileNotFoundError:
            return {}
        return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: tuple(entry.get(k) for k in STAMP_FIELDS)
                for entry in entries if entry.get("type") != "directory"}

    def walk_files(self, relative: str) -> list[str]:
        """Every file under a store folder (recursively), as store names relative to the root, sorted; []
        when the folder does not exist. One recursive listing (on object stores a LIST without delimiter,
        one request per 1000 names) rather than one listing per sub-folder."""
        base = self._path(relative).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        root = self.root.rstrip("/") + "/"
        return sorted(name[len(root):] if name.startswith(root) else name for name in found
                      if name.startswith(base + "/"))

    def size(self, relative: str) -> int:
        return int(self.fs.size(self._path(relative)))

    def remove(self, relative: str) -> None:
        """Delete a file or a folder with everything in it (nothing when it does not exist)."""
        if self.exists(relative):
            self.fs.rm(self._path(relative), recursive=True)
            self._committed_sums.clear()  # read again when needed

    # --- run state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The committed state, or None for an empty store."""
        if not self.exists("state.json"):
            return None
        state = self.read_json("state.json")
        if state.get("store_version") != STORE_VERSION:
            raise StoreError(
                f"{self._path('state.json')} has store_version {state.get('store_version')!r}; "
                f"this dipaco reads version {STORE_VERSION}"
            )
        return state

    def commit(self, *, round: int, **meta: Any) -> None:
        """Mark `round` complete; written after every file of that round. First the version's
        checksums.json: the sha256 of each of its module files (hashed as written, else read back)."""
        folder = f"modules/{round_dir(round)}"
        written = self._written_sums.pop(round, {})
        sums = {}
        for name in self.listdir(folder):
            if name.endswith(".safetensors"):
                sums[name] = written.get(name) or hashlib.sha256(self.read_bytes(f"{folder}/{name}")).hexdigest()
        if sums:
            self.write_json(f"{folder}/{CHECKSUMS}", sums)
            self._committed_sums[round] = sums
        self.write_json("state.json", {"store_version": STORE_VERSION, "round": round, **meta})

    def current_round(self) -> int:
        state = self.state()
        if state is None:
            if not self.shared:
                raise StoreError(f"store {self.url} is empty: a memory:// store lives in one process, so nothing "
                                 f"another dipaco command trained is in it; use a directory or a shared URL")
            raise StoreError(f"store {self.url} is empty: run `dipaco train` to initialise it")
        return int(state["round"])

    # --- modules and outer state -----------------------------------------------------------------
    def write_module(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
        self.write_bytes(_version_file("modules", round, name), data)
        self._written_sums.setdefault(round, {})[f"{name}.safetensors"] = hashlib.sha256(data).hexdigest()

    def read_module(self, round: int, name: str) -> dict[str, torch.Tensor]:
        """Module `name` of version `round`, verified against the version's checksums."""
        relative = _version_file("modules", round, name)
        data = self.read_bytes(relative)
        expected = self._checksums(round).get(f"{name}.safetensors")
        if expected is not None:
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise StoreError(f"store file {self._path(relative)} has sha256 {actual[:16]}..., but version "
                                 f"{round}'s {CHECKSUMS} lists {expected[:16]}...: it changed after it was committed. "
                                 f"Restore it, or delete the store's versions from {round} on and train again")
        return self._decode_tensors(data, relative)

    def _checksums(self, round: int) -> dict[str, str]:
        """Version `round`'s checksums ({} for an uncommitted version or one committed without them)."""
        if round not in self._committed_sums:
            relative = f"modules/{round_dir(round)}/{CHECKSUMS}"
            if not self.exists(relative):
                return {}
            self._committed_sums[round] = self.read_json(relative)
        return self._committed_sums[round]

    def read_modules(self, round: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Several modules of version `round`, e.g. every module of one path."""
        return {name: self.read_module(round, name) for name in names}

    def module_shapes(self, name: str) -> dict[str, tuple[list[int], str]]:
        """Each parameter's (shape, dtype) of module `name`, from the safetensors header of version 0 (of the
        newest version when 0 was pruned): shapes never change."""
        relative = _version_file("modules", 0, name)
        versions = self.versions("modules")
        if not self.exists(relative) and versions:
            relative = _version_file("modules", versions[-1], name)
        size = int.from_bytes(self.read_range(relative, 0, 8), "little")
        header = json.loads(self.read_range(relative, 8, 8 + size))
        return {param: (spec["shape"], spec["dtype"]) for param, spec in header.items() if param != "__metadata__"}

    def has_module(self, round: int, name: str) -> bool:
        return self.exists(_version_file("modules", round, name))

    def write_outer_state(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.write_tensors(_version_file("outer", round, name), tensors)

    def read_outer_state(self, round: int, name: str) -> dict[str, torch.Tensor] | None:
        relative = _version_file("outer", round, name)
        return self.read_tensors(relative) if self.exists(relative) else None

    # --- versions, for retention (dipaco.store.retention) -----------------------------------------
    def versions(self, kind: str) -> list[int]:
        """The rounds that have a folder of `kind` ("modules" or "outer"), ascending."""
        return _rounds(self.listdir(_kind(kind)))

    def prune_version(self, kind: str, round: int, *, keep: set[str] = frozenset()) -> int:
        """Delete version `round` of `kind` except the files of the modules in `keep` (the whole folder
        when `keep` is empty); returns the bytes of the files kept."""
        folder = f"{_kind(kind)}/{round_dir(round)}"
        if not keep:
            self.remove(folder)
            return 0
        kept = 0
        for name in self.listdir(folder):
            if name.endswith(".safetensors") and name.removesuffix(".safetensors") in keep:
                kept += self.size(f"{folder}/{name}")
            elif name == CHECKSUMS:
                continue  # the kept files are still checked
            else:
                self.remove(f"{folder}/{name}")
        return kept

    # --- early stopping's record (dipaco.eval.early_stopping) --------------------------------------
    def read_best(self) -> dict[str, Any] | None:
        """best.json: each path's validation loss per module version and its best version (None when absent)."""
        return self.read_json(BEST_FILE) if self.exists(BEST_FILE) else None

    def write_best(self, obj: dict[str, Any]) -> None:
        self.write_json(BEST_FILE, obj)

    # --- tensors with JSON metadata in one file (inner optimiser states) -----------------------------
    def write_tensors_with_meta(self, relative: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
        """One file, the metadata in its safetensors header, so tensors and metadata never disagree."""
        return self.write_tensors(relative, tensors, {"meta": json.dumps(meta)})

    def read_tensors_with_meta(self, relative: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        data = self.read_bytes(relative)
        try:
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["meta"])
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            raise StoreError(f"store file {self._path(relative)} has no valid metadata: {err}") from None
        return self._decode_tensors(data, relative), meta


def round_dir(round: int) -> str:
    """The folder (or file stem) name of round `round`: `round-000003`."""
    return f"round-{round:06d}"


def parse_round(name: str) -> int | None:
    """`round-000003` (or `round-000003.json`) → 3; None for any other name."""
    stem = name.split(".", 1)[0]
    if not stem.startswith("round-") or not stem[6:].isdigit():
        return None
    return int(stem[6:])


def _rounds(names: list[str]) -> list[int]:
    return sorted(r for r in map(parse_round, names) if r is not None)


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"a store version is one of {KINDS}, not {kind!r}")
    return kind


def _version_file(kind: str, round: int, name: str) -> str:
    return f"{kind}/{round_dir(round)}/{name}.safetensors"
