"""Store-only islands (docs/islands.md#store-only-islands): the run published to its store, islands that get
only the URL and download only their paths' shards into a verified, size-bounded cache.

    python -m pytest tests/test_store_only.py            # a local-directory store (the S3 ones: test_s3_store.py)
"""

import hashlib
import json
import os

import pytest
from cli_helpers import TINY, copy_run, dipaco_in_process

from dipaco.config import load_config, save_config
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.published import fetch_run, publish_run, shard_files
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir
from dipaco.store.cache import ObjectCache
from dipaco.store.module_store import ModuleStore
from dipaco.store.publish import object_name, read_publication


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def published_run(tiny_routed, tmp_path, overrides=()):
    """The coordinator's side: a routed run whose store (a directory elsewhere) is initialised and published."""
    run = copy_run(tiny_routed, tmp_path / "coordinator")
    config = load_config(TINY, [f"store.url={tmp_path / 'store'}", "hardware.device=cpu", *overrides])
    save_config(config, run.config)
    factory = PathFactory(config, run)
    start_or_resume_store(factory)
    return run, factory.store, publish_run(factory.store, run)


def path_shards(run: RunDir, path: int) -> dict[str, str]:
    """shards/<file> -> sha256 of one path's train and val shards."""
    return {f"shards/{file}": digest for file, digest in shard_files(run.shards / "index.json").items()
            if file.startswith(f"path-{path:04d}/")}


# --- the cache ----------------------------------------------------------------------------------------------
def test_the_cache_downloads_once_reuses_verified_and_evicts_the_least_recently_used(tmp_path):
    blobs = [bytes([i + 1]) * 1000 for i in range(3)]
    fetched = []

    def fetch(data):
        return lambda: fetched.append(sha(data)) or data

    cache = ObjectCache(tmp_path, max_bytes=2500)
    for data in blobs[:2]:
        assert cache.read(sha(data), size=1000, name="x", fetch=fetch(data)) == data
    assert cache.read(sha(blobs[0]), size=1000, name="x", fetch=fetch(blobs[0])) == blobs[0]  # reused: blob 1 is older
    os.utime(cache.path_of(sha(blobs[1])), ns=(1, 1))
    cache.read(sha(blobs[2]), size=1000, name="x", fetch=fetch(blobs[2]))
    assert fetched == [sha(b) for b in blobs]
    assert set(cache.contents()) == {sha(blobs[0]), sha(blobs[2])}  # blob 1, the least recently used, evicted
    assert cache.stats.reuses == 1 and cache.stats.evicted == 1

    cache.path_of(sha(blobs[0])).write_bytes(b"\0" * 1000)  # a cached copy gone bad: downloaded again
    assert cache.read(sha(blobs[0]), size=1000, name="x", fetch=fetch(blobs[0])) == blobs[0]
    assert cache.stats.redownloads == 1 and cache.path_of(sha(blobs[0])).read_bytes() == blobs[0]


def test_the_cache_refuses_bytes_that_do_not_match_and_keeps_nothing(tmp_path):
    cache = ObjectCache(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="shards/p.tok.zst: the 3 bytes fetched hash to"):
        cache.read(sha(b"abc"), size=3, name="shards/p.tok.zst", fetch=lambda: b"abd")
    assert cache.contents() == {}


# --- publishing ---------------------------------------------------------------------------------------------
def test_publishing_is_content_addressed_and_uploads_nothing_unchanged(tiny_routed, tmp_path):
    run, store, first = published_run(tiny_routed, tmp_path)
    files = read_publication(store)
    shards = shard_files(run.shards / "index.json")
    assert {"config.yaml", "shards/index.json", "routing/router.json", "tokenizer/tokenizer.json"} <= set(files)
    assert all(files[f"shards/{f}"].sha256 == digest for f, digest in shards.items())  # the index's hashes
    assert first.uploaded == len(set(e.sha256 for e in files.values())) and first.manifest_written
    shard = run.shards / next(iter(shards))  # a local store: a hard link, no copy
    assert os.path.samefile(shard, store.location(object_name(shards[next(iter(shards))])))

    again = publish_run(store, run)
    assert (again.uploaded, again.uploaded_bytes, again.manifest_written) == (0, 0, False)

    config = load_config(run.config, ["run.rounds=3"])  # one changed file: only it is uploaded
    save_config(config, run.config)
    changed = publish_run(store, run)
    assert changed.uploaded == 1 and changed.manifest_written
    assert read_publication(store)["config.yaml"].sha256 == sha(run.config.read_bytes())


