"""Errors a person can act on (issue 13, item 8), for each probe of the issue's Why 9: every one printed a
traceback, exited 0 or did something else on main; now each is one line naming the file, line, key or
option and what to do."""

import json
import re
import sys

import pytest
from cli_helpers import TINY, dipaco_in_process

from routing.corpus import load_corpus

CORPORA = {
    "empty.jsonl": (b"", "is empty"),
    "not-json.jsonl": (b'{"text": "fine"}\nnot json at all\n', "line 2: not valid JSON"),
    "binary.jsonl": (bytes(range(200, 256)) * 4, "line 1: byte"),
    "latin1.txt": ("café au lait\nsecond\n".encode("latin-1"), "is not UTF-8"),
    "latin1.jsonl": ('{"text": "café"}\n'.encode("latin-1"), "line 1: byte b'\\xe9'"),
    "list.jsonl": (b'{"text": "a"}\n[1, 2]\n', "line 2: JSON array, not an object"),
    "number.jsonl": (b'{"text": 5}\n', "line 1: field 'text' is a JSON number"),
    "null-first.jsonl": (b'null\n{"text": "a"}\n', "line 1: JSON null"),  # pyarrow segfaulted on it
}


@pytest.mark.parametrize("name", CORPORA)
def test_a_bad_corpus_names_the_file_and_line(name, tmp_path):
    data, message = CORPORA[name]
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        load_corpus(path=str(tmp_path / name))
    assert str(tmp_path / name) in str(err.value)


def test_route_on_a_bad_corpus_is_one_error_line(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(b'{"text": "ok"}\n{"text": \n')
    code, log = dipaco_in_process("route", "--config", TINY, "--run", tmp_path / "run",
                                  f"corpus.path={tmp_path / 'docs.jsonl'}")
    assert code == 1 and "docs.jsonl line 2: not valid JSON" in log and "Traceback" not in log


def test_a_config_path_that_is_a_directory(tmp_path):
    code, log = dipaco_in_process("route", "--config", tmp_path, "--run", tmp_path / "run")
    assert code == 1 and "is a directory" in log


@pytest.mark.parametrize("protocol, package", [("s3", "s3fs"), ("gs", "gcsfs")])
def test_an_object_store_without_its_backend_names_the_package(protocol, package, tmp_path, monkeypatch):
    """The backend made absent whether or not it is installed here (s3fs is, with the test extra):
    importing it fails, and fsspec has no class of an earlier import cached."""
    monkeypatch.setitem(sys.modules, package, None)  # `import s3fs` raises ImportError
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, protocol, raising=False)
    url = f"{protocol}://bucket/run"
    code, log = dipaco_in_process("train", "--config", TINY, "--run", tmp_path / "run", f"store.url={url}")
    assert code == 1 and f"store {url}: the fsspec backend for {protocol}:// is not installed" in log, log
    assert f"pip install {package}" in log and "Traceback" not in log


def test_a_memory_store_is_refused_for_processes_that_cannot_share_it(tmp_path):
    """Refused with the config's checks (exit 2), before the run directory or the store is written."""
    for command in ("run", "train", "coordinator", "island"):
        code, log = dipaco_in_process(command, "--config", TINY, "--run", tmp_path / "run", "store.url=memory://x")
        assert code == 2 and "lives in one process's memory" in log, (command, log)
        assert "the command line (store.url=memory://x)" in log and not (tmp_path / "run").exists()


def test_report_on_an_empty_run_is_an_error(tmp_path):
    (tmp_path / "run").mkdir()
    code, log = dipaco_in_process("report", "--config", TINY, "--run", tmp_path / "run")
    assert code == 1 and "nothing to report" in log
    assert not (tmp_path / "run" / "report.md").exists()


@pytest.mark.parametrize("option, message", [(["--temperature", "-1"], "--temperature must be 0"),
                                             (["--temperature", "nan"], "--temperature must be 0"),
                                             (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
                                             (["--seed", "-3"], "--seed must be >= 0")])
def test_invalid_generate_options_are_refused(option, message, tmp_path):
    (tmp_path / "run").mkdir()
    code, log = dipaco_in_process("generate", "hello", "--config", TINY, "--run", tmp_path / "run", *option)
    assert code == 1 and message in log


def test_eval_on_a_missing_run_says_so(tmp_path):
    code, log = dipaco_in_process("eval", "--config", TINY, "--run", tmp_path / "nowhere")
    assert code == 1 and "does not exist" in log and not (tmp_path / "nowhere").exists()


def test_an_unreadable_train_json_is_not_a_traceback(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.json").write_text(json.dumps({"rounds": "oops"}))
    code, log = dipaco_in_process("report", "--config", TINY, "--run", run)
    assert code == 1 and "is not a training summary" in log


def test_a_bad_line_in_a_compressed_corpus_is_found_too(tmp_path):
    import zstandard

    data = zstandard.ZstdCompressor().compress(b'{"text": "fine"}\n{"text": "also fine"}\n{oops}\n')
    (tmp_path / "docs.jsonl.zst").write_bytes(data)
    with pytest.raises(ValueError, match=r"docs\.jsonl\.zst line 3: not valid JSON"):
        load_corpus(path=str(tmp_path / "docs.jsonl.zst"))


# --- issue 29, item 7: clear errors for what printed tracebacks, hung or idled unseen ------------------------
def test_a_state_json_that_is_not_a_run_state_is_named(tmp_path):
    """`dipaco status` on a state.json holding [1, 2] was an AttributeError traceback."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "state.json").write_text("[1, 2]")
    code, log = dipaco_in_process("status", "--store", tmp_path / "store")
    assert code == 1 and f"{tmp_path / 'store' / 'state.json'} is not a run state" in log and "[1, 2]" in log


def test_an_island_name_with_a_slash_is_refused(tmp_path):
    """`--name a/b` wrote heartbeats/a/b.json, which the coordinator never lists: the island idled unseen."""
    code, log = dipaco_in_process("island", "--config", TINY, "--run", tmp_path / "run", "--name", "a/b")
    assert code == 1 and "island name 'a/b' cannot name a heartbeat file" in log


def test_an_unreachable_ray_address_is_refused_within_seconds(tmp_path, monkeypatch):
    """`launcher.ray_address=127.0.0.1:1` hung in ray.init past 180 s (and 32 s more to obey SIGTERM)."""
    import time

    import ray

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init was called for an address nothing listens on")

    monkeypatch.setattr(ray, "init", no_init)
    started = time.monotonic()
    code, log = dipaco_in_process("train", "--config", TINY, "--run", tmp_path / "run", "launcher.kind=ray",
                                  "launcher.ray_address=127.0.0.1:1")
    assert code == 1 and "cannot reach the Ray cluster at launcher.ray_address='127.0.0.1:1'" in log
    assert time.monotonic() - started < 10


def test_a_full_disk_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk said only "[Errno 28] No space left on device" and left `*.tmp-*` files behind."""
    import errno
    import os

    from dipaco import atomic
    from dipaco.store.module_store import ModuleStore, StoreError

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=re.escape(f"No space left on device (writing 2 bytes): '{tmp_path / 'a.json'}'")):
        atomic.write_json(tmp_path / "a.json", {})
    store = ModuleStore(str(tmp_path / "store"))
    real_open = store.fs.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def write(self, data):
            self.f.write(data[:1])
            full()

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(store.fs, "open", lambda path, mode: Full(real_open(path, mode)))
    with pytest.raises(StoreError, match=r"store file .*store/tasks\.json could not be written \(3 bytes\): No space left"):
        store.write_bytes("tasks.json", b"abc")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["store"]
