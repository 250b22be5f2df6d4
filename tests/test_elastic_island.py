"""Elastic islands started by `dipaco island` (`hardware.workers_per_island`): the setting's checks, the workers'
messages, workers in threads with torchft's quorum replaced at the edge (a fixed quorum; members that leave and
join mid-task, checked against a replay of the recorded steps), and a
`dipaco train` whose one island of two workers loses the worker that does its store work mid-task. The other
worker finishes the task alone and pushes it, the island keeps its incarnation (no task is lost or redone), the
heartbeat shows the island shrink and grow back, the killed worker, restarted by its island, rejoins from its
live peer and trains later tasks, and the run reaches its end. Real processes: marked slow."""

import copy
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import copy_run, start_dipaco

from dipaco.config import load_config
from dipaco.config_keys import ConfigError
from dipaco.islands.island import elastic_messages

STEPS = 8  # inner steps per task, paced to STEP_SECONDS: a task takes about 3 s
STEP_SECONDS = 0.4
ROUNDS = 3  # 12 tasks: the killed worker is back (imports, heal) long before the last


def test_workers_per_island_is_validated_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"hardware\.workers_per_island.*0"):
        load_config(Path(__file__).parent.parent / "configs" / "tiny.yaml", ["hardware.workers_per_island=0"])


def test_an_elastic_island_without_torchft_is_refused_by_name(tiny_routed, tmp_path, monkeypatch):
    from dipaco.stages.island import island

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft then raises ImportError
    run = copy_run(tiny_routed, tmp_path / "run")
    config = load_config(run.config, ["hardware.workers_per_island=2"])
    with pytest.raises(ValueError, match=r"hardware\.workers_per_island 2: an elastic island needs torchft.*"
                                         r"dipaco\[elastic\]"):
        island(config, run, pull=True, paths=None, name="island-0", argv=["island"])


class OneMember:
    """A quorum of one (torchft's `Manager.allreduce` as it sums over a single member)."""

    def allreduce(self, tensor, reduce_op):
        class Done:
            def wait(self):
                return tensor
        return Done()


def test_a_message_and_a_digest_cross_a_quorum_of_one_unchanged():
    message = {"task": {"key": "path-0001-round-000002", "chain": ["a", "b"]}, "stop": False, "text": "é"}
    assert elastic_messages.share_json(OneMember(), message) == message
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.tensor(1.5)}
    digest = elastic_messages.digest_of(tensors)
    assert digest == elastic_messages.digest_of(dict(reversed(tensors.items())))  # by name, not by order
    assert digest != elastic_messages.digest_of({**tensors, "a": torch.tensor(1.25)})
    assert elastic_messages.same_everywhere(OneMember(), digest)
    assert elastic_messages.lowest_holder(OneMember(), rank=0, world=1, holds=True) == 0


class SharedSum:
    """A quorum of `members` threads: each `allreduce` returns once every member gave its tensor, all summed."""

    def __init__(self, members: int):
        self.barrier, self.given = threading.Barrier(members), {}

    def member(self, rank: int):
        shared = self

        class Member:
            def allreduce(self, tensor, reduce_op):
                shared.given[rank] = tensor.clone()
                shared.barrier.wait()
                total = sum(shared.given.values())
                shared.barrier.wait()
                tensor.copy_(total)

                class Done:
                    def wait(self):
                        return tensor
                return Done()
        return Member()


