"""Elastic islands (`dipaco.islands.island.elastic`, torchft): a worker of a two-worker island is killed mid-task,
the other goes on alone at the same step, the worker returns, heals from its live peer and both train the next
task. Every batch is trained exactly once, and the path's parameters equal an independent replay of the
recorded (batch, world size) sequence. Real processes (three workers, a lighthouse in this process), paced steps:
marked slow (its seconds are in the docstring of the test)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from cli_helpers import ROOT
from safetensors.torch import load_file
from test_coordinator import Clock, make_run

from dipaco.device import autocast
from dipaco.islands.island import elastic
from dipaco.islands.island.training import data_seed, start_task
from dipaco.optim.inner import lr_at, phase_steps
from dipaco.store.records import task_key

STEPS = 14  # inner steps per task
KILL_AFTER = 2  # worker w1 is killed once it has committed this many steps of the first task


def test_elastic_without_torchft_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft then raises ImportError
    with pytest.raises(ImportError, match=r"elastic island.*torchft.*dipaco\[elastic\]"):
        elastic.join("w0", torch.device("cpu"), lighthouse="http://localhost:1")


def test_a_task_on_a_shrunken_elastic_island_is_cut_later_in_proportion():
    """rounds.tasks.cut: late after cut_after median task times / the island's share of its workers."""
    from dipaco.config import RoundsConfig
    from dipaco.rounds.inputs import Running
    from dipaco.rounds.tasks import cut, next_cut

    config = RoundsConfig(mode="async", cut_after=2.0)
    whole, halved = Running(key="a", path=0, base=0, started=0.0), Running(key="b", path=1, base=0, started=0.0,
                                                                          capacity=0.5)
    assert cut([whole, halved], committed=0, now=3.0, median=1.0, config=config) == ["a"]  # 3 > 2, 3 < 4
    assert cut([halved], committed=0, now=4.5, median=1.0, config=config) == ["b"]
    assert next_cut([halved], median=1.0, config=config) == 4.0


def test_the_heartbeat_carries_the_world_size_and_the_coordinator_reads_a_bounded_capacity(tmp_path):
    """A heartbeat says world of workers (an old one without them reads 1 of 1); `Liveness.capacity` is world /
    workers, at least 1 / MAX_STRETCH; a heartbeat with world outside 1..workers is refused and left out."""
    from dipaco.islands.coordinator.heartbeats import MAX_STRETCH, Liveness
    from dipaco.store.heartbeat_files import read_heartbeats, write_heartbeat
    from dipaco.store.module_store import ModuleStore, StoreError
    from dipaco.store.records import Heartbeat

    store = ModuleStore(str(tmp_path))
    fields = dict(incarnation="x", seq=1, status="training", task=None, pinned=(), last_path=None, finished=(),
                  time=0.0, failures=0)
    write_heartbeat(store, Heartbeat(island="half", world=1, workers=2, **fields))
    write_heartbeat(store, Heartbeat(island="lying", world=1, workers=1000, **fields))
    old = Heartbeat(island="old", **fields).to_json()
    del old["world"], old["workers"]
    (tmp_path / "heartbeats" / "old.json").write_text(json.dumps(old))
    bad = {**old, "island": "bad", "world": 3, "workers": 2}
    (tmp_path / "heartbeats" / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(StoreError, match=r"'bad'.*world 3 is not within 1..workers \(2\)"):
        Heartbeat.from_json(bad, file="bad.json")
    malformed: dict[str, str] = {}
    assert sorted(read_heartbeats(store, malformed=malformed)) == ["half", "lying", "old"] and len(malformed) == 1
    liveness = Liveness(store, timeout=30.0)
    liveness.read(0.0)
    capacities = {name: liveness.capacity(name) for name in ("half", "lying", "old", "unseen", None)}
    assert capacities == {"half": 0.5, "lying": 1 / MAX_STRETCH, "old": 1.0, "unseen": 1.0, None: 1.0}


def read_steps(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def replay(setup, task, steps: list[dict]) -> dict[str, torch.Tensor]:
    """The task's pseudo-gradient from its start, replayed in this process without torchft: each recorded step on
    its batch of the path's data order, as `world` shares (rows r, r + world, ...) whose gradients are summed,
    each weighted by its share of the rows."""
    begun = start_task(setup, task, ctx=None, held=None, timings=None, checkpoint=None)
    inner = setup.inner
    first, total = phase_steps(inner, steps=setup.run.rounds * inner.steps, after=setup.warm_start_steps)
    batches = setup.reader.iter_batches(task.path, "train", batch_size=inner.batch_size,
                                        seed=data_seed(setup.run.seed, path=task.path), skip_batches=task.step_offset)
    model, params = begun.model, begun.params
    model.train()
    for record, batch in zip(steps, batches, strict=False):
        for r in range(record["world"]):
            rows = torch.as_tensor(np.ascontiguousarray(batch[r :: record["world"]]), dtype=torch.long)
            with autocast(begun.device, setup.hardware.precision):
                loss = model(input_ids=rows, labels=rows).loss
            (loss * (rows.shape[0] / batch.shape[0])).backward()
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), inner.grad_clip)
        for group in begun.optimizer.param_groups:
            group["lr"] = lr_at(first + task.step_offset + record["step"], config=inner, total_steps=total)
        begun.optimizer.step()
        begun.optimizer.zero_grad(set_to_none=True)
    return {f"{setup.topology.module_of_param(name, task.path)}/{name}":
            begun.start[setup.topology.module_of_param(name, task.path)][name] - p.detach()
            for name, p in params.items()}


