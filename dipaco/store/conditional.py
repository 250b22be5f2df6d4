"""Conditional writes (compare-and-swap) of one store file: create it only if it does not exist, replace it
only if it is still the version read. The coordinator's lease (`lease`) is built on them.

    found = cas.read(path)                          # (bytes, version) or None when the file does not exist
    version = cas.write(path, data, expected=None)  # create: the new version, or None when it exists
    version = cas.write(path, data, expected=v)     # replace: None when it is no longer at version v

`for_filesystem(fs)` picks how, by the store's filesystem:
- S3 (s3fs): PutObject with `If-None-Match: *` or `If-Match: <ETag>`, so the server decides and a writer
  that lost (a deposed coordinator) is refused with 412; GetObject gives the ETag with the bytes.
- GCS (gcsfs): an upload with `ifGenerationMatch` (0: the object must not exist); a media GET gives the
  generation (`x-goog-generation`) with the bytes. Written to the JSON API; not run in the tests here.
- a local or shared POSIX directory: under an exclusive `flock` of `<file>.lock`, read, compare the bytes'
  sha256 with the expected version, write a temporary file and rename it over the file.
- memory:// (one process): the same under a process-wide lock.
- any other filesystem: read, compare, write, which another writer can interleave (`atomic` is False);
  the lease then reads back what it wrote, as before conditional writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

log = logging.getLogger(__name__)

Found = tuple[bytes, str]  # a file's bytes and its version (ETag, generation, sha256)
# S3's answers to a failed precondition (412, and 409 when a concurrent conditional write is in flight)
_S3_REFUSED = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


class ConditionalFiles(Protocol):
    atomic: bool  # the check and the write are one step for every writer (a server or a lock decides)

    def read(self, path: str) -> Found | None: ...

    def write(self, path: str, data: bytes, *, expected: str | None) -> str | None: ...


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def for_filesystem(fs: Any) -> ConditionalFiles:
    """The conditional writes `fs` (an fsspec filesystem, not wrapped) offers (module docstring)."""
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    if isinstance(fs, LocalFileSystem):
        return LockedFiles()
    if isinstance(fs, MemoryFileSystem):
        return MemoryFiles(fs)
    if hasattr(fs, "_call_s3"):
        return S3Files(fs)
    if type(fs).__name__ == "GCSFileSystem":
        return GCSFiles(fs)
    return UncheckedFiles(fs)


class LockedFiles:
    """A POSIX directory: compare-and-swap under an exclusive flock of `<file>.lock`."""

    atomic = True

    def read(self, path: str) -> Found | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, sha256(data)

    def write(self, path: str, data: bytes, *, expected: str | None) -> str | None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _locked(f"{path}.lock"):
            found = self.read(path)
            if (found[1] if found else None) != expected:
                return None
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        return sha256(data)


@contextlib.contextmanager
def _locked(lock_file: str) -> Iterator[None]:
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_MEMORY_LOCK = threading.Lock()


class MemoryFiles:
    """memory:// lives in one process: compare-and-swap under a process-wide lock."""

    atomic = True

    def __init__(self, fs: Any):
        self.fs = fs

    def read(self, path: str) -> Found | None:
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, sha256(data)

    def write(self, path: str, data: bytes, *, expected: str | None) -> str | None:
        with _MEMORY_LOCK:
            found = self.read(path)
            if (found[1] if found else None) != expected:
                return None
            self.fs.pipe_file(path, data)
        return sha256(data)


class S3Files:
    """S3 (and S3-compatible servers): the server checks `If-None-Match` / `If-Match` on the PUT."""

    atomic = True

    def __init__(self, fs: Any):
        self.fs = fs

    def _sync(self, coroutine, *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine, *args, **kwargs)

    def read(self, path: str) -> Found | None:
        bucket, key, _ = self.fs.split_path(path)

        async def get() -> Found:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = response["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return data, response["ETag"]

        try:
            return self._sync(get)
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes, *, expected: str | None) -> str | None:
        bucket, key, _ = self.fs.split_path(path)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            response = self._sync(self.fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except FileNotFoundError:  # If-Match on a file that is gone
            return None
        except OSError as err:
            if isinstance(err, FileExistsError) or _s3_code(err) in _S3_REFUSED:
                return None
            raise
        self.fs.invalidate_cache(path)
        return response["ETag"]


def _s3_code(err: BaseException) -> str | None:
    """The S3 error code of a ClientError that s3fs translated into `err` (its cause)."""
    cause = err.__cause__
    response = getattr(cause, "response", None) or {}
    error = response.get("Error", {})
    return str(error.get("Code")) if error.get("Code") is not None else None


class GCSFiles:
    """Google Cloud Storage: uploads with an `ifGenerationMatch` precondition (JSON API)."""

    atomic = True

    def __init__(self, fs: Any):
        self.fs = fs

    def _sync(self, coroutine, *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine, *args, **kwargs)

    def read(self, path: str) -> Found | None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            headers, data = self._sync(self.fs._call, "GET", "b/{}/o/{}", bucket, key, alt="media")
        except FileNotFoundError:
            return None
        return data, str(headers.get("x-goog-generation") or headers.get("X-Goog-Generation"))

    def write(self, path: str, data: bytes, *, expected: str | None) -> str | None:
        import json
        from urllib.parse import quote

        bucket, key, _ = self.fs.split_path(path)
        url = f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        try:
            _, body = self._sync(self.fs._call, "POST", url, uploadType="media", name=key, data=data,
                                 ifGenerationMatch="0" if expected is None else expected,
                                 headers={"Content-Type": "application/octet-stream"})
        except FileNotFoundError:
            return None
        except OSError as err:  # gcsfs raises an HttpError (an OSError) carrying the status
            if getattr(err, "code", None) == 412 or "412" in str(err) or "recondition" in str(err):
                return None
            raise
        self.fs.invalidate_cache(path)
        return str(json.loads(body)["generation"])


class UncheckedFiles:
    """A filesystem without conditional writes: read, compare, write (not atomic: `atomic` is False)."""

    atomic = False

    def __init__(self, fs: Any):
        self.fs = fs

    def read(self, path: str) -> Found | None:
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, sha256(data)

    def write(self, path: str, data: bytes, *, expected: str | None) -> str | None:
        found = self.read(path)
        if (found[1] if found else None) != expected:
            return None
        self.fs.pipe_file(path, data)
        return sha256(data)
