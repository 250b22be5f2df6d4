"""The coordinator killed between every pair of its writes resumes to exactly what an uninterrupted run
makes (issue 13, item 2), and the store's lease keeps a second coordinator out.

A "run" here is the train stage's loop in one process: the real `Coordinator` ticked with a fake clock,
two real islands polled in turn, and train.json written after each committed round with the train
stage's own `resumed_rounds`. The coordinator writes through its own `ModuleStore` object, whose writes
(and deletions) are counted; a crash is an exception raised in place of write k. Then a new coordinator
(a new store object, as a new process would have) resumes, and the run must end with the same modules,
outer states, path states, manifests, best.json and train.json rows (all but the timings) as the
uninterrupted run. Sync mode, fixed seeds, configs/tiny.yaml for two rounds. The lease's own tests are in
test_coordinator_lease.py.
"""

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from s3_server import BUCKET
from tiny_runs import Clock, Crash, TinyRun, make_run

from dipaco import atomic
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.pipeline.context import PathFactory
from dipaco.stages.train import resumed_rounds
from dipaco.store.board import read_board, read_manifest, read_result
from dipaco.store.lease import LEASE_FILE, Lease, LeaseLost, read_holder
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import RoundStats

ROUNDS = 2
TIMINGS = ("seconds", "island_seconds")


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


@dataclass
class Writes:
    """Counts the coordinator's writes and raises `Crash` in place of write number `crash_at`."""

    crash_at: int | None = None
    log: list[str] = field(default_factory=list)

    def __call__(self, what: str) -> None:
        self.log.append(what)
        if len(self.log) == self.crash_at:
            raise Crash(f"killed before write {self.crash_at}: {what}")


def counted_store(url: str, writes: Writes) -> ModuleStore:
    """A store object whose writes and deletions go through `writes` first."""
    store = ModuleStore(url)
    write_bytes, write_if, remove = store.write_bytes, store.write_if, store.remove

    def counted_write(relative, data):
        writes(f"write {relative}")
        write_bytes(relative, data)

    def counted_write_if(relative, data, *, version):  # state.json: the fenced commit (not the lease's renewals,
        if relative != LEASE_FILE:                      # which follow the wall clock)
            writes(f"write {relative}")
        return write_if(relative, data, version=version)

    def counted_remove(relative):
        if store.exists(relative):
            writes(f"remove {relative}")
        remove(relative)

    store.write_bytes, store.write_if, store.remove = counted_write, counted_write_if, counted_remove
    return store


def train_json(run: TinyRun) -> Path:
    return run.dir.train_summary


def write_rows(run: TinyRun, rows: list[RoundStats], writes: Writes) -> None:
    writes("write train.json")
    atomic.write_json(train_json(run), {"rounds": [r.to_json() for r in rows]})


def coordinate(run: TinyRun, store: ModuleStore, islands, clock: Clock, writes: Writes, turns: int = 400) -> None:
    """The train stage's loop: tick, poll the islands, write train.json after each commit and at the end."""
    coordinator = Coordinator(store, run.topology, settings=CoordinatorSettings.from_config(run.config),
                              sizes=PathFactory(run.config, run.dir).path_sizes,
                              clock=clock)
    summary = json.loads(train_json(run).read_text()) if train_json(run).exists() else {"rounds": []}
    rows = [RoundStats.from_json(r, file="train.json") for r in summary["rounds"]]
    rows = resumed_rounds(rows, coordinator.last_stats, done=coordinator.committed)
    for _ in range(turns):
        done = coordinator.tick()
        stats = coordinator.last_stats
        if stats is not None and all(r.round != stats.round for r in rows):
            rows.append(stats)
            write_rows(run, rows, writes)
        if done:
            write_rows(run, rows, writes)  # the train stage writes the summary once more at the end
            return
        for island in islands:
            island.poll()
        clock.t += 0.5
    raise AssertionError(f"the run did not finish in {turns} turns (round {coordinator.committed})")


