"""A deposed coordinator cannot touch committed state (issue 36, item 1): coordinator A stalls after its
last lease check for longer than the lease timeout, B takes the lease over and commits the round, and then
A resumes. A's commit (a conditional write of state.json) is refused with `LeaseLost`; the files of B's
committed version do not change after B's commit (their checksums verify); A's staged files sit under its
own token's names, which no reader opens and B's retention deletes; and the run B finishes equals a run
with no stall (sync) or has every committed version equal to the outer step of its manifest's results,
each planned step applied once (async). The real `Coordinator`s and `IslandWorker`s of the tiny config on a
fake clock, each coordinator with its own store object (as its own process would have) and a lease on a
fake wall clock; on a directory store and on moto's S3 server.

    python -m pytest tests/test_fenced_commit.py             # the directory store, a few seconds a run
    python -m pytest -m slow tests/test_fenced_commit.py     # the same runs on moto's S3 server
"""

import hashlib
import time
from pathlib import Path

import pytest
import torch
from s3_server import BUCKET
from test_crash_safety import ASYNC, Every, assert_every_version_is_the_outer_step_of_its_record
from tiny_runs import Clock, TinyRun, drive, make_run

from dipaco.islands.coordinator import closing
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.pipeline.context import PathFactory
from dipaco.store.errors import StoreError
from dipaco.store.lease import Lease, LeaseLost, read_holder
from dipaco.store.module_store import ModuleStore
from dipaco.store.version_names import parse_version

SYNC = ["run.rounds=2", "inner.steps=2"]
TIMEOUT = 60.0


def coordinator(run: TinyRun, clock: Clock, wall: list[float], host: str) -> Coordinator:
    """A coordinator with its own store object, holding the lease on the fake wall clock `wall`."""
    store = ModuleStore(run.store.url)
    lease = Lease.acquire(store, timeout=TIMEOUT, host=host, pid=1, wall=lambda: wall[0])
    return Coordinator(store, run.topology, settings=CoordinatorSettings.from_config(run.config),
                       sizes=PathFactory(run.config, run.dir).path_sizes, clock=clock, lease=lease)


def version_files(store: ModuleStore, round: int) -> dict[str, str]:
    """Every file of committed version `round` readers open (modules, checksums, momentum, manifest): sha256."""
    name = store.version_name(round)
    files = [*store.walk_files(f"modules/{name}"), *store.walk_files(f"outer/{name}"), f"rounds/{name}.json"]
    return {f: hashlib.sha256(store.read_bytes(f)).hexdigest() for f in files}


def staged_by(store: ModuleStore, token: int) -> list[str]:
    """The version folders and manifests named by lease token `token`."""
    return [f"{kind}/{n}" for kind in ("modules", "outer", "rounds") for n in store.listdir(kind)
            if (parsed := parse_version(n)) is not None and parsed[1] == token]


class Takeover:
    """Run at A's stall point: the wall clock passes the lease timeout, B takes the lease and commits the
    round A was closing; what B committed is recorded."""

    def __init__(self, run: TinyRun, clock: Clock, wall: list[float], islands):
        self.run, self.clock, self.wall, self.islands = run, clock, wall, islands
        self.b: Coordinator | None = None
        self.committed: dict[str, str] = {}
        self.staged: list[str] = []  # what A had staged when it stalled

    def __call__(self, round: int) -> None:
        self.staged = staged_by(ModuleStore(self.run.store.url), 1)
        self.wall[0] += TIMEOUT + 1  # A is not renewed for a whole timeout: B takes over
        self.b = coordinator(self.run, self.clock, self.wall, "node-b")
        drive(self.b, self.islands, self.clock, until_round=round)
        self.committed = version_files(ModuleStore(self.run.store.url), round)


def stall_before_the_commit(monkeypatch, a: Coordinator, takeover: Takeover) -> None:
    """A stalls after its last lease check, just before its commit (the real `commit_round` runs after)."""
    commit = closing.commit_round

    def stalled(store, topology, round, **record):
        if store is a.store and takeover.b is None:
            takeover(round)
        return commit(store, topology, round, **record)

    monkeypatch.setattr(closing, "commit_round", stalled)


