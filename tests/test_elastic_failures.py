"""Injected failures in an elastic island (`faults.mode=die` per worker): a worker dies mid-step, its peer keeps the
rows it computed and goes on, the worker returns and heals; workers in threads over test_elastic_island's
`Membership` (torchft's quorum at the edge)."""

import threading
import time

import torch
from test_elastic_island import Membership


def test_an_injected_failure_takes_a_worker_out_and_it_returns_healed_while_its_peer_goes_on(tiny_routed, tmp_path):
    """`faults.mode=die` on one worker, due in the padding of its third step: it leaves the quorum mid-step,
    forgets the task and the path's state, is away `return_after` seconds and joins again, healing from its peer
    mid-task. The peer's try of that step fails; it keeps the rows it computed and computes only the lost worker's
    in the next try, then trains on alone. Every row of every step is trained once (the result equals the replay
    of the whole batches on both workers), by 2 then 1 then 2 workers."""
    from test_elastic import replay
    from tiny_runs import Clock, make_run

    from dipaco.islands.island.elastic import ElasticContext
    from dipaco.islands.island.elastic_island import ElasticIsland
    from dipaco.islands.island.faults import FaultClock
    from dipaco.stages.island import island_setup

    pace = 0.1
    run = make_run(tiny_routed, tmp_path / "run", ["inner.steps=6", f"faults.step_seconds={pace}"])
    membership, clock, records = Membership(), Clock(), {}
    committed, looks = {"e0-w1": 0}, [0]

    def at() -> float:  # w1's fault clock: its looks at the clock once it committed two steps
        looks[0] += committed["e0-w1"] >= 2
        return looks[0]

    faults = FaultClock(mtbf=1e9, return_after=0.3, mode="die", seed=0, island="e0-w1", clock=at)
    faults.next_at = 2  # due at its second look: before its third step, then in that step's padding

    def on_commit(replica):
        def record(step):
            records.setdefault(replica, []).append(step)
            committed[replica] = committed.get(replica, 0) + 1
        return record

    def join(replica, device, *, live):
        return ElasticContext(manager=membership.manager(replica, live), replica=replica, live=live,
                              on_commit=on_commit(replica))

    w0, w1 = (ElasticIsland(island_setup(run.config, run.dir), name="e0", worker=k, workers=2, join=join,
                            poll_seconds=0.01, faults=faults if k == 1 else None) for k in range(2))
    sealed: dict[str, list] = {"e0-w0": [], "e0-w1": []}

    def work(island: ElasticIsland) -> None:
        while len(sealed[island.replica]) < 2:
            try:
                island.round()
            except Exception as err:  # noqa: BLE001 -- the test's own: IslandFailure is what `run` catches
                if type(err).__name__ != "IslandFailure":
                    raise
                island._go_down()
            if island.unpushed is not None and island.unpushed not in sealed[island.replica]:
                sealed[island.replica].append(island.unpushed)
        island.ctx.shutdown()

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in (w0, w1)]
    for t in threads:
        t.start()
    coordinator, deadline = run.coordinator(clock), time.monotonic() + 120
    while any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, f"the workers did not seal two tasks each: {sealed}"
        coordinator.tick()
        clock.t += 0.5
        time.sleep(0.05)
    assert faults.failures == 1 and w1.state.healed >= 1
    assert w0.failed_tries == 1 and w0.kept_rows == run.config.inner.batch_size // 2  # its half of that try's batch
    task, out = sealed["e0-w0"][0]
    steps = [r for r in records["e0-w0"] if r.task == task.key]
    assert [r.step for r in steps] == list(range(6))  # every step of the task trained once
    worlds = [r.world for r in steps]
    assert worlds[:2] == [2, 2] and 1 in worlds and worlds[-1] == 2, worlds  # shrank at the failure, grew back
    expected = replay(run.setup, task, [{"step": r.step, "world": r.world} for r in steps])
    theirs = dict(sealed["e0-w1"])[task]  # the returned worker sealed the same task, healed into it
    for key, value in expected.items():
        assert torch.equal(out.pseudo_gradient[key], theirs.pseudo_gradient[key]), key
        torch.testing.assert_close(out.pseudo_gradient[key], value, rtol=1e-4, atol=2e-6, msg=key)
