"""Against a real S3-protocol server: moto's standalone server on a free loopback port (the test extra's
`moto[server]`), reached through s3fs exactly as AWS would be, with the endpoint and credentials in the
environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). Skipped, with the reason, only when the server
cannot start (moto and s3fs come with the test extra: without them the tests fail).

    python -m pytest tests/test_s3_store.py    # ~30 s: the whole run (coordinator and islands sharing only the URL) too
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import ENV, TINY, copy_run, dipaco_in_process
from s3_server import BUCKET
from test_coordinator_lease import deposed_writes_are_refused, race_for_the_lease

from dipaco.config import load_config, save_config
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.published import publish_run, shard_files
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.store.board import read_heartbeats
from dipaco.store.cache import ObjectCache
from dipaco.store.module_store import ModuleStore
from dipaco.store.publish import read_publication


def test_an_s3_store_publishes_once_and_an_island_with_only_the_url_trains_its_path(s3_env, tiny_routed, tmp_path):
    url = f"s3://{BUCKET}/short"
    run = copy_run(tiny_routed, tmp_path / "coordinator")
    config = load_config(TINY, [f"store.url={url}", "hardware.device=cpu"])
    save_config(config, run.config)
    factory = PathFactory(config, run)
    start_or_resume_store(factory)
    first = publish_run(factory.store, run)
    again = publish_run(factory.store, run)
    assert first.uploaded > 0 and (again.uploaded, again.manifest_written) == (0, False)

    cache = tmp_path / "cache"
    code, log = dipaco_in_process("island", "--store", url, "--path", "3", "--run", tmp_path / "island",
                                  f"store.cache_dir={cache}")
    assert code == 0, log
    path3 = {d for f, d in shard_files(run.shards / "index.json").items() if f.startswith("path-0003/")}
    assert set(ObjectCache(cache, max_bytes=0).contents()) == path3
    assert ModuleStore(url).exists("results/round-000001/path-0003.json")
    assert len(read_publication(ModuleStore(url))) == first.objects


def test_the_store_lists_what_another_process_wrote_after_its_first_look(s3_env):
    """s3fs caches listings forever by default: a coordinator would never see a later island's heartbeat."""
    import boto3

    store = ModuleStore(f"s3://{BUCKET}/listing")
    store.write_json("heartbeats/island-a.json", {})
    assert store.listdir("heartbeats") == ["island-a.json"]
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])  # another writer than this s3fs
    client.put_object(Bucket=BUCKET, Key="listing/heartbeats/island-b.json", Body=b"{}")
    assert store.listdir("heartbeats") == ["island-a.json", "island-b.json"]
    assert store.exists("heartbeats/island-b.json")


def test_store_errors_name_the_url_and_what_to_fix(s3_env, tmp_path, monkeypatch):
    code, log = dipaco_in_process("island", "--store", "s3://no-such-bucket/run", "--run", tmp_path / "island")
    assert code == 1 and "store s3://no-such-bucket/run: the bucket 'no-such-bucket' does not exist" in log

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, log = dipaco_in_process("coordinator", "--store", f"s3://{BUCKET}/run", "--run", tmp_path / "coordinator")
    assert code == 1 and f"store s3://{BUCKET}/run: no credentials found; set AWS_ACCESS_KEY_ID" in log


S3_RACES = 30


def test_two_coordinators_racing_on_s3_one_wins_every_time(s3_env):
    """Issue 29, item 8: both read an empty lease before either writes; the server's If-None-Match decides."""
    stamp = time.time_ns()
    winners = race_for_the_lease(lambda i: ModuleStore(f"s3://{BUCKET}/race-{stamp}-{i}"), reps=S3_RACES)
    assert winners == [1] * S3_RACES


def test_a_deposed_coordinators_lease_write_is_refused_by_the_s3_server(s3_env):
    """Renewals and takeovers are PUTs with If-Match on the ETag read: a deposed writer's is refused (412)."""
    url = f"s3://{BUCKET}/deposed-{time.time_ns()}"
    assert ModuleStore(url).conditional_writes
    deposed_writes_are_refused(lambda: ModuleStore(url))


def test_an_unreachable_server_is_retried_then_named(monkeypatch):
    """Transient failures (connection refused) are retried with backoff, then reported with the URL."""
    import dipaco.store.errors as errors

    monkeypatch.setattr(errors, "BACKOFF", 0.01)
    calls = []

    class Refusing:
        def cat_file(self, path):
            calls.append(path)
            raise ConnectionRefusedError(111, "Connection refused")

    fs = errors.RetryingFileSystem(Refusing(), url="s3://b/run")
    with pytest.raises(errors.StoreError, match=r"store s3://b/run: cannot reach the server .* after 4 tries"):
        fs.cat_file("b/run/state.json")
    assert len(calls) == errors.ATTEMPTS

    class Flaky:
        def cat_file(self, path):
            calls.append(path)
            if len(calls) < errors.ATTEMPTS + 2:
                raise TimeoutError("read timed out")
            return b"{}"

    assert errors.RetryingFileSystem(Flaky(), url="s3://b/run").cat_file("x") == b"{}"

    class Missing:
        def cat_file(self, path):
            raise FileNotFoundError(path)  # a missing file is the caller's business: not retried, not changed

    with pytest.raises(FileNotFoundError):
        errors.RetryingFileSystem(Missing(), url="s3://b/run").cat_file("x")