def on_members(call, members: int) -> list:
    """`call(manager, rank)` on `members` threads at once, over one `SharedSum`; their returns by rank."""
    quorum, out = SharedSum(members), [None] * members
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, call(quorum.member(r), r))) for r in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_members_agree_on_a_leader_a_message_and_whether_their_digests_match():
    message = {"task": {"key": "path-0001-round-000002"}, "stop": False}
    got = on_members(lambda m, r: elastic_messages.share_json(m, message if r == 1 else None), 3)
    assert got == [message] * 3  # the leader's bytes, every member
    assert on_members(lambda m, r: elastic_messages.lowest_holder(m, rank=r, world=3, holds=r >= 1), 3) == [1] * 3
    assert on_members(lambda m, r: elastic_messages.lowest_holder(m, rank=r, world=3, holds=False), 3) == [0] * 3
    same, other = elastic_messages.digest_of({"a": torch.ones(3)}), elastic_messages.digest_of({"a": torch.zeros(3)})
    assert on_members(lambda m, r: elastic_messages.same_everywhere(m, same), 3) == [True] * 3
    assert on_members(lambda m, r: elastic_messages.same_everywhere(m, other if r == 2 else same), 3) == [False] * 3


class FixedQuorum:
    """torchft's `Manager` at the edge: member `rank` of a quorum of `world` that never changes (`SharedSum`)."""

    def __init__(self, member, *, rank: int, world: int):
        self.member, self.rank, self.world = member, rank, world

    def start_quorum(self):
        pass

    def participating_rank(self):
        return self.rank

    def num_participants(self):
        return self.world

    def allreduce(self, tensor, reduce_op):
        return self.member.allreduce(tensor, reduce_op)

    def should_commit(self):
        return True

    def errored(self):
        return None

    def shutdown(self, wait=True):
        pass


def test_two_workers_push_the_replayed_pseudo_gradient_identical_on_both(tiny_routed, tmp_path):
    """Two `ElasticIsland` workers in threads over a fixed quorum of two, the real coordinator ticking beside them:
    the task they seal is identical on both, equals a replay of its steps as two shares of each batch
    (tests/test_elastic.py's `replay`), and only the leader writes the heartbeat, with world 2 of 2."""
    from test_elastic import replay
    from tiny_runs import Clock, make_run

    from dipaco.islands.island.elastic import ElasticContext
    from dipaco.islands.island.elastic_island import ElasticIsland
    from dipaco.stages.island import island_setup
    from dipaco.store.board import result_exists
    from dipaco.store.heartbeat_files import read_heartbeats

    run, quorum, clock = make_run(tiny_routed, tmp_path / "run", []), SharedSum(2), Clock()

    def joined(rank):
        def join(replica, device, *, live):
            return ElasticContext(manager=FixedQuorum(quorum.member(rank), rank=rank, world=2), replica=replica,
                                  live=live)
        return join

    workers = [ElasticIsland(island_setup(run.config, run.dir), name="e0", worker=r, workers=2, join=joined(r),
                             poll_seconds=0.01) for r in range(2)]
    sealed: list[list] = [[], []]

    def work(rank):
        worker = workers[rank]
        while not worker.trained or worker.unpushed is not None:  # until its first task is sealed and pushed
            worker.round()
            if worker.unpushed is not None and not sealed[rank]:
                sealed[rank].append(worker.unpushed)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    coordinator, deadline = run.coordinator(clock), time.monotonic() + 60
    while any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, "the two workers did not seal and push a task"
        coordinator.tick()
        clock.t += 0.5
        time.sleep(0.05)
    (task, first), (same_task, second) = sealed[0][0], sealed[1][0]
    assert same_task == task and result_exists(run.store, round=task.round, path=task.path, attempt=task.attempt)
    expected = replay(run.setup, task, [{"step": s, "world": 2} for s in range(run.config.inner.steps)])
    assert first.pseudo_gradient.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(first.pseudo_gradient[key], second.pseudo_gradient[key]), key
        torch.testing.assert_close(first.pseudo_gradient[key], value, rtol=1e-4, atol=2e-6, msg=key)
    beat = read_heartbeats(run.store)["e0"]
    assert (beat.world, beat.workers) == (2, 2) and workers[1].presence.seq == beat.seq  # the follower kept in step