def run_once(tiny, root: Path, crash_at: int | None = None, *, store_url: str = "") -> tuple[TinyRun, Writes]:
    """A run killed before the coordinator's write `crash_at` (if any) and resumed (on the store at
    `store_url`: default the run directory's)."""
    clock, writes = Clock(), Writes(crash_at)
    overrides = [f"run.rounds={ROUNDS}", "inner.steps=2", *([f"store.url={store_url}"] if store_url else [])]
    run = make_run(tiny, root, overrides)  # inner.steps=2: what the coordinator writes matters, not training
    islands = [run.island(f"i{k}", clock) for k in range(2)]
    try:
        coordinate(run, counted_store(run.store.url, writes), islands, clock, writes)
    except Crash:
        assert crash_at is not None
        coordinate(run, ModuleStore(run.store.url), islands, clock, Writes())  # a new coordinator process
    return run, writes


def outcome(run: TinyRun) -> dict:
    """Everything a run leaves that must not depend on a crash: tensors (bit-exact), path states,
    manifests, best.json and train.json's rows without their timings."""
    store = ModuleStore(run.store.url)
    tensors = {}
    for kind in ("modules", "outer"):
        for version in store.versions(kind):
            for name in run.topology.modules:
                read = store.read_module if kind == "modules" else store.read_outer_state
                if kind == "outer" or store.has_module(version, name):
                    for key, value in (read(version, name) or {}).items():
                        tensors[f"{kind}/{version}/{name}/{key}"] = value
    rows = [{k: v for k, v in row.items() if k not in TIMINGS}
            for row in json.loads(train_json(run).read_text())["rounds"]]
    manifests = [{k: v for k, v in read_manifest(store, r).to_json().items() if k != "applied"}
                 | {"applied": [{k: v for k, v in e.items() if k != "seconds"} for e in read_manifest(store, r).to_json()["applied"]]}
                 for r in range(1, ROUNDS + 1)]
    return {"round": store.current_round(), "tensors": tensors, "paths": read_board(store).paths,
            "manifests": manifests, "best": store.read_best(), "rows": rows}


def assert_same(resumed: dict, straight: dict) -> None:
    assert resumed["round"] == straight["round"] == ROUNDS
    assert resumed["tensors"].keys() == straight["tensors"].keys()
    for key, value in resumed["tensors"].items():
        torch.testing.assert_close(value, straight["tensors"][key], rtol=0, atol=0, msg=key)
    for key in ("paths", "manifests", "best", "rows"):
        assert resumed[key] == straight[key], key


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory) -> tuple[dict, list[str]]:
    """The uninterrupted run's outcome and the coordinator's writes, in order."""
    run, writes = run_once(tiny, tmp_path_factory.mktemp("straight") / "run")
    return outcome(run), writes.log


def around_commits(log: list[str]) -> list[int]:
    """Crash points (1-based write numbers) at each round's closing: every write from the one before
    the round's manifest to its train.json row (checksums, the commit, best.json, pruning, the board)."""
    points = []
    for i, what in enumerate(log, start=1):
        if what.startswith("write rounds/"):
            row = next(j for j in range(i, len(log) + 1) if log[j - 1] == "write train.json")
            points += range(i - 1, row + 1)
    return points


@pytest.mark.parametrize("where", range(0, 17, 2))  # every other of the 8 and 9 writes around the 2 commits (all: make test-slow)
def test_a_coordinator_killed_around_a_commit_resumes_to_the_same_run(tiny, straight, tmp_path, where):
    outcome_straight, log = straight
    points = around_commits(log)
    if where >= len(points):
        pytest.skip(f"only {len(points)} crash points around the commits")
    run, writes = run_once(tiny, tmp_path / "run", crash_at=points[where])
    assert len(writes.log) == points[where], "the crash happened"
    assert_same(outcome(run), outcome_straight)


