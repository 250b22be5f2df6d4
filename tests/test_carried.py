"""A path's carried state (`dipaco.carried.state`): it round-trips through its file (exact in float32, bf16
moments that stay valid in a checkpoint), it is refused by name when it does not fit, it stays on the island
that trains the path (no upload between checkpoints), a task continues it from a checkpoint or a hand-off as
it would from memory, and a path moved after its island died resumes from its last checkpoint."""

import os
import signal
import time

import pytest
import torch
from cli_helpers import TINY, copy_run, start_dipaco
from tiny_runs import Clock, drive, make_run

from dipaco.carried.state import MOMENTS_OF, CarriedState, UploadPlan
from dipaco.islands.island.held import HeldState
from dipaco.islands.island.training import push_result, train_task
from dipaco.stages.island import island_setup
from dipaco.store.board import all_inner_states, inner_ref, read_inner, read_manifest, read_result_meta
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Task


@pytest.fixture(scope="module")
def tiny(tiny_routed):
    return tiny_routed


BOUND = dict(max_step=7, betas=(0.9, 0.95))  # the validator's AdamW bound: `_state`'s moments after 7 steps


def _state(seed: int = 0) -> CarriedState:
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(4, 3, generator=g) * 1e-6  # small second moments, as AdamW's are
    m = (torch.rand(4, 3, generator=g) * 2 - 1) * 0.9 * v.sqrt()  # |m| ≤ 0.9 √v < c_7(0.9, 0.95) √v = 0.956 √v
    return CarriedState(adam={"w.exp_avg": m, "w.exp_avg_sq": v}, steps={"w": 7},
                        residual={"m/w": torch.randn(4, 3, generator=g)}, drift={"m/w": torch.randn(4, 3, generator=g)})


def test_a_carried_state_round_trips_exactly_in_float32_and_within_bf16_rounding_in_a_checkpoint():
    state = _state()
    back = CarriedState.from_tensors(*state.to_tensors(), where="f")
    assert back.steps == state.steps
    for part in ("adam", "residual", "drift"):
        assert all(torch.equal(getattr(back, part)[k], t) for k, t in getattr(state, part).items()), part
    tensors, meta = state.to_tensors(moments="bf16")
    assert meta["moments"] == "bf16" and tensors["w.exp_avg"].dtype == torch.bfloat16
    assert tensors["residual/m/w"].dtype == torch.float32  # training not sent yet: kept exact
    light = CarriedState.from_tensors(tensors, meta, where="f")
    for key, value in state.adam.items():  # what bf16 rounding of each value gives, computed here
        assert torch.equal(light.adam[key], value.to(torch.bfloat16).to(torch.float32))
    assert (light.adam["w.exp_avg_sq"] >= 0).all()
    light.check({"m/w": [4, 3]}, where="f", **BOUND)  # decoded moments are valid moments
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == state.nbytes() - 2 * 12 * 2


@pytest.mark.parametrize("change, message", [
    (lambda s: s.adam.__setitem__("w.exp_avg_sq", -s.adam["w.exp_avg_sq"] - 1), r"w.exp_avg_sq has 12 negative"),
    (lambda s: s.adam.__setitem__("x.exp_avg", torch.zeros(4, 3)), r"x.exp_avg is not a moment, residual or drift of the path"),
    (lambda s: s.adam.__setitem__("w.exp_avg", torch.zeros(3, 4)), r"w.exp_avg has shape \[3, 4\], its parameter's is \[4, 3\]"),
    (lambda s: s.adam["w.exp_avg"].fill_(float("nan")), r"w.exp_avg has 12 NaN"),
    (lambda s: s.drift.__setitem__("n/w", torch.zeros(4, 3)), r"drift/n/w is not a moment, residual or drift of the path's parameters"),
    (lambda s: s.residual.__setitem__("m/w", torch.zeros(4, 3, dtype=torch.float64)), "residual/m/w is torch.float64, not float32"),
])
def test_a_carried_state_that_does_not_fit_the_path_is_refused_naming_the_file_and_tensor(change, message):
    state = _state()
    state.check({"m/w": [4, 3]}, where="f", **BOUND)
    change(state)
    with pytest.raises(StoreError, match=f"islands/x.safetensors: .*{message}"):
        state.check({"m/w": [4, 3]}, where="islands/x.safetensors", **BOUND)
    with pytest.raises(StoreError, match="no valid AdamW step counts"):
        CarriedState.from_tensors({}, {"step": {"w": -1}}, where="f")


