"""A machine's local cache of published store objects (shards): verified, shared, evicted by size.

An island given only the store's URL keeps the objects it downloads (the shards of the paths it trains)
under `store.cache_dir` (default `$XDG_CACHE_HOME/dipaco`, else `~/.cache/dipaco`):

    <cache_dir>/objects/ab/ab12...ef      a file, named by the sha256 of its bytes

Content addressing makes the cache safe to share between the islands of one machine, their tasks and
runs: the same bytes have one name. An object is checked by sha256 when downloaded (before it is renamed
into place, so a half-written file never looks complete) and every time it is re-used (it is read whole
and hashed: an object is handed out as bytes, so another process's eviction never leaves a reader with a
vanished file); a cached copy that fails the check is deleted and downloaded again. Every use marks the file's mtime; after each
download, the least recently used objects are deleted until the cache holds at most `max_bytes` (the
object just fetched is never evicted, so a budget below one shard still works, one shard at a time).

    cache = ObjectCache(Path("~/.cache/dipaco").expanduser(), max_bytes=10 << 30)
    data = cache.read(sha256, size=n, name="shards/path-0003/train-00000.tok.zst", fetch=lambda: download())
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/dipaco`, else `~/.cache/dipaco`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dipaco"


def resolve_cache_dir(setting: str) -> Path:
    """The cache folder `store.cache_dir` names ("" = `default_cache_dir()`; `~` expanded)."""
    return Path(setting).expanduser() if setting else default_cache_dir()


@dataclass
class CacheStats:
    downloads: int = 0
    downloaded_bytes: int = 0
    reuses: int = 0
    reused_bytes: int = 0
    redownloads: int = 0  # cached copies that failed their check
    evicted: int = 0
    evicted_bytes: int = 0


class ObjectCache:
    def __init__(self, root: Path, *, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the cache's max_bytes must be >= 0 (0 = no limit), got {max_bytes}")
        self.root, self.max_bytes = Path(root), max_bytes
        self.objects = self.root / "objects"
        self.stats = CacheStats()
        self._lock = threading.Lock()  # a reader's prefetch thread and the trainer may ask at once

    def path_of(self, sha256: str) -> Path:
        return self.objects / sha256[:2] / sha256

    def read(self, sha256: str, *, size: int, name: str, fetch: Callable[[], bytes]) -> bytes:
        """The bytes of the object `sha256` (`name` for messages): the cached copy when it hashes right, else
        `fetch()`'s bytes (which must hash to `sha256`), written to the cache atomically."""
        with self._lock:
            path = self.path_of(sha256)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = None
            if data is not None:
                if hashlib.sha256(data).hexdigest() == sha256:
                    os.utime(path)  # most recently used
                    self.stats.reuses += 1
                    self.stats.reused_bytes += len(data)
                    return data
                log.warning("the cached copy %s of %s is corrupt (sha256 mismatch): downloading it again", path, name)
                path.unlink(missing_ok=True)
                self.stats.redownloads += 1
            data = fetch()
            digest = hashlib.sha256(data).hexdigest()
            if digest != sha256 or len(data) != size:
                raise ValueError(f"{name}: the {len(data)} bytes fetched hash to {digest[:16]}..., not the "
                                 f"{size} bytes of {sha256[:16]}...")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            self.stats.downloads += 1
            self.stats.downloaded_bytes += len(data)
            log.debug("cached %s (%d bytes) as %s", name, len(data), path)
            self._evict(keep=path)
            return data

    def contents(self) -> dict[str, int]:
        """sha256 -> bytes of every object in the cache."""
        return {p.name: p.stat().st_size for p in self._files()}

    def _files(self) -> list[Path]:
        if not self.objects.is_dir():
            return []
        return [p for p in self.objects.glob("??/*") if p.is_file() and ".tmp-" not in p.name]

    def _evict(self, *, keep: Path) -> None:
        """Delete least recently used objects (not `keep`) until the cache holds at most `max_bytes`."""
        if not self.max_bytes:
            return
        entries = []
        for p in self._files():
            try:
                stat = p.stat()
            except FileNotFoundError:  # another process evicted it
                continue
            entries.append((stat.st_mtime_ns, stat.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            self.stats.evicted += 1
            self.stats.evicted_bytes += size
            log.info("cache %s: evicted %s (%d bytes, least recently used) to stay within %d bytes",
                     self.root, p.name[:16], size, self.max_bytes)
