"""Elastic islands that shrink: a try of a shrunk island takes each member's share at the full island (a returning
worker joins at the next try), an island whose every worker died comes back as a new incarnation and trains, and
resumes its task from the island's inner checkpoint.
Workers in threads over `Membership` (torchft at the edge, tests/test_elastic_island.py), the real coordinator."""

import torch
from test_elastic_island import Membership


class OneAtATime:
    """An elastic island's workers driven one round at a time over `Membership` (torchft at the edge), the real
    coordinator ticking on a fake clock between rounds."""

    def __init__(self, tiny_routed, folder, overrides: list[str]):
        from tiny_runs import Clock, make_run

        self.run = make_run(tiny_routed, folder / "run", overrides)
        self.membership, self.clock = Membership(), Clock()
        self.coordinator = self.run.coordinator(self.clock)

    def worker(self, k: int):
        from dipaco.islands.island.elastic import ElasticContext
        from dipaco.islands.island.elastic_island import ElasticIsland
        from dipaco.stages.island import island_setup

        def join(replica, device, *, live):
            return ElasticContext(manager=self.membership.manager(replica, live), replica=replica, live=live)
        return ElasticIsland(island_setup(self.run.config, self.run.dir), name="e0", worker=k, workers=2, join=join,
                             poll_seconds=0.0)

    def rounds(self, island, until, what: str) -> None:
        """`island`'s rounds, the coordinator ticking before each, until `until()` (at most 300)."""
        for _ in range(300):
            if until():
                return
            self.coordinator.tick()
            self.clock.t += 0.5
            island.round()
        raise AssertionError(f"{island.replica}: {what} never happened (presence {island.presence.status!r}, "
                             f"{island.presence.current!r})")


def test_an_island_whose_every_worker_died_comes_back_as_a_new_incarnation_and_trains(tiny_routed, tmp_path):
    """Workers driven one at a time over `Membership`, the real coordinator beside them: w0 dies in its first task;
    w1, alone, leads the island, and the board gives the lost task to w1's incarnation; w1 dies too. w0 comes back
    with nothing and no live peer to heal from: it is a new incarnation, idle, and the board gives it tasks, which it
    seals (it must not keep reporting the task it forgot as in training, which the board would wait on forever)."""
    driven = OneAtATime(tiny_routed, tmp_path, ["inner.steps=3", "faults.step_seconds=0.01"])
    rounds, coordinator = driven.rounds, driven.coordinator
    w0, w1 = driven.worker(0), driven.worker(1)
    in_task = lambda island: island.state.progress is not None and island.state.progress.done >= 1  # noqa: E731
    rounds(w0, lambda: in_task(w0), "w0 in a task")
    lost, first = w0.state.progress.task, w0.presence.incarnation
    w0._go_down()
    rounds(w1, lambda: in_task(w1), "w1 in a task")
    assert w1.presence.incarnation not in (first, w0.presence.incarnation)
    w1._go_down()
    rounds(w0, lambda: len(w0.trained) >= 2, "w0 sealing two tasks after everyone died")
    assert w0.presence.incarnation != first and w0.state.healed == 0  # a new incarnation, not healed from anyone
    assert lost.key in {key.split("#")[0] for key in w0.trained} | {t.key for t in coordinator.board.tasks.values()
                                                                    if t.status not in ("assigned", "cut")}



def test_an_island_whose_every_worker_died_resumes_its_task_from_its_inner_checkpoint(tiny_routed, tmp_path):
    """`resilience.checkpoint_steps=1`: w0, the island's only live worker, dies after 2 of its task's 4 steps. It comes
    back alone as a new incarnation, asks for the checkpoint's path, is given the task again and resumes it at step 2
    (not step 0). What it seals counts each step once and equals a replay of the task's 4 steps from its start."""
    from test_elastic import replay

    driven = OneAtATime(tiny_routed, tmp_path, ["inner.steps=4", "faults.step_seconds=0.01",
                                                "resilience.checkpoint_steps=1"])
    run, w0 = driven.run, driven.worker(0)
    rounds = lambda until, what: driven.rounds(w0, until, what)  # noqa: E731

    rounds(lambda: w0.state.progress is not None and w0.state.progress.done >= 2, "w0 two steps into a task")
    lost = w0.state.progress.task
    assert w0.state.progress.done == 2 and w0.checkpoint.exists()
    w0._go_down()
    assert w0.presence.last_path == lost.path  # it asks for the checkpoint's path first
    rounds(lambda: any(key.startswith(lost.key + "#") for key in w0.trained), f"w0 sealing {lost.key} again")
    assert w0.island.resumed == [(lost.key, 2)]
    task, out = w0.unpushed
    assert task.key == lost.key and task.attempt > lost.attempt
    assert out.meta.steps == 4 and len(out.meta.losses) == 4  # the 2 steps before the checkpoint counted once
    assert out.meta.tokens == 4 * run.config.inner.batch_size * run.config.sharding.seq_len
    expected = replay(run.setup, task, [{"step": s, "world": 2} for s in range(4)])
    assert out.pseudo_gradient.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(out.pseudo_gradient[key], value, rtol=1e-4, atol=2e-6, msg=key)
    rounds(lambda: w0.unpushed is None, "w0 pushing it")
    assert not w0.checkpoint.exists()  # the result is in the store


def test_a_shrunk_islands_try_takes_each_members_share_at_the_full_island_and_leaves_the_rest():
    """A step of 8 rows on an island of 2 workers: one worker alone takes 4 rows and the step is not complete; the
    next try (the worker back) splits the 4 rows left over both and completes it."""
    from dipaco.islands.island.elastic import completes_step, rows_left

    covered = torch.zeros(8)
    assert rows_left(covered, rank=0, world=1, share=4) == [0, 1, 2, 3]
    assert not completes_step(covered, world=1, share=4)
    covered[:4] = 1.0
    assert [rows_left(covered, rank=r, world=2, share=4) for r in (0, 1)] == [[4, 6], [5, 7]]
    assert completes_step(covered, world=2, share=4)
    assert rows_left(torch.zeros(8), rank=1, world=2, share=4) == [1, 3, 5, 7]  # the full island: as before
    assert rows_left(covered, rank=None, world=2, share=4) == []