@pytest.mark.slow  # one tiny two-round run per write: a few minutes
def test_a_coordinator_killed_between_every_pair_of_its_writes_resumes_to_the_same_run(tiny, straight, tmp_path):
    outcome_straight, log = straight
    for crash_at in range(1, len(log) + 1):
        run, _ = run_once(tiny, tmp_path / f"run-{crash_at}", crash_at=crash_at)
        assert_same(outcome(run), outcome_straight)


# --- the lease (the lease's own tests: test_coordinator_lease.py) --------------------------------------
def test_a_deposed_coordinator_stops_before_its_commit(tiny, tmp_path):
    """Its lease taken over mid-round, the coordinator raises at the fencing check and the store keeps
    the round uncommitted (the new holder's work is never overwritten)."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", [f"run.rounds={ROUNDS}"])
    islands = [run.island(f"i{k}", clock) for k in range(2)]
    coordinator = run.coordinator(clock)
    Lease.acquire(ModuleStore(run.store.url), timeout=60, host="elsewhere", pid=1, force=True)
    with pytest.raises(LeaseLost, match="to elsewhere pid 1"):
        for _ in range(400):
            coordinator.tick()
            for island in islands:
                island.poll()
            clock.t += 0.5
    assert run.store.current_round() == 0 and read_holder(run.store).host == "elsewhere"


# --- async: what a committed round holds never depends on a crash ------------------------------------
ASYNC = ["rounds.mode=async", "rounds.quorum=0.5", "rounds.grace_seconds=0", "outer.lr=1.0", "outer.momentum=0.0",
         "outer.rescale_by_paths=false", "outer.weighting=uniform", "store.keep_versions=0", "run.rounds=3",
         "inner.steps=2"]


class Every:
    """An island that takes only every `n`-th turn (a slower machine)."""

    def __init__(self, n: int, island):
        self.n, self.island, self.turns = n, island, 0

    def poll(self) -> bool:
        self.turns += 1
        return self.island.poll() if self.turns % self.n == 0 else False


def run_async(tiny, root: Path, crash_at: int | None = None) -> tuple[TinyRun, Writes]:
    """An async run (paths trained on while rounds close) killed before write `crash_at` and resumed."""
    clock, writes = Clock(), Writes(crash_at)
    run = make_run(tiny, root, ASYNC)
    # island 0 polls every turn, the others every third: path 0 brings several results to a round
    islands = [run.island("i0", clock, pinned=[0]), *(Every(3, run.island(f"i{k}", clock, pinned=[k])) for k in (1, 2, 3))]
    try:
        coordinate(run, counted_store(run.store.url, writes), islands, clock, writes)
    except Crash:
        assert crash_at is not None
        coordinate(run, ModuleStore(run.store.url), islands, clock, Writes())
    return run, writes


def assert_every_version_is_the_outer_step_of_its_record(run: TinyRun) -> None:
    """Each committed version t equals version t − 1 minus the plain per-path average of the pseudo-gradients
    its manifest lists (each path once, its results added: uniform weights, lr 1, momentum 0), recomputed
    here from the result files; every result is applied once; every path has all its planned steps."""
    store = ModuleStore(run.store.url)
    seen, steps, doubles = set(), {p: 0 for p in range(run.topology.n_paths)}, set()
    for t in range(1, store.current_round() + 1):
        manifest = read_manifest(store, t)
        assert not manifest.dropped and not (manifest.keys & seen), f"round {t}"
        doubles.update(p for p in {e.path for e in manifest.applied} if sum(e.path == p for e in manifest.applied) > 1)
        seen |= manifest.keys
        deltas = {e.key: read_result(store, round=e.base + 1, path=e.path, attempt=e.attempt, link=e.link)[0]
                  for e in manifest.applied}
        for e in manifest.applied:
            steps[e.path] += e.steps
        for name in run.topology.modules:
            users = [e for e in manifest.applied if e.path in run.topology.paths_of_module(name)]
            before, after = store.read_module(t - 1, name), store.read_module(t, name)
            for param in before:
                expected = before[param] - (sum(deltas[e.key][f"{name}/{param}"] for e in users)
                                            / max(1, len({e.path for e in users})))
                torch.testing.assert_close(after[param], expected, rtol=1e-5, atol=1e-7, msg=f"{t} {name}")
    assert steps == {p: 3 * 2 for p in steps}  # run.rounds x inner.steps, every path
    assert doubles, "a path should bring several results to one round"


@pytest.fixture(scope="module")
def async_writes(tiny, tmp_path_factory) -> list[str]:
    run, writes = run_async(tiny, tmp_path_factory.mktemp("async") / "run")
    assert_every_version_is_the_outer_step_of_its_record(run)
    return writes.log


@pytest.mark.parametrize("where", [1, 13])  # writes around the first and a later commit
def test_an_async_coordinator_killed_around_a_commit_loses_no_applied_result_and_no_committed_round(
        tiny, async_writes, tmp_path, where):
    points = around_commits(async_writes)
    crash_at = points[min(where, len(points) - 1)]
    run, writes = run_async(tiny, tmp_path / "run", crash_at=crash_at)
    assert len(writes.log) == crash_at, "the crash happened"
    assert_every_version_is_the_outer_step_of_its_record(run)


# --- the same on S3 (moto's server): a store of object PUTs, conditional lease writes -------------------------
@pytest.fixture(scope="module")
def straight_s3(tiny, straight, s3_env, tmp_path_factory) -> list[str]:
    """The uninterrupted run on S3: the same outcome as on a directory; its writes, in order."""
    run, writes = run_once(tiny, tmp_path_factory.mktemp("straight-s3") / "run",
                           store_url=f"s3://{BUCKET}/crash-straight-{time.time_ns()}")
    assert_same(outcome(run), straight[0])
    assert list(map(sessionless, writes.log)) == list(map(sessionless, straight[1])), \
        "the coordinator writes the same files in the same order on S3"
    return writes.log


def sessionless(write: str) -> str:
    """A logged write with the store client's session id (random per process, in traffic/<owner>.<session>.json)
    replaced by a placeholder: two runs write the same files but for it."""
    return re.sub(r"(traffic/[\w.-]+?)\.[0-9a-f]{12}\.json", r"\1.<session>.json", write)


def crash_on_s3(tiny, tmp_path: Path, crash_at: int) -> dict:
    run, writes = run_once(tiny, tmp_path / f"run-{crash_at}", crash_at=crash_at,
                           store_url=f"s3://{BUCKET}/crash-{crash_at}-{time.time_ns()}")
    assert len(writes.log) == crash_at, "the crash happened"
    return outcome(run)


@pytest.mark.slow  # 7 s; the directory store's version and S3's fenced commit stay in make test
def test_a_coordinator_killed_at_the_commit_on_s3_resumes_to_the_same_run(tiny, straight, s3_env, tmp_path):
    """make test's share (one S3 run is ~3 s): killed in place of the last round's commit (state.json), the
    write the directory store's run makes at the same place (`straight_s3` checks the two logs agree)."""
    outcome_straight, log = straight
    commit = [i for i, what in enumerate(log, start=1) if what == "write state.json"][-1]
    assert_same(crash_on_s3(tiny, tmp_path, commit), outcome_straight)


@pytest.mark.slow  # one tiny two-round run on moto's server per write
def test_a_coordinator_killed_between_every_pair_of_its_writes_on_s3_resumes_to_the_same_run(tiny, straight,
                                                                                           straight_s3, tmp_path):
    for crash_at in range(1, len(straight_s3) + 1):
        assert_same(crash_on_s3(tiny, tmp_path, crash_at), straight[0])
