"""The run's inputs published in its store, so that an island or a coordinator needs only the store's URL.

`dipaco train` / `dipaco coordinator` publish the resolved config, the tokenizer, the router and every
shard file (`dipaco.pipeline.published` lists them); `dipaco island --store URL` reads them back, each
shard only when the island trains its path. Layout under the store's root:

    published.json                  {"version": 1, "files": {"shards/path-0003/train-00000.tok.zst":
                                      {"sha256": ..., "bytes": ...}, "config.yaml": ..., ...}}
    objects/ab/ab12...ef            each file's bytes, named by their sha256 (content-addressed)

Objects go first, `published.json` last (one atomic write: the commit point), and only when it changes.
An object already in the store with the right size is not uploaded again (one listing of `objects/`
decides; a shard's sha256 is the one its `index.json` records, so unchanged shards are not even read).
On a local-directory store an object is a hard link to the run's file where the filesystem allows (no
copy). Every object read is checked against its sha256: a corrupt object is refused naming it.

    stats = publish(store, {"config.yaml": (Path("runs/x/config.yaml"), None), ...})
    files = read_publication(store)            # name -> PublishedFile
    data = read_object(store, files["config.yaml"])
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dipaco.store.errors import StoreError
from dipaco.store.module_store import ModuleStore

log = logging.getLogger(__name__)

PUBLISHED = "published.json"
OBJECTS = "objects"
VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PublishedFile:
    """One file of the run (its name relative to the run directory) and the object holding it."""

    name: str
    sha256: str
    bytes: int

    @property
    def object(self) -> str:
        return object_name(self.sha256)


@dataclass(frozen=True)
class PublishStats:
    objects: int  # files published
    uploaded: int  # objects written this time
    uploaded_bytes: int
    kept: int  # objects already in the store (not written again)
    kept_bytes: int
    manifest_written: bool  # False when published.json already said the same


def object_name(sha256: str) -> str:
    """The store file of the object with this sha256: `objects/ab/ab12...`."""
    if not _SHA256.fullmatch(sha256):
        raise StoreError(f"{sha256!r} is not a sha256 hex digest")
    return f"{OBJECTS}/{sha256[:2]}/{sha256}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stored_objects(store: ModuleStore) -> dict[str, int]:
    """sha256 -> size of every object in the store (one recursive listing)."""
    if not store.exists(OBJECTS):
        return {}
    found = store.walk_sizes(OBJECTS)
    return {name.rsplit("/", 1)[-1]: size for name, size in found.items() if _SHA256.fullmatch(name.rsplit("/", 1)[-1])}


def publish(store: ModuleStore, files: dict[str, tuple[Path, str | None]], *,
            kept: dict[str, PublishedFile] | None = None) -> PublishStats:
    """Publish `files` (run-relative name -> (local file, its sha256 when known, else hashed here)) and the
    already published `kept` entries (files this process does not hold, e.g. a store-only coordinator's
    shards). Objects first, then `published.json`; objects of the right size already there are kept."""
    present = stored_objects(store)
    entries: dict[str, PublishedFile] = dict(kept or {})
    uploaded = uploaded_bytes = kept_count = kept_bytes = 0
    for name, (local, sha256) in sorted(files.items()):
        size = local.stat().st_size
        sha256 = sha256 or file_sha256(local)
        entries[name] = PublishedFile(name=name, sha256=sha256, bytes=size)
        if present.get(sha256) == size:
            kept_count, kept_bytes = kept_count + 1, kept_bytes + size
            continue
        _put(store, local, object_name(sha256), sha256=sha256)
        present[sha256] = size
        uploaded, uploaded_bytes = uploaded + 1, uploaded_bytes + size
    for entry in entries.values():
        if present.get(entry.sha256) != entry.bytes:
            raise StoreError(f"{entry.name} is to stay published, but its object {store.location(entry.object)} is "
                             f"not in the store with {entry.bytes} bytes; publish from the run directory that has it")
    body = publication_json(entries)
    current = store.read_json(PUBLISHED) if store.exists(PUBLISHED) else None
    changed = current != body
    if changed:
        store.write_json(PUBLISHED, body)
    stats = PublishStats(objects=len(entries), uploaded=uploaded, uploaded_bytes=uploaded_bytes, kept=kept_count,
                         kept_bytes=kept_bytes, manifest_written=changed)
    log.info("published %d files to %s: %d objects uploaded (%.1f MB), %d already there (%.1f MB)%s",
             stats.objects, store.url, uploaded, uploaded_bytes / 1e6, kept_count, kept_bytes / 1e6,
             "" if changed else ", published.json unchanged")
    return stats


def _put(store: ModuleStore, local: Path, relative: str, *, sha256: str) -> None:
    """Upload one object atomically; on a local-directory store, a hard link to `local` where possible
    (counted in the store's traffic as the upload it stands for)."""
    target = store.location(relative)
    if store.is_local:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            os.link(local, tmp)  # same filesystem: no copy (content-addressed, so never changed in place)
        except OSError:
            store.write_bytes(relative, local.read_bytes())
            return
        os.replace(tmp, target)
        store.traffic.add("up", relative, local.stat().st_size)
        return
    store.put_file(relative, str(local))  # one PUT (a multipart upload completes atomically)


def read_publication(store: ModuleStore) -> dict[str, PublishedFile]:
    """Every published file by name; a store with nothing published is refused saying how to publish."""
    if not store.exists(PUBLISHED):
        raise StoreError(f"store {store.url} has no published run ({store.location(PUBLISHED)} does not exist): "
                         f"start the run's coordinator first (`dipaco train` or `dipaco coordinator --run DIR` with "
                         f"store.url={store.url}), which publishes its config, tokenizer and shards there")
    body = store.read_json(PUBLISHED)
    where = store.location(PUBLISHED)
    if not isinstance(body, dict) or body.get("version") != VERSION:
        raise StoreError(f"{where} has version {body.get('version') if isinstance(body, dict) else None!r}; this "
                         f"dipaco reads version {VERSION}")
    files = body.get("files")
    if not isinstance(files, dict):
        raise StoreError(f"{where}: 'files' is not an object")
    out = {}
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])
                and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0):
            raise StoreError(f"{where}: files[{name!r}] is not {{sha256: hex digest, bytes: int}}: {entry!r}")
        out[name] = PublishedFile(name=name, sha256=entry["sha256"], bytes=entry["bytes"])
    return out


def read_object(store: ModuleStore, entry: PublishedFile) -> bytes:
    """The bytes of a published file, checked against its sha256 and size (a `StoreError` naming the object)."""
    try:
        data = store.read_bytes(entry.object)
    except StoreError as err:
        raise StoreError(f"{entry.name} is published, but {err}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256 or len(data) != entry.bytes:
        raise StoreError(f"store object {store.location(entry.object)} ({entry.name}) is corrupt: sha256 "
                         f"{digest[:16]}... and {len(data)} bytes, published as {entry.sha256[:16]}... and "
                         f"{entry.bytes} bytes. Delete that object: the run's coordinator uploads it again when it "
                         f"next starts (`dipaco train` / `dipaco coordinator --run DIR`)")
    return data


def publication_json(files: dict[str, PublishedFile]) -> dict[str, Any]:
    """The body of `published.json` for `files` (what a store-only run keeps next to its fetched files)."""
    return {"version": VERSION, "files": {n: {"sha256": e.sha256, "bytes": e.bytes} for n, e in sorted(files.items())}}