# --- a whole run: the coordinator and two islands share nothing but the URL -----------------------------------
def start(args: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`python -m dipaco <args>` in its own working directory and session, its output in `log`."""
    cwd.mkdir(parents=True, exist_ok=True)
    out = open(log, "wb")
    return subprocess.Popen([sys.executable, "-m", "dipaco", *args], cwd=cwd, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, *, timeout: float, what: str, procs=(), alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc, log in procs:
            assert proc.poll() is None, f"{what}: a process exited early:\n{Path(log).read_text()[-3000:]}"
        assert alive(), f"{what}: the coordinator ended early"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def finish(proc: subprocess.Popen, log: Path, *, timeout: float) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{log.name} did not finish:\n{log.read_text()[-3000:]}") from None
    assert code == 0, f"{log.name} failed:\n{log.read_text()[-3000:]}"


@pytest.mark.slow  # 24 s of make test's 2 minutes; the store on S3, its lease and fenced commits stay in make test
def test_a_run_on_s3_with_only_the_url_survives_a_killed_island_and_equals_a_local_run(s3_env, tiny_routed,
                                                                                         tiny_straight, tmp_path,
                                                                                         monkeypatch):
    """Sync, fixed seeds. Coordinator 1 (the routed run directory) publishes and trains round 1; islands a
    and b (each in an empty directory with its own cache) get only the URL; b is killed mid-task and a
    third island c starts; coordinator 2, with only the URL, trains round 2. The modules equal a local
    run's (conftest's `tiny_straight`: the same config trained in one process). The islands are processes;
    the coordinators run `dipaco coordinator` in this one (the first in a thread), which saves starting two
    interpreters, each in its own directory all the same."""
    url = f"s3://{BUCKET}/run"
    env = {**ENV, **s3_env}
    run = copy_run(tiny_routed, tmp_path / "coordinator-1" / "run")
    logs = tmp_path / "logs"
    logs.mkdir()
    first: dict = {}
    coordinator = threading.Thread(target=lambda: first.update(zip(("code", "log"), dipaco_in_process(
        "coordinator", "--config", TINY, "--run", run.root, f"store.url={url}", "hardware.device=cpu",
        "resilience.heartbeat_timeout=3", "run.stop_after_round=1"))), daemon=True)
    coordinator.start()
    store = ModuleStore(url)
    wait_for(lambda: store.exists("published.json") and store.exists("state.json"), timeout=120,
             what="the coordinator's publication", alive=coordinator.is_alive)

    def island(name: str, *extra: str) -> subprocess.Popen:
        home = tmp_path / name
        return start(["island", "--store", url, "--name", name, *extra], cwd=home,
                     env={**env, "XDG_CACHE_HOME": str(home / "cache")}, log=logs / f"{name}.log")

    a, b = island("island-a"), island("island-b", "--slowdown", "40")

    def b_training() -> bool:
        beat = read_heartbeats(store).get("island-b")
        return beat is not None and beat.status == "training"

    wait_for(b_training, timeout=120, what="island-b training", procs=[(b, logs / "island-b.log")])
    os.killpg(b.pid, signal.SIGKILL)  # mid-task: its task goes to another island after heartbeat_timeout
    b.wait()
    c = island("island-c")
    coordinator.join(timeout=180)
    assert first.get("code") == 0, f"coordinator 1 failed or hangs:\n{first.get('log', '')[-3000:]}"

    second = tmp_path / "coordinator-2"
    second.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(second / "cache"))
    stop = threading.Timer(180, os.kill, (os.getpid(), signal.SIGTERM))  # the command's own stop: no hang
    stop.start()
    try:
        code, log = dipaco_in_process("coordinator", "--store", url, "--run", second / "run", "run.stop_after_round=0")
    finally:
        stop.cancel()
    assert code == 0, f"coordinator 2 failed:\n{log[-3000:]}"
    for name, proc in (("island-a", a), ("island-c", c)):
        finish(proc, logs / f"{name}.log", timeout=60)

    assert store.current_round() == 2
    expected = tiny_straight.store
    for name in tiny_straight.topology.modules:
        got, want = store.read_module(2, name), expected.read_module(2, name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name

    results = [json.loads(store.read_bytes(f"results/{r}/{f}")) for r in store.listdir("results")
               for f in store.listdir(f"results/{r}") if f.endswith(".json")]
    assert any(r["attempt"] > 0 for r in results), "island-b's task was never handed out again"
    shards = shard_files(run.shards / "index.json")
    for name in ("island-a", "island-c"):  # each cached exactly the shards of the paths it trained
        paths = {r["path"] for r in results if r["island"] == name}
        wanted = {d for f, d in shards.items() if f.startswith(tuple(f"path-{p:04d}/" for p in paths))}
        assert set(ObjectCache(tmp_path / name / "cache" / "dipaco", max_bytes=0).contents()) == wanted, name
    for name in ("island-a", "island-c", "coordinator-2"):  # no shard files in their directories: only the cache
        assert not list((tmp_path / name).rglob("*.tok.zst")), name