class Membership:
    """torchft at the edge, for workers in threads: each round starts when every member has asked for it; a member
    that `leave`s is gone from the next round, one that asks for the first time joins it and, behind, heals from a
    copy of the first member's state (as torchft's transport sends it); sums run over the round's members. A member
    that leaves before it asked to commit breaks the round: the others' sums end unfinished, they do not commit."""

    def __init__(self):
        self.cond, self.members, self.arrived, self.lives = threading.Condition(), [], set(), {}
        self.round, self.ops, self.given, self.total = 0, 0, {}, None
        self.broken, self.committing = False, set()

    def manager(self, name: str, live):
        self.lives[name], membership = live, self

        class Manager:
            def start_quorum(self):
                membership.start(name)

            def participating_rank(self):
                return membership.members.index(name)

            def num_participants(self):
                return len(membership.members)

            def allreduce(self, tensor, reduce_op):
                membership.add(name, tensor)

                class Done:
                    def wait(self):
                        return tensor
                return Done()

            def should_commit(self):
                with membership.cond:
                    membership.committing.add(name)
                    return not membership.broken

            def errored(self):
                return "a member left in the round" if membership.broken else None

            def shutdown(self, wait=True):
                membership.leave(name)
        return Manager()

    def start(self, name: str) -> None:
        with self.cond:
            started = self.round
            self.arrived.add(name)
            self._close_round()
            self.cond.wait_for(lambda: self.round != started, timeout=30)
            assert self.round != started, f"{name}: the round never started ({self.arrived} of {self.members})"

    def leave(self, name: str) -> None:
        with self.cond:
            if name in self.members:
                self.broken |= name not in self.committing
                self.members.remove(name)
                self.given.pop(name, None)
                self.cond.notify_all()
            self.arrived.discard(name)
            self._close_round()

    def _close_round(self) -> None:
        if not self.arrived or not set(self.members) <= self.arrived:
            return
        joining = sorted(self.arrived - set(self.members))
        if self.members and joining:
            state = self.lives[self.members[0]].state_dict()
            for name in joining:
                self.lives[name].load_state_dict(copy.deepcopy(state))
        self.members += joining
        self.arrived, self.round, self.broken, self.committing, self.given = set(), self.round + 1, False, set(), {}
        self.cond.notify_all()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        with self.cond:
            if self.broken:
                return  # as torchft's: after an error, the round's collectives do nothing
            op = self.ops
            self.given[name] = tensor.clone()
            if len(self.given) == len(self.members):
                self.total, self.given, self.ops = sum(self.given.values()), {}, self.ops + 1
                self.cond.notify_all()
            else:
                self.cond.wait_for(lambda: self.ops != op or self.broken, timeout=30)
                assert self.ops != op or self.broken, f"{name}: a sum never completed"
                if self.ops == op:
                    return
            tensor.copy_(self.total)