def test_the_state_is_uploaded_at_every_kth_task_the_last_and_a_hand_off_only():
    plan = UploadPlan(every=3, inner_steps=4, total_steps=40)
    reasons = [plan.reason(step_offset=4 * t, steps=4) for t in range(10)]
    assert reasons == [None, None, "checkpoint", None, None, "checkpoint", None, None, "checkpoint", "last"]
    assert plan.reason(step_offset=4, steps=4, handing_off=True) == "hand-off"
    assert plan.reason(step_offset=10, steps=2) == "checkpoint"  # a cut task that reaches the 12th step
    assert plan.reason(step_offset=9, steps=2) is None
    assert UploadPlan(every=0, inner_steps=4, total_steps=40).reason(step_offset=8, steps=4) is None
    assert MOMENTS_OF["checkpoint"] == MOMENTS_OF["last"] == "bf16" and MOMENTS_OF["hand-off"] == "float32"


def _inner_files(run) -> dict[int, list[int]]:
    return {path: sorted(r for r, _ in states) for path, states in all_inner_states(run.store).items()}


def test_a_path_given_back_to_its_own_island_uploads_no_inner_state_between_checkpoints(tiny, tmp_path):
    """One island per path, 5 rounds, a checkpoint every 2 tasks: each path's state reaches the store after
    its tasks 2 and 4 (bf16) and 5 (the last), never otherwise; every task after the first continues it
    from its island's memory."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["run.rounds=5", "resilience.inner_checkpoint_every=2",
                                            "store.keep_versions=0"])
    n = run.topology.n_paths
    drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(n)], clock)
    assert _inner_files(run) == {path: [2, 4, 5] for path in range(n)}
    for path in range(n):
        metas = [read_result_meta(run.store, round=r, path=path, attempt=0) for r in range(1, 6)]
        assert len({m.island for m in metas}) == 1  # given back to the island that trained it
        assert [m.inner_upload for m in metas] == ["", "checkpoint", "", "checkpoint", "last"]
        assert [m.inner_state_local for m in metas] == [False, True, True, True, True]
        assert [m.bytes_down_inner for m in metas] == [0] * 5
        for m in metas:
            ref = inner_ref(path=path, round=m.round, attempt=0)
            assert m.bytes_up_inner == ((run.dir.store / ref).stat().st_size if m.inner_upload else 0)


def test_a_task_continues_a_hand_off_exactly_and_a_bf16_checkpoint_closely(tiny, tmp_path):
    """Path 0's second task from the state its first left: on the same island (memory), on a fresh island
    from the float32 hand-off (bit for bit the same), and from a bf16 checkpoint (close: the moments lose
    their low bits, and the checkpoint's moments are exactly the bf16 rounding of the state's)."""
    run = make_run(tiny, tmp_path / "run", ["run.rounds=3"])
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    out = train_task(run.setup, first)
    steps = run.config.inner.steps
    second = Task.open(path=0, base=0, step_offset=steps, inner_from="islands/path-0000/held")
    memory = train_task(run.setup, second, held=_held(run, "islands/path-0000/held", out.carried))
    assert memory.meta.inner_state_local
    _, _, ref = push_result(run.setup, first, out, island="a", handing_off=True)
    moved = train_task(island_setup(run.config, run.dir), Task.open(path=0, base=0, step_offset=steps, inner_from=ref))
    assert not moved.meta.inner_state_local and moved.meta.bytes_down_inner == (run.dir.store / ref).stat().st_size
    for name, delta in memory.pseudo_gradient.items():
        assert torch.equal(moved.pseudo_gradient[name], delta), name

    tensors, meta = out.carried.to_tensors(moments="bf16")
    run.store.write_tensors_with_meta("islands/path-0000/checkpoint.safetensors", tensors, meta)
    stored = CarriedState.from_tensors(*read_inner(run.store, "islands/path-0000/checkpoint.safetensors"), where="c")
    assert all(torch.equal(stored.adam[k], t.to(torch.bfloat16).float()) for k, t in out.carried.adam.items())
    light = train_task(island_setup(run.config, run.dir), Task.open(
        path=0, base=0, step_offset=steps, inner_from="islands/path-0000/checkpoint.safetensors"))
    assert light.meta.losses == pytest.approx(memory.meta.losses, rel=1e-3)
    for name, delta in memory.pseudo_gradient.items():
        assert (light.pseudo_gradient[name] - delta).norm() <= 0.02 * delta.norm() + 1e-7, name


def _held(run, ref: str, state: CarriedState) -> HeldState:
    held = HeldState(run.store)
    held.keep(ref, 0, state, uploaded=False)
    return held


def test_a_path_moved_after_its_island_died_resumes_from_its_last_checkpoint_and_trains_to_the_end(tiny, tmp_path):
    """Island a trains path 0 alone (pinned), checkpointing every 2 tasks, and dies after round 3 (it stops
    polling: no heartbeat, no hand-off). The path's last task goes to island c, which resumes from the
    round-2 checkpoint (the round-3 state died with a) and trains the path to the end of the run."""
    clock = Clock()
    run = make_run(tiny, tmp_path / "run", ["run.rounds=4", "resilience.inner_checkpoint_every=2",
                                            "resilience.heartbeat_timeout=5", "store.keep_versions=0"])
    others = list(range(1, run.topology.n_paths))
    a, b = run.island("a", clock, pinned=[0]), run.island("b", clock, pinned=others)
    coordinator = run.coordinator(clock)
    drive(coordinator, [a, b], clock, until_round=3)
    assert _inner_files(run)[0] == [2]  # round 3's state is only in a's memory
    assert {read_result_meta(run.store, round=r, path=0, attempt=0).island for r in (1, 2, 3)} == {"a"}
    drive(coordinator, [b, run.island("c", clock, pinned=[0])], clock)  # a is gone
    assert coordinator.committed == 4
    (entry,) = [e for e in read_manifest(run.store, 4).applied if e.path == 0]
    resumed = read_result_meta(run.store, round=4, path=0, attempt=entry.attempt)
    checkpoint = run.dir.store / inner_ref(path=0, round=2, attempt=0)
    assert resumed.island == "c" and not resumed.inner_state_local and resumed.inner_upload == "last"
    assert resumed.bytes_down_inner == checkpoint.stat().st_size  # it read the round-2 checkpoint, nothing else
    assert _inner_files(run)[0] == [2, 4]


@pytest.mark.slow  # four processes start (the coordinator and three islands): about a minute
def test_a_path_whose_island_process_is_killed_moves_and_resumes_from_its_checkpoint(tiny_routed, tmp_path):
    """`dipaco coordinator` and `dipaco island` processes: island a (pinned to path 0) is killed with SIGKILL
    once path 0's round-3 result is in; island c, started then, takes the path's last task, resumes from the
    round-2 checkpoint (round 3's state died with a) and the run ends."""
    run = copy_run(tiny_routed, tmp_path / "run")
    common = ["--config", TINY, "--run", str(run.root), "hardware.device=cpu", "run.rounds=4",
              "resilience.inner_checkpoint_every=2", "resilience.heartbeat_seconds=0.5",
              "resilience.heartbeat_timeout=4", "store.keep_versions=0"]
    procs = [start_dipaco("coordinator", *common),
             start_dipaco("island", *common, "--pull", "--path", "0", "--name", "a"),
             start_dipaco("island", *common, "--pull", "--path", "1", "--path", "2", "--path", "3", "--name", "b")]
    try:
        round_three = run.store / "results" / "round-000003" / "path-0000.json"
        deadline = time.monotonic() + 300
        while not round_three.exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no round-3 result"
            time.sleep(0.1)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        procs.append(start_dipaco("island", *common, "--pull", "--path", "0", "--name", "c"))
        assert procs[0].wait(timeout=300) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    store = ModuleStore(str(run.store))
    assert store.current_round() == 4
    (entry,) = [e for e in read_manifest(store, 4).applied if e.path == 0]
    resumed = read_result_meta(store, round=4, path=0, attempt=entry.attempt)
    checkpoint = run.store / inner_ref(path=0, round=2, attempt=0)
    assert resumed.island == "c" and resumed.inner_upload == "last"
    assert resumed.bytes_down_inner == checkpoint.stat().st_size  # the round-2 checkpoint, nothing else
    assert not (run.store / inner_ref(path=0, round=3, attempt=0)).exists()