def by_step(records: list[dict], task: str) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for r in records:
        if r["task"] == task:
            steps.setdefault(r["step"], []).append(r)
    return steps


@pytest.mark.slow
def test_a_killed_worker_drops_out_the_other_goes_on_and_it_rejoins_from_a_live_peer(tiny_routed, tmp_path):
    """32 to 46 s (two runs) on 2 shared cores, plus the tiny_routed fixture (three worker processes, 2 x 14 steps paced to
    0.4 s)."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    run = make_run(tiny_routed, tmp_path / "run", [f"inner.steps={STEPS}", "faults.step_seconds=0.4"])
    coordinator = run.coordinator(Clock())
    coordinator.tick()
    tasks = [coordinator.tasks[task_key(path, 0)] for path in (0, 1)]
    files = []
    for task in tasks:
        files.append(tmp_path / f"{task.key}.json")
        files[-1].write_text(json.dumps(task.to_json()))
    out, go = tmp_path / "out", tmp_path / "go"
    out.mkdir()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIPACO_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCHFT_LIGHTHOUSE": lighthouse.address(), "RUST_LOG": "warn"}

    def worker(name: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(ROOT / "tests" / "elastic_worker.py"), str(run.dir.root), name,
                                 str(out), *map(str, files), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    # w1 returns as a new process (started ahead: its imports done), under another replica id
    first, doomed, back = worker("w0"), worker("w1"), worker("w1b", "--wait", go)
    try:
        deadline = time.monotonic() + 120
        while len(by_step(read_steps(out / "w1.steps.jsonl"), tasks[0].key)) < KILL_AFTER:
            assert doomed.poll() is None and first.poll() is None, (first.poll(), doomed.poll())
            assert time.monotonic() < deadline, "w1 never trained its first steps"
            time.sleep(0.05)
        os.killpg(doomed.pid, signal.SIGKILL)  # mid-task, wherever it is in its step
        doomed.wait()
        while all(r["world"] == 2 for r in read_steps(out / "w0.steps.jsonl")):  # w0 goes on alone, then w1 returns
            assert first.poll() is None and time.monotonic() < deadline, "w0 did not go on alone"
            time.sleep(0.05)
        go.touch()
        outputs = [p.communicate(timeout=240)[0] for p in (first, back)]
    finally:
        for p in (first, doomed, back):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.shutdown()
    assert [first.returncode, back.returncode] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    w0, w1, w1b = (read_steps(out / f"{name}.steps.jsonl") for name in ("w0", "w1", "w1b"))
    for task in tasks:
        steps = by_step(w0 + w1 + w1b, task.key)
        assert sorted(steps) == list(range(STEPS))  # every batch trained, none lost
        for step, records in steps.items():  # ... exactly once: one commit per quorum member, the rows split
            assert {r["world"] for r in records} == {len(records)}, (task.key, step, records)
            assert sorted(r["rank"] for r in records) == list(range(len(records)))
    # w0 (which may have joined a step late, healing from w1) went on from w1's death to the task's end
    died = max(by_step(w1, tasks[0].key))
    assert [r["step"] for r in w0 if r["task"] == tasks[0].key][-(STEPS - died):] == list(range(died, STEPS))
    first_steps = by_step(w0 + w1, tasks[0].key)
    worlds = [first_steps[s][0]["world"] for s in range(STEPS)]
    assert 1 in worlds, worlds  # the island shrank when w1 died ...
    joined = min(by_step(w1b, tasks[0].key))
    assert 0 < joined and worlds[joined:] == [2] * (STEPS - joined), worlds  # ... and grew back mid-task:
    # w1b's first step is not the task's first: it took the path's state and steps from w0, not from the store
    assert sorted(by_step(w1b, tasks[1].key)) == list(range(STEPS))  # it trained the next task whole
    assert all(by_step(w0, tasks[1].key)[s][0]["world"] == 2 for s in range(STEPS))

    for task in tasks:
        recorded = [by_step(w0 + w1 + w1b, task.key)[s][0] for s in range(STEPS)]
        expected = replay(run.setup, task, recorded)
        for name in ("w0", "w1b"):
            got = load_file(str(out / f"{name}.{task.key}.safetensors"))
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=2e-6, msg=f"{name} {task.key} {key}")


class IslandAtItsLighthouse:
    """Workers of an island as its lighthouse sees them (`start_lighthouse` at `ResilienceConfig`'s defaults): each
    beats every 0.1 s, as a worker's manager does, until it dies (`dead[name].set()`), and asks for quorums;
    `quorums[name]`: the members of the last quorum it got."""

    def __init__(self, names: str, config):
        import threading
        from datetime import timedelta

        from torchft._torchft import LighthouseClient

        self.lighthouse = elastic.start_lighthouse(join_timeout_ms=round(config.worker_join_seconds * 1000),
                                                   heartbeat_timeout_ms=round(config.worker_lost_seconds * 1000))
        self.client = lambda: LighthouseClient(self.lighthouse.address(), connect_timeout=timedelta(seconds=5))
        self.dead = {name: threading.Event() for name in names}
        self.quorums: dict[str, list[str]] = {}
        for name in names:
            threading.Thread(target=self._beat, args=(name,), daemon=True).start()
        time.sleep(0.3)

    def _beat(self, name: str) -> None:
        beating = self.client()
        while not self.dead[name].is_set():
            beating.heartbeat(name)
            time.sleep(0.1)

    def ask(self, name: str, *, after: float = 0.0, timeout: float = 3.0):
        """`name` asks for a quorum `after` seconds from now, in a thread (returned, started)."""
        import threading
        from datetime import timedelta

        def request() -> None:
            time.sleep(after)
            quorum = self.client().quorum(replica_id=name, timeout=timedelta(seconds=timeout), step=0, world_size=1)
            self.quorums[name] = sorted(m.replica_id for m in quorum.participants)

        thread = threading.Thread(target=request)
        thread.start()
        return thread

    def close(self) -> None:
        for event in self.dead.values():
            event.set()
        self.lighthouse.shutdown()


@pytest.mark.slow
def test_an_islands_lighthouse_forms_a_quorum_without_a_worker_silent_for_worker_lost_seconds():
    """About 2 s, slow because it needs torchft (the `elastic` extra, not in `make install`). torchft forms no
    quorum of half its live workers or fewer, so a survivor of two waits until its dead peer is counted gone:
    after `resilience.worker_lost_seconds`, not torchft's default of 5 s (a request that may wait only 3 s is
    answered alone), and not before the dead peer's last heartbeat is that old."""
    pytest.importorskip("torchft")
    from dipaco.config import ResilienceConfig

    config = ResilienceConfig()
    island = IslandAtItsLighthouse("ab", config)
    try:
        for thread in [island.ask("a"), island.ask("b")]:
            thread.join()
        assert island.quorums == {"a": ["a", "b"], "b": ["a", "b"]}  # both live: one quorum of two

        island.dead["b"].set()  # "b" dies; "a" asks for the next quorum
        silent_since = time.monotonic()
        island.ask("a").join()
        waited = time.monotonic() - silent_since
        assert island.quorums["a"] == ["a"]  # it went on alone, within 3 s
        assert waited >= config.worker_lost_seconds - 0.3, waited  # not before "b" was counted gone
    finally:
        island.close()