def stalled_run(tiny, root: Path, monkeypatch, overrides: list[str], islands_of) -> tuple[TinyRun, Takeover]:
    """A run whose coordinator A stalls before its first commit while B commits that round; A's commit is
    refused; B then finishes the run. Checks what A left and what B committed, then returns both."""
    clock, wall = Clock(), [1000.0]
    run = make_run(tiny, root, overrides)
    islands = islands_of(run, clock)
    a = coordinator(run, clock, wall, "node-a")
    takeover = Takeover(run, clock, wall, islands)
    stall_before_the_commit(monkeypatch, a, takeover)
    with pytest.raises(LeaseLost, match=rf"commit of round 1 by lease token {a.lease.token} was refused"):
        drive(a, islands, clock)
    store = ModuleStore(run.store.url)
    assert store.current_round() == 1 and read_holder(store).host == "node-b"
    assert store.state()["lease_token"] == takeover.b.lease.token == a.lease.token + 1
    assert version_files(store, 1) == takeover.committed, "B's committed version changed after its commit"
    assert {"modules/round-000001.t1", "rounds/round-000001.t1.json"} <= set(takeover.staged)  # (and outer/: momentum)
    assert staged_by(store, a.lease.token) == [], "B's retention deletes what A staged"
    for name in run.topology.modules:
        store.read_module(1, name)  # verified against its checksums
    drive(takeover.b, islands, clock)
    return run, takeover


def two_islands(run: TinyRun, clock: Clock) -> list:
    return [run.island(f"i{k}", clock) for k in range(2)]


def async_islands(run: TinyRun, clock: Clock) -> list:
    """As test_crash_safety's async run: island 0 every turn (several results of path 0 in a round), the others every third."""
    return [run.island("i0", clock, pinned=[0]), *(Every(3, run.island(f"i{k}", clock, pinned=[k])) for k in (1, 2, 3))]


def last_modules(run: TinyRun) -> dict[str, torch.Tensor]:
    store = ModuleStore(run.store.url)
    version = store.current_round()
    return {f"{m}/{k}": v for m in run.topology.modules for k, v in store.read_module(version, m).items()}


