"""Compare-and-swap of one store file (`dipaco.store.conditional`), per backend: the directory and memory://
stores here, S3 in tests/test_s3_store.py against moto's server, and the GCS requests against a fake of the
JSON API's two calls (no GCS server in the tests)."""

import json

import pytest

from dipaco.store.conditional import GCSFiles, LockedFiles, MemoryFiles, UncheckedFiles, sha256


class FakeGCS:
    """The two JSON API calls GCSFiles makes: a media GET (x-goog-generation) and an upload with
    ifGenerationMatch (412 when the object's generation differs; 0 = must not exist)."""

    _location = "https://storage.googleapis.com"

    def __init__(self):
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.generation = 1000
        self.loop = None

    def split_path(self, path):
        bucket, key = path.split("/", 1)
        return bucket, key, None

    def invalidate_cache(self, path=None):
        pass

    async def _call(self, method, path, *args, alt=None, uploadType=None, name=None, data=None,
                    ifGenerationMatch=None, headers=None):
        if method == "GET":
            assert path == "b/{}/o/{}" and alt == "media"
            key = "/".join(args)
            if key not in self.objects:
                raise FileNotFoundError(key)
            data, generation = self.objects[key]
            return {"x-goog-generation": str(generation)}, data
        assert method == "POST" and path.endswith("/upload/storage/v1/b/bucket/o") and uploadType == "media"
        key = f"bucket/{name}"
        current = self.objects.get(key, (None, 0))[1]
        if int(ifGenerationMatch) != current:
            raise OSError("412 Precondition Failed")
        self.generation += 1
        self.objects[key] = (data, self.generation)
        return {}, json.dumps({"generation": str(self.generation)}).encode()


@pytest.fixture
def gcs(monkeypatch):
    import fsspec.asyn

    def sync(loop, coroutine, *args, **kwargs):
        import asyncio

        return asyncio.run(coroutine(*args, **kwargs))

    monkeypatch.setattr(fsspec.asyn, "sync", sync)
    return GCSFiles(FakeGCS())


def backends(tmp_path, gcs):
    import fsspec

    memory = fsspec.filesystem("memory")
    return {"directory": (LockedFiles(), str(tmp_path / "store" / "lease.json")),
            "memory": (MemoryFiles(memory), f"/cas-{id(tmp_path)}/lease.json"),
            "unchecked": (UncheckedFiles(memory), f"/cas-u-{id(tmp_path)}/lease.json"),
            "gcs": (gcs, "bucket/run/lease.json")}


@pytest.mark.parametrize("name", ["directory", "memory", "unchecked", "gcs"])
def test_create_only_if_absent_and_replace_only_the_version_read(tmp_path, gcs, name):
    cas, path = backends(tmp_path, gcs)[name]
    assert cas.read(path) is None
    first = cas.write(path, b"a", expected=None)
    assert first is not None and cas.read(path) == (b"a", first)
    assert cas.write(path, b"b", expected=None) is None  # it exists
    second = cas.write(path, b"b", expected=first)
    assert second not in (None, first)
    assert cas.write(path, b"c", expected=first) is None  # a writer holding the old version is refused
    assert cas.read(path) == (b"b", second)
    assert cas.atomic == (name != "unchecked")
    if name in ("directory", "memory", "unchecked"):
        assert second == sha256(b"b")
