"""Store-only runs: what a run publishes to its store, and how a command given only the URL runs from it.

    dipaco coordinator --config configs/demo.yaml --run runs/demo store.url=s3://bucket/demo  # publishes
    dipaco island --store s3://bucket/demo            # on any machine: nothing local but the cache

`publish_run` (`dipaco train` / `dipaco coordinator`, holding the lease) puts the run's config,
tokenizer, router, shard index and shard files in the store, content-addressed (`dipaco.store.publish`).
`fetch_run` makes a store-only command's local run directory from them (small files only), and
`shard_fetcher` gives its shard reader each shard's bytes on first use from the machine's cache. The
command line's overrides apply on top of the published config (docs/islands.md#store-only-islands).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

from dipaco.atomic import write_bytes
from dipaco.config import Config, load_config
from dipaco.outputs import check_run_dir, mark_run_dir
from dipaco.run_dir import RunDir
from dipaco.store.cache import ObjectCache, resolve_cache_dir
from dipaco.store.errors import StoreError
from dipaco.store.module_store import ModuleStore
from dipaco.store.publish import (
    PUBLISHED,
    PublishedFile,
    PublishStats,
    file_sha256,
    publication_json,
    publish,
    read_object,
    read_publication,
)

log = logging.getLogger(__name__)

ROUTING_FILES = ("router.json", "router.safetensors", "fingerprint.json")  # what islands and eval use of routing/
SHARD_META = ("index.json", "fingerprint.json")  # the small files of shards/ (the rest is shard data)
PUBLICATION_WAIT = 300.0  # seconds `dipaco island --store URL` waits for the run to be published there
PUBLICATION_POLL = 2.0


def is_store_only(run: RunDir) -> bool:
    """A run directory made by `fetch_run` (its shards live in the store)."""
    return (run.root / PUBLISHED).is_file()


def run_files(run: RunDir) -> tuple[dict[str, tuple[Path, str | None]], dict[str, str]]:
    """What `run` publishes: (name -> (local file, sha256 when known)) for the files it holds, and
    (name -> sha256) of the shard files its index lists that it does not hold (a store-only run's)."""
    files: dict[str, tuple[Path, str | None]] = {"config.yaml": (run.config, None)}
    for path in sorted(run.tokenizer.rglob("*")) if run.tokenizer.is_dir() else []:
        if path.is_file():
            files[path.relative_to(run.root).as_posix()] = (path, None)
    for name in ROUTING_FILES:
        if (run.routing / name).is_file():
            files[f"routing/{name}"] = (run.routing / name, None)
    for name in SHARD_META:
        if (run.shards / name).is_file():
            files[f"shards/{name}"] = (run.shards / name, None)
    absent: dict[str, str] = {}
    for file, sha256 in shard_files(run.shards / "index.json").items():
        local = run.shards / file
        if local.is_file():
            files[f"shards/{file}"] = (local, sha256)  # the index's hash: unchanged shards are never read
        else:
            absent[f"shards/{file}"] = sha256
    return files, absent


def shard_files(index_path: Path) -> dict[str, str]:
    """Every data file `index.json` lists (train / val block shards of each path, test arrays) -> sha256."""
    index = json.loads(index_path.read_text())
    out = {}
    for entry in index["paths"]:
        for split in ("train", "val"):
            for shard in entry[split]["shards"]:
                out[shard["file"]] = shard["sha256"]
    for shard in index["test"]["shards"]:
        for prefix in ("", "offsets_", "doc_ids_", "paths_"):
            out[shard[f"{prefix}file"]] = shard[f"{prefix}sha256"]
    return out


def publish_run(store: ModuleStore, run: RunDir) -> PublishStats:
    """Publish `run`'s config, tokenizer, router and shards to `store` (see the module docstring). A
    store-only run re-publishes what it holds (its config) and keeps the shards already published."""
    files, absent = run_files(run)
    kept: dict[str, PublishedFile] = {}
    if absent:
        published = read_publication(store) if store.exists(PUBLISHED) else {}
        for name, sha256 in sorted(absent.items()):
            entry = published.get(name)
            if entry is None or entry.sha256 != sha256:
                raise StoreError(f"{run.shards / name.removeprefix('shards/')} is listed in {run.shards / 'index.json'} "
                                 f"but is neither in {run.root} nor published in {store.url}; run from the run "
                                 f"directory that holds the shards (`dipaco shard` makes them)")
            kept[name] = entry
    return publish(store, files, kept=kept)


def fetch_run(url: str, *, run_root: Path | None, overrides: list[str],
              wait: float = 0.0) -> tuple[Config, RunDir]:
    """A store-only command's config and local run directory, from the run published in the store at `url`
    (small files only: shards come later, through `shard_fetcher`). `wait`: seconds to wait for a
    coordinator started at the same time to publish the run (islands of a cluster job start together)."""
    machine = load_config(None, overrides).store  # this machine's cache settings (the command line's)
    store = ModuleStore(url)
    if not store.shared:
        raise ValueError(f"--store {url} lives in this process's memory: nothing is published there; use a "
                         f"directory or a shared URL (s3://, gs://)")
    store.check_reachable()
    deadline = time.monotonic() + wait
    if not store.exists(PUBLISHED) and wait > 0:
        log.info("waiting up to %.0fs for the coordinator to publish the run in %s", wait, url)
        while not store.exists(PUBLISHED) and time.monotonic() < deadline:
            time.sleep(PUBLICATION_POLL)
    files = read_publication(store)
    if "config.yaml" not in files or "shards/index.json" not in files:
        raise StoreError(f"the run published in {url} lacks config.yaml or shards/index.json; restart its coordinator")
    root = run_root or resolve_cache_dir(machine.cache_dir) / "runs" / hashlib.sha256(url.encode()).hexdigest()[:16]
    run = RunDir(root)
    check_run_dir(run.root)  # before writing: never into a directory that holds something else
    mark_run_dir(run.root)
    fetched = 0
    for name, entry in sorted(files.items()):
        if name.startswith("shards/") and name.removeprefix("shards/") not in SHARD_META:
            continue  # shard data: on first use
        local = run.root / name
        if local.is_file() and local.stat().st_size == entry.bytes and file_sha256(local) == entry.sha256:
            continue
        write_bytes(local, read_object(store, entry))
        fetched += entry.bytes
    write_bytes(run.root / PUBLISHED, (json.dumps(publication_json(files), indent=1) + "\n").encode())
    log.info("store-only run from %s in %s (%d bytes of config, tokenizer and index fetched)", url, run.root, fetched)
    config = load_config(run.config, overrides)
    config = dataclasses.replace(config, store=dataclasses.replace(
        config.store, url=url, cache_dir=machine.cache_dir, cache_max_bytes=machine.cache_max_bytes))
    return config, run


class ShardFetcher:
    """`ShardReader`'s `fetch` for a store-only run: each shard file's bytes from the machine's cache,
    downloaded from the store (and checked) on first use."""

    def __init__(self, *, store: ModuleStore, files: dict[str, PublishedFile], cache: ObjectCache):
        self.store, self.files, self.cache = store, files, cache

    def __call__(self, file: str, sha256: str) -> bytes:
        entry = self.files.get(f"shards/{file}")
        if entry is None or entry.sha256 != sha256:
            raise StoreError(f"shard file {file} (sha256 {sha256[:16]}...) is not published in {self.store.url}: the "
                             f"store holds another run's shards; restart this command to fetch the current index")
        return self.cache.read(entry.sha256, size=entry.bytes, name=f"{entry.name} of {self.store.url}",
                               fetch=lambda: read_object(self.store, entry))


def shard_fetcher(run: RunDir, *, store: ModuleStore, config: Config) -> ShardFetcher | None:
    """The shard reader's `fetch` for a store-only `run` (None for a run that holds its shards)."""
    if not is_store_only(run):
        return None
    marker = run.root / PUBLISHED
    try:
        body = json.loads(marker.read_text())
        files = {name: PublishedFile(name=name, sha256=e["sha256"], bytes=e["bytes"]) for name, e in body["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{marker} cannot be read ({err}); run the command with --store URL again") from None
    cache = ObjectCache(resolve_cache_dir(config.store.cache_dir), max_bytes=config.store.cache_max_bytes)
    return ShardFetcher(store=store, files=files, cache=cache)