# --- an island with only the URL ----------------------------------------------------------------------------
def test_an_island_given_only_the_url_downloads_only_its_paths_shards(tiny_routed, tmp_path):
    coordinator, store, _ = published_run(tiny_routed, tmp_path)
    cache = tmp_path / "island-cache"
    code, log = dipaco_in_process("island", "--store", store.url, "--path", "2", "--run", tmp_path / "island",
                                  f"store.cache_dir={cache}")
    assert code == 0, log
    wanted = path_shards(coordinator, 2)
    assert set(ObjectCache(cache, max_bytes=0).contents()) == set(wanted.values())  # path 2's train + val, no other
    island = RunDir(tmp_path / "island")
    assert not any(p.suffix == ".zst" for p in island.root.rglob("*"))  # no shard in the island's directory
    assert json.loads((island.root / "published.json").read_text())["files"]["config.yaml"]
    assert ModuleStore(store.url).exists("results/round-000001/path-0002.json")  # its result, in the store


def test_a_store_only_island_takes_the_published_config_with_its_own_overrides(tiny_routed, tmp_path):
    _, store, _ = published_run(tiny_routed, tmp_path, ["store.cache_dir=/coordinator/only"])
    config, run = fetch_run(store.url, run_root=tmp_path / "island", overrides=["inner.steps=2"])
    assert config.inner.steps == 2 and config.model.hidden_size == load_config(TINY).model.hidden_size
    assert config.store.url == store.url and config.store.cache_dir == ""  # the machine's, not the publisher's


def test_a_corrupt_object_in_the_store_is_refused_by_name_and_a_bad_cached_copy_downloaded_again(tiny_routed,
                                                                                                   tmp_path):
    coordinator, store, _ = published_run(tiny_routed, tmp_path)
    name, digest = sorted(path_shards(coordinator, 1).items())[0]
    obj = store.location(object_name(digest))
    data = bytearray(open(obj, "rb").read())
    os.unlink(obj)  # a hard link to the run's shard: corrupt a copy, not the run
    data[len(data) // 2] ^= 0xFF
    open(obj, "wb").write(bytes(data))
    cache = tmp_path / "cache"
    args = ("island", "--store", store.url, "--path", "1", "--run", tmp_path / "island", f"store.cache_dir={cache}")
    code, log = dipaco_in_process(*args)
    assert code == 1 and f"store object {obj} ({name}) is corrupt" in log and "Delete that object" in log
    assert digest not in ObjectCache(cache, max_bytes=0).contents()  # nothing bad was cached

    os.unlink(obj)  # as the message says: delete it, and the coordinator's next start publishes it again
    assert publish_run(store, coordinator).uploaded == 1
    code, log = dipaco_in_process(*args)
    assert code == 0, log

    cached = ObjectCache(cache, max_bytes=0).path_of(digest)
    cached.write_bytes(b"\0" * cached.stat().st_size)  # the cached copy goes bad: downloaded again
    config, run = fetch_run(store.url, run_root=tmp_path / "island", overrides=[f"store.cache_dir={cache}"])
    reader = PathFactory(config, run).reader
    assert reader.blocks(1, "train").shape[0] == reader.num_blocks(1, "train")
    assert reader.fetch.cache.stats.redownloads == 1 and sha(cached.read_bytes()) == digest


def test_a_store_with_nothing_published_says_how_to_publish(tmp_path, monkeypatch):
    monkeypatch.setattr("dipaco.pipeline.published.PUBLICATION_WAIT", 0.2)  # an island waits that long for it
    monkeypatch.setattr("dipaco.pipeline.published.PUBLICATION_POLL", 0.05)
    (tmp_path / "store").mkdir()
    code, log = dipaco_in_process("island", "--store", tmp_path / "store", "--run", tmp_path / "island")
    assert code == 1 and "has no published run" in log and "dipaco coordinator" in log
    code, log = dipaco_in_process("island", "--store", tmp_path / "store", "--config", TINY)
    assert code == 1 and "instead of --config" in log
    code, log = dipaco_in_process("island", "--config", TINY)
    assert code == 1 and "give --run DIR (or --store URL" in log