def test_a_worker_leaves_mid_task_another_joins_and_heals_and_the_task_equals_its_replay(tiny_routed, tmp_path):
    """Workers in threads over `Membership` (torchft at the edge), the real coordinator beside them: w1 leaves after
    two steps of the first task, w0 trains on alone, w2 joins, heals from w0 mid-task (the task begun from the store,
    the path's parameters, moments and steps taken from w0) and the two finish it: every step is trained once, the
    task sealed by w0 and w2 is identical and equals a replay of its recorded (batch, world size) sequence, and w2
    goes on to seal a later task with w0."""
    from test_elastic import replay
    from tiny_runs import Clock, make_run

    from dipaco.islands.island.elastic import ElasticContext
    from dipaco.islands.island.elastic_island import ElasticIsland
    from dipaco.stages.island import island_setup

    run = make_run(tiny_routed, tmp_path / "run", ["inner.steps=6", "faults.step_seconds=0.2"])  # a task: 1.2 s
    membership, clock = Membership(), Clock()
    records: dict[str, list] = {}

    def worker(k: int) -> ElasticIsland:
        def join(replica, device, *, live):
            return ElasticContext(manager=membership.manager(replica, live), replica=replica, live=live,
                                  on_commit=records.setdefault(replica, []).append)
        return ElasticIsland(island_setup(run.config, run.dir), name="e0", worker=k, workers=2, join=join,
                             poll_seconds=0.01)

    w0, w1, w2 = worker(0), worker(1), worker(2)  # w2: a returning worker, a new process, behind
    sealed: dict[str, list] = {"e0-w0": [], "e0-w2": []}

    def work(island: ElasticIsland, until) -> None:
        while not until(island):
            island.round()
            if island.unpushed is not None and island.replica in sealed and (
                    not sealed[island.replica] or sealed[island.replica][-1] is not island.unpushed):
                sealed[island.replica].append(island.unpushed)
        island.ctx.shutdown()

    first_steps = lambda island, n: island.state.progress is not None and island.state.progress.done >= n  # noqa: E731
    threads = [threading.Thread(target=work, args=(w0, lambda i: len(i.trained) >= 3), daemon=True),
               threading.Thread(target=work, args=(w1, lambda i: first_steps(i, 2)), daemon=True)]
    for t in threads:
        t.start()
    coordinator, deadline = run.coordinator(clock), time.monotonic() + 120
    while threads[0].is_alive():
        assert time.monotonic() < deadline, f"no three tasks sealed: {records.keys()}"
        if len(threads) == 2 and not threads[1].is_alive() and first_steps(w0, 3):
            threads.append(threading.Thread(target=work, args=(w2, lambda i: len(i.trained) >= 2), daemon=True))
            threads[-1].start()
        coordinator.tick()
        clock.t += 0.5
        time.sleep(0.05)
    for t in threads[1:]:
        t.join(30)
    task, out = sealed["e0-w0"][0]
    steps = [r for r in records["e0-w0"] if r.task == task.key]
    assert [r.step for r in steps] == list(range(6))  # every step of the task trained once
    worlds = [r.world for r in steps]
    assert worlds[:2] == [2, 2] and 1 in worlds and worlds[-1] == 2, worlds  # shrank, grew back mid-task
    healed = [r for r in records["e0-w2"] if r.task == task.key]
    assert healed and healed[0].step > 2 and w2.state.healed >= 1  # w2 took the task mid-way from its peer
    expected = replay(run.setup, task, [{"step": r.step, "world": r.world} for r in steps])
    (same_task, theirs) = sealed["e0-w2"][0]
    assert same_task == task
    for key, value in expected.items():
        assert torch.equal(out.pseudo_gradient[key], theirs.pseudo_gradient[key]), key
        torch.testing.assert_close(out.pseudo_gradient[key], value, rtol=1e-4, atol=2e-6, msg=key)
    assert len(sealed["e0-w2"]) >= 2  # ... and it sealed a later task with w0
    # the result's time in inner steps is the task's, whoever sealed it: w2's includes w0's rounds before the heal
    assert theirs.meta.seconds >= 0.9 * 6 * 0.2 and theirs.meta.seconds == pytest.approx(out.meta.seconds, rel=0.25)
    assert w2.time.seconds["heal"] > 0 and w0.time.seconds["heal"] == 0  # its time: only the returning worker healed
    assert w0.time.seconds["steps"] >= 0.9 * 0.2 * 3 * 6  # 3 tasks of 6 steps, each try padded to 0.2 s at least