@pytest.fixture(scope="module")
def unstalled(tiny_routed, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The sync run with no stall: its last version's modules."""
    clock = Clock()
    run = make_run(tiny_routed, tmp_path_factory.mktemp("unstalled") / "run", SYNC)
    drive(run.coordinator(clock), two_islands(run, clock), clock)
    return last_modules(run)


def assert_equal(modules: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert modules.keys() == reference.keys()
    for key, value in modules.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)


def test_a_stalled_coordinators_commit_is_refused_and_the_sync_run_equals_one_without_the_stall(
        tiny_routed, unstalled, tmp_path, monkeypatch):
    run, _ = stalled_run(tiny_routed, tmp_path / "run", monkeypatch, SYNC, two_islands)
    assert ModuleStore(run.store.url).current_round() == 2
    assert_equal(last_modules(run), unstalled)


def test_a_stalled_async_coordinators_commit_is_refused_and_every_version_is_its_records_outer_step(
        tiny_routed, tmp_path, monkeypatch):
    run, _ = stalled_run(tiny_routed, tmp_path / "run", monkeypatch, ASYNC, async_islands)
    assert_every_version_is_the_outer_step_of_its_record(run)


@pytest.mark.slow  # a tiny run and a half on moto's server (make test refuses a deposed commit on S3: test_s3_store.py)
def test_a_stalled_coordinators_commit_is_refused_on_s3(tiny_routed, unstalled, s3_env, tmp_path, monkeypatch):
    run, _ = stalled_run(tiny_routed, tmp_path / "run", monkeypatch,
                         [*SYNC, f"store.url=s3://{BUCKET}/fence-sync-{time.time_ns()}"], two_islands)
    assert_equal(last_modules(run), unstalled)


@pytest.mark.slow  # an async tiny run on moto's server
def test_a_stalled_async_coordinators_commit_is_refused_on_s3(tiny_routed, s3_env, tmp_path, monkeypatch):
    run, _ = stalled_run(tiny_routed, tmp_path / "run", monkeypatch,
                         [*ASYNC, f"store.url=s3://{BUCKET}/fence-async-{time.time_ns()}"], async_islands)
    assert_every_version_is_the_outer_step_of_its_record(run)


def test_a_coordinator_deposed_between_its_module_writes_stops_at_the_next_one(tiny_routed, tmp_path, monkeypatch):
    """A stalls after writing its first module of version 1: its next lease check (a renewal, refused) stops
    it; its one staged file is under its own token's name and B's version 1 reads and verifies."""
    clock, wall = Clock(), [1000.0]
    run = make_run(tiny_routed, tmp_path / "run", SYNC)
    islands = two_islands(run, clock)
    a = coordinator(run, clock, wall, "node-a")
    takeover = Takeover(run, clock, wall, islands)
    write_module, first = a.store.write_module, []

    def stall_after_the_first(round, name, tensors):
        write_module(round, name, tensors)
        if takeover.b is None:
            first.extend(a.store.walk_files(f"modules/{a.store.staged_name(round)}"))
            takeover(round)

    a.store.write_module = stall_after_the_first
    with pytest.raises(LeaseLost, match=r"\(token 1\) lost the lease .* to node-b pid 1"):
        drive(a, islands, clock)
    store = ModuleStore(run.store.url)
    assert first == [f"modules/round-000001.t1/{run.topology.modules[0]}.safetensors"]
    assert store.walk_files("modules/round-000001.t1") == [], "A wrote no other module (B's retention deleted the first)"
    assert store.current_round() == 1 and version_files(store, 1) == takeover.committed
    assert store.version_name(1) == "round-000001.t2"
    for name in run.topology.modules:
        store.read_module(1, name)


def test_a_store_written_before_fenced_commits_still_reads_and_goes_on_under_token_names(tmp_path):
    """A store_version 1 store (unsuffixed names, no version_tokens) reads as before; a coordinator that fences
    it stages round 2 under its token and its commit records from which round on the names carry a token."""
    old = ModuleStore(str(tmp_path))
    for round, value in ((0, 0.0), (1, 1.0)):
        old.write_module(round, "m", {"w": torch.full((2,), value)})
        old.write_outer_state(round, "m", {"w": torch.full((2,), -value)})
    old.write_json("state.json", {"store_version": 1, "round": 1})  # as dipaco wrote it before fenced commits
    store = ModuleStore(str(tmp_path))
    assert store.read_module(1, "m")["w"].tolist() == [1.0, 1.0] and store.version_name(1) == "round-000001"
    store.fence(5)
    store.write_module(2, "m", {"w": torch.full((2,), 2.0)})
    store.commit(round=2)
    reader = ModuleStore(str(tmp_path))
    assert reader.state()["version_tokens"] == [[0, 0], [2, 5]] and reader.state()["store_version"] == 2
    assert [reader.version_name(r) for r in (0, 1, 2)] == ["round-000000", "round-000001", "round-000002.t5"]
    assert [reader.read_module(r, "m")["w"][0].item() for r in (0, 1, 2)] == [0.0, 1.0, 2.0]
    assert reader.read_outer_state(1, "m")["w"][0].item() == -1.0
    assert reader.versions("modules") == [0, 1, 2]


def test_a_state_whose_version_tokens_are_not_pairs_is_refused_by_name(tmp_path):
    store = ModuleStore(str(tmp_path))
    store.write_json("state.json", {"store_version": 2, "round": 1, "version_tokens": [[0, 0], [1, "x"]]})
    with pytest.raises(StoreError, match=r"state.json: version_tokens \[\[0, 0\], \[1, 'x'\]\] is not a list of"):
        ModuleStore(str(tmp_path)).read_module(1, "m")


def test_a_lease_taken_after_lease_json_was_deleted_is_above_the_token_that_fenced_the_store(tmp_path):
    store = ModuleStore(str(tmp_path))
    store.write_module(0, "m", {"w": torch.zeros(2)})
    store.commit(round=0)
    for _ in range(2):  # two coordinators, the second deposing the first
        ModuleStore(str(tmp_path)).fence(Lease.acquire(ModuleStore(str(tmp_path)), timeout=60, force=True).token)
    store.remove("lease.json")  # by hand
    fresh = ModuleStore(str(tmp_path))
    lease = Lease.acquire(fresh, timeout=60)
    assert lease.token == 3
    fresh.fence(lease.token)
    fresh.write_module(1, "m", {"w": torch.ones(2)})
    fresh.commit(round=1)
    assert ModuleStore(str(tmp_path)).read_module(1, "m")["w"].tolist() == [1.0, 1.0]
