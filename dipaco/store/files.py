"""A store's files over fsspec: names that stay inside the store, atomic writes, ranged reads, listings,
conditional writes (`conditional`), transient failures retried (`errors`). The raw layer under
`module_store.ModuleStore`; only `dipaco.store`'s own modules use it directly. Every primitive here counts
what it moves in the client's `traffic` (`dipaco.store.traffic`: by direction and kind): the one place
every store read and write, conditional ones included, goes through.

    files = StoreFiles("s3://bucket/run")    # or a local directory, or memory://
    files.write_json("tasks.json", {...}); files.read_range("results/x.safetensors", 0, 8)
    data, version = files.read_versioned("lease.json"); files.write_if("lease.json", new, version=version)
    files.read_fresh("tasks.json")        # read only when its stamp changed (else one metadata request)
    files.traffic.counts().bytes("down")  # the bytes this client read
"""

from __future__ import annotations

import json
import os
import uuid
from functools import cached_property
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dipaco.store.bandwidth import BandwidthLimit
from dipaco.store.conditional import ConditionalFiles, for_filesystem
from dipaco.store.errors import RetryingFileSystem, StoreError, check_reachable, retrying
from dipaco.store.traffic import Traffic

# listing fields that change when a file is rewritten: local disks (a rewrite is a rename of a new file: a new
# inode), memory://, s3fs, gcsfs, adlfs
STAMP_FIELDS = ("size", "mtime", "ino", "created", "ETag", "LastModified", "generation", "md5Hash", "updated", "etag",
                "last_modified")