def worker_pids(run_root: Path, worker: int) -> list[int]:
    """The processes of `dipaco island ... --worker <worker>` of this run (from /proc: Linux only)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "dipaco" in args and str(run_root) in args and any(
                a == "--worker" and b == str(worker) for a, b in zip(args, args[1:])):
            pids.append(int(cmdline.parent.name))
    return pids


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def results(store: Path) -> dict[str, dict]:
    """Every result pushed to the store, by "task key#attempt"."""
    found = {}
    for file in store.glob("results/*/path-*.json"):
        meta = read_json(file)
        if meta is not None:
            found[f"path-{meta['path']:04d}-round-{meta['round']:06d}#{meta['attempt']}"] = meta
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the worker's process in /proc")
def test_an_elastic_island_loses_its_leading_worker_mid_task_and_goes_on(tiny_routed, tmp_path):
    """80 to 150 s on 2 shared cores (a `dipaco train` of 4 paths x 3 rounds, one island of two workers)."""
    pytest.importorskip("torchft")
    run = copy_run(tiny_routed, tmp_path / "run")
    store, logs = run.root / "store", run.root / "logs"
    beat_file = store / "heartbeats" / "island-0.json"
    train = start_dipaco("train", "--config", str(run.config), "--run", str(run.root), "hardware.islands=1",
                         "hardware.workers_per_island=2", f"inner.steps={STEPS}", f"faults.step_seconds={STEP_SECONDS}",
                         f"run.rounds={ROUNDS}", "store.keep_versions=0")  # every result kept
    beats: list[dict] = []  # the heartbeats seen, in order
    try:
        deadline = time.monotonic() + 180
        while True:  # the second task: the first one's result pushed (by worker 0, the leader), worker 0 a few steps in
            beat = read_json(beat_file)
            if beat is not None and beat["status"] == "training" and f"{beat['task']}#0" not in results(store) and results(store):
                break
            assert train.poll() is None and time.monotonic() < deadline, "the island never trained a second task"
            time.sleep(0.05)
        time.sleep(3 * STEP_SECONDS)
        in_flight, before = f"{beat['task']}#0", read_json(beat_file)
        assert in_flight not in results(store) and before["world"] == 2
        led = (logs / "island-0-w0.log").read_text()
        assert "pushed" in led and "pushed" not in (logs / "island-0-w1.log").read_text()  # worker 0 does the store work
        (victim,) = worker_pids(run.root, 0)
        os.killpg(victim, signal.SIGKILL)  # mid-task, wherever it is in its step
        while train.poll() is None:
            assert time.monotonic() < deadline + 120, "the run did not end"
            if (beat := read_json(beat_file)) is not None and (not beats or beat["seq"] != beats[-1]["seq"]):
                beats.append(beat)
            time.sleep(0.05)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    assert train.returncode == 0, (logs / "island-0.log").read_text()[-3000:]
    assert json.loads((run.root / "train.json").read_text())["rounds_completed"] == ROUNDS  # the run reached its end

    pushed = results(store)
    assert len(pushed) == 4 * ROUNDS and all(key.endswith("#0") for key in pushed)  # none lost, none redone
    assert all(len(m["losses"]) == STEPS and m["island"] == "island-0" for m in pushed.values())  # every step trained
    assert {b["incarnation"] for b in beats} == {before["incarnation"]}  # the island itself never died
    worlds = [b["world"] for b in beats]
    assert 1 in worlds and worlds[-1] == 2 and 2 in worlds[worlds.index(1):], worlds  # shrank, grew back
    other = (logs / "island-0-w1.log").read_text()
    assert "island island-0 worker 0 exited with code -9" in (logs / "island-0.log").read_text()
    rejoined = (logs / "island-0-w0.log").read_text()[len(led):]  # the restarted worker's own log
    # the surviving worker trained on and the task was pushed once: by it, or by the restarted worker when that one
    # was back in time to heal into the task (alone, the survivor's paced steps take twice as long)
    pushes = [f"{in_flight.removesuffix('#0')} attempt 0 pushed" in log for log in (other, rejoined)]
    assert sum(pushes) == 1 and (pushes[0] or f"healed from a live peer into {in_flight.removesuffix('#0')}" in rejoined)
    later = [key for key in pushed if key != in_flight]  # it died in `in_flight`: any other it sealed came later
    assert any(f"(island-0-w0): {key} sealed" in rejoined for key in later), rejoined[-3000:]