@pytest.mark.slow
def test_an_islands_lighthouse_waits_worker_join_seconds_for_a_late_live_worker_and_only_worker_lost_for_a_dead_one():
    """About 4 s, slow because it needs torchft. In an island of three, a worker that asks for a quorum a try's
    length before the others (one left out of the last quorum waits so) must not make the next quorum leave out the
    last live worker by milliseconds: that worker would be behind, heal, be late again and be left out again, an
    island one worker short for good (with torchft's join timeout at 0.25 s: every quorum of 4 workers had 3). A
    dead worker still costs only `resilience.worker_lost_seconds`, not `worker_join_seconds`."""
    pytest.importorskip("torchft")
    from dipaco.config import ResilienceConfig

    config = ResilienceConfig()
    assert config.worker_join_seconds > 2 * config.worker_lost_seconds  # the lead below is within it
    island = IslandAtItsLighthouse("abc", config)
    try:
        lead = 2 * config.worker_lost_seconds  # "a" asks this long before "b", and "c" 0.1 s after "b"
        for thread in [island.ask("a", timeout=8), island.ask("b", after=lead, timeout=8),
                       island.ask("c", after=lead + 0.1, timeout=8)]:
            thread.join()
        assert island.quorums == {r: ["a", "b", "c"] for r in "abc"}  # one quorum of the three live workers

        island.dead["c"].set()  # "c" dies; the others ask for the next quorum
        silent_since = time.monotonic()
        for thread in [island.ask("a", timeout=8), island.ask("b", timeout=8)]:
            thread.join()
        waited = time.monotonic() - silent_since
        assert island.quorums["a"] == island.quorums["b"] == ["a", "b"]
        assert config.worker_lost_seconds - 0.3 <= waited < config.worker_lost_seconds + 1.5, waited
    finally:
        island.close()