class StoreFiles:
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
        self.traffic = Traffic()  # what this client moved, by direction and kind
        self._fresh: dict[str, tuple[tuple, bytes]] = {}  # `read_fresh`: store name -> (stamp, bytes) last read

    @property
    def bytes_written(self) -> int:
        """Payload bytes this client wrote to the store (`traffic`)."""
        return self.traffic.counts().bytes("up")

    @property
    def bytes_read(self) -> int:
        """Payload bytes this client read from the store (`traffic`)."""
        return self.traffic.counts().bytes("down")

    def limit_bandwidth(self, bytes_per_second: float) -> None:
        """Pace every read and write of this client to `bytes_per_second` each way (`bandwidth`); 0 = unlimited."""
        self.traffic.limit = BandwidthLimit(bytes_per_second) if bytes_per_second > 0 else None

    @property
    def is_local(self) -> bool:
        """A directory on this machine's filesystem (not an object store)."""
        return isinstance(self.fs, LocalFileSystem)

    def check_reachable(self) -> None:
        """Refuse, before any work, a remote store whose bucket is missing or whose server cannot be reached."""
        if not self.is_local and self.shared:
            check_reachable(self.fs, self.root, url=self.url)

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
        path = self._path(relative)
        self.traffic.add("down", relative, 0)
        return self.fs.exists(path)

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Atomically write a file: readers see the old file, or the whole new one. A failed write (a full
        disk) is a StoreError naming the file and leaves no temporary file."""
        target = self._path(relative)
        parent = target.rsplit("/", 1)[0]
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with self.fs.open(tmp, "wb") as f:
                    f.write(data)
                self.fs.mv(tmp, target)
            except OSError as err:  # a full disk: no temporary file left, and the file named
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
                raise StoreError(f"store file {target} could not be written ({len(data):,} bytes): "
                                 f"{err.strerror or err}") from None
        else:
            self.fs.pipe_file(target, data)  # an object-store put is atomic
        self.traffic.add("up", relative, len(data))

    def put_file(self, relative: str, local: str) -> None:
        """Upload the local file `local` as `relative` (one PUT; a multipart upload completes atomically)."""
        target = self._path(relative)
        size = os.path.getsize(local)
        self.fs.put_file(local, target)
        self.traffic.add("up", relative, size)

    def read_bytes(self, relative: str) -> bytes:
        path = self._path(relative)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            self.traffic.add("down", relative, 0)
            raise StoreError(f"store file {path} does not exist") from None
        except IsADirectoryError:  # a folder where a file should be (one an island made)
            self.traffic.add("down", relative, 0)
            raise StoreError(f"store file {path} is a folder, not a file") from None
        self.traffic.add("down", relative, len(data))
        return data

    def read_fresh(self, relative: str) -> bytes | None:
        """A file's bytes (None when it does not exist), read only when its stamp (size, modification time and
        inode; ETag / generation on object stores) changed since this client last read it this way: an
        unchanged file costs one metadata request (a stat / HEAD) and no bytes. For the files a process
        polls (tasks.json, state.json)."""
        path = self._path(relative)
        fs = self.fs.wrapped if isinstance(self.fs, RetryingFileSystem) else self.fs

        def info_or_none(path: str) -> dict | None:
            try:
                return fs.info(path)
            except FileNotFoundError:  # here, inside the retries: they take a missing key for a missing bucket
                return None            # when the bucket's name holds "bucket"

        info = retrying(info_or_none, url=self.url, what="info")(path) if fs is not self.fs else info_or_none(path)
        self.traffic.add("down", relative, 0)
        if info is None:
            self._fresh.pop(relative, None)
            return None
        stamp = tuple(info.get(k) for k in STAMP_FIELDS)
        known = self._fresh.get(relative)
        if known is not None and known[0] == stamp and any(v is not None for v in stamp):
            return known[1]
        try:
            data = self.read_bytes(relative)
        except StoreError:  # deleted since the stamp
            self._fresh.pop(relative, None)
            return None
        self._fresh[relative] = (stamp, data)  # a rewrite between the stamp and the read: read again next time
        return data

    def read_range(self, relative: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (a ranged GET on object stores), counted in `traffic`."""
        try:
            data = self.fs.cat_file(self._path(relative), start=start, end=end)
        except FileNotFoundError:
            self.traffic.add("down", relative, 0)
            raise StoreError(f"store file {self._path(relative)} does not exist") from None
        except IsADirectoryError:
            self.traffic.add("down", relative, 0)
            raise StoreError(f"store file {self._path(relative)} is a folder, not a file") from None
        self.traffic.add("down", relative, len(data))
        if len(data) != end - start:
            raise StoreError(f"store file {self._path(relative)} ends before byte {end} (read {len(data)} "
                             f"bytes from {start})")
        return data

    def write_json(self, relative: str, obj: Any) -> None:
        self.write_bytes(relative, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, relative: str) -> Any:
        return self._json(self.read_bytes(relative), relative)

    def read_fresh_json(self, relative: str) -> Any:
        """`read_fresh`, parsed as JSON (None when the file does not exist)."""
        data = self.read_fresh(relative)
        return None if data is None else self._json(data, relative)

    def _json(self, data: bytes, relative: str) -> Any:
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8 (UnicodeDecodeError), nested too deep
            raise StoreError(f"store file {self._path(relative)} is not valid JSON: {str(err)[:200]}") from None

    def listdir(self, relative: str) -> list[str]:
        """The names in a store folder, sorted ([] when it does not exist). One listing call (on object
        stores one LIST request), not an existence check first."""
        path = self._path(relative)
        self.traffic.add("down", relative, 0)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def listdir_stamped(self, relative: str) -> dict[str, tuple]:
        """The files in a store folder, each with a stamp that changes when the file is rewritten (size,
        modification time and inode on a local disk; ETag / generation on object stores), from one listing
        call; {} when the folder does not exist. For skipping files that did not change since last read."""
        path = self._path(relative)
        self.traffic.add("down", relative, 0)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: tuple(entry.get(k) for k in STAMP_FIELDS)
                for entry in entries if entry.get("type") != "directory"}

    def walk_files(self, relative: str) -> list[str]:
        """Every file under a store folder (recursively), as store names relative to the root, sorted; []
        when the folder does not exist. One recursive listing (on object stores a LIST without delimiter,
        one request per 1000 names) rather than one listing per sub-folder."""
        return sorted(self.walk_sizes(relative))

    def walk_sizes(self, relative: str) -> dict[str, int]:
        """`walk_files` with each file's size (the same single recursive listing)."""
        base = self._path(relative).rstrip("/")
        self.traffic.add("down", relative, 0)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        root = self.root.rstrip("/") + "/"
        return {(name[len(root):] if name.startswith(root) else name): int(info.get("size") or 0)
                for name, info in found.items() if name.startswith(base + "/") and info.get("type", "file") == "file"}

    # --- compare-and-swap (`conditional`): the coordinator's lease ------------------------------------------
    @cached_property
    def _conditional(self) -> ConditionalFiles:
        files = for_filesystem(self.fs.wrapped if isinstance(self.fs, RetryingFileSystem) else self.fs)
        read = files.read

        def counted_read(path: str):  # read_versioned's GET, and the compare-read of a write done by this process
            found = read(path)
            self.traffic.add("down", self._relative(path), len(found[0]) if found else 0)
            return found

        files.read = counted_read  # an instance attribute: the backend's own `self.read` calls count too
        return files

    def _relative(self, path: str) -> str:
        root = self.root.rstrip("/") + "/"
        return path[len(root):] if path.startswith(root) else path

    @property
    def conditional_writes(self) -> bool:
        """Are `write_if`'s check and write one step for every writer (a server precondition or a lock)?"""
        return self._conditional.atomic

    def read_versioned(self, relative: str) -> tuple[bytes, str] | None:
        """A file's bytes and its version (the ETag, generation or sha256 `write_if` compares); None when absent."""
        return retrying(self._conditional.read, url=self.url, what="read_versioned")(self._path(relative))

    def write_if(self, relative: str, data: bytes, *, version: str | None) -> str | None:
        """Write the file only if it is still at `version` (None: only if it does not exist); the new version,
        or None when it was not (another writer's write came first, and stays)."""
        written = retrying(self._conditional.write, url=self.url, what="write_if")(self._path(relative), data,
                                                                                    expected=version)
        self.traffic.add("up", relative, len(data) if written is not None else 0)
        return written

    def size(self, relative: str) -> int:
        path = self._path(relative)
        self.traffic.add("down", relative, 0)
        return int(self.fs.size(path))

    def remove(self, relative: str) -> bool:
        """Delete a file or a folder with everything in it (nothing when it does not exist); True when
        something was deleted."""
        if not self.exists(relative):
            return False
        self.fs.rm(self._path(relative), recursive=True)
        self.traffic.add("up", relative, 0)
        return True
