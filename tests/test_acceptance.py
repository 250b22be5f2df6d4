"""Island results are checked before any shared module sees them (issue 13, item 3).

Every probe of the issue edits a result file an island wrote: on main each was accepted (exit 0) and
poisoned the outer step. Here the coordinator rejects it, names the reason, hands the task out again
as the next attempt, and once a good result arrives the round's modules are bit-for-bit those of a run
that never saw the edited file. Results are trained once (module fixture) and written to a fresh store
per case, as the islands' `push_result` writes them."""

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import copy_run
from safetensors.torch import load_file, save_file

from dipaco.config import load_config
from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.islands.coordinator.update_bound import InnerRun
from dipaco.islands.island.training import push_result, train_task
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.stages.island import island_setup
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Task, task_key

TAMPERED = 1  # the path whose result the probes edit


@dataclasses.dataclass
class Case:
    store: ModuleStore
    coordinator: Coordinator
    checks: ResultChecks
    setup: object
    tasks: dict[int, Task]
    root: Path


@pytest.fixture(scope="module")
def trained(tiny_routed, tmp_path_factory):
    """Each path's trained first task (from the seeded version 0), and the modules of a clean round 1."""
    case = fresh(tiny_routed, tmp_path_factory.mktemp("clean"))
    results = {p: train_task(case.setup, task) for p, task in case.tasks.items()}
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="clean")
    assert case.coordinator.tick() is False and case.coordinator.committed == 1
    clean = {name: case.store.read_module(1, name) for name in case.setup.topology.modules}
    return results, clean


def fresh(tiny_routed, root: Path, overrides: tuple[str, ...] = ()) -> Case:
    """A copy of the routed tiny run with version 0 in its store, and a coordinator that opened round 1's tasks."""
    run = copy_run(tiny_routed, root / "run")
    config = load_config(run.config, ["hardware.device=cpu", "run.rounds=2", *overrides])
    factory = PathFactory(config, run)
    start_or_resume_store(factory)
    setup = island_setup(config, run)
    checks = ResultChecks(setup.store, setup.topology, resilience=config.resilience, inner_steps=config.inner.steps,
                          tokens_per_step=config.inner.batch_size * factory.reader.seq_len, inner=InnerRun.of(config))
    coordinator = Coordinator(setup.store, setup.topology, settings=CoordinatorSettings.from_config(config),
                              sizes=factory.path_sizes, checks=checks)
    coordinator.tick()  # opens a task for every path
    tasks = {t.path: t for t in coordinator.tasks.values()}
    return Case(setup.store, coordinator, checks, setup, tasks, root)


def result_files(case: Case, path: int, attempt: int = 0) -> tuple[Path, Path]:
    folder = Path(case.store.root) / "results" / "round-000001"
    suffix = "" if attempt == 0 else f".a{attempt}"
    return folder / f"path-{path:04d}{suffix}.json", folder / f"path-{path:04d}{suffix}.safetensors"


def edit_meta(**fields):
    def tamper(case: Case, attempt: int = 0) -> None:
        meta_file, _ = result_files(case, TAMPERED, attempt)
        meta = json.loads(meta_file.read_text())
        meta.update(fields)
        meta_file.write_text(json.dumps(meta))  # json writes NaN / Infinity literals, as a hand edit can
    return tamper


def edit_tensor(change):
    def tamper(case: Case, attempt: int = 0) -> None:
        _, tensor_file = result_files(case, TAMPERED, attempt)
        tensors = load_file(tensor_file)
        name = sorted(tensors)[-1]
        tensors[name] = change(tensors[name])
        save_file(tensors, tensor_file)
    return tamper


def evil_file(case: Case, attempt: int = 0) -> None:
    """The result JSON names a file outside the store, holding a pseudo-gradient scaled 1000x."""
    meta_file, tensor_file = result_files(case, TAMPERED, attempt)
    evil = case.root / "elsewhere" / "evil.safetensors"
    evil.parent.mkdir()
    save_file({k: v * 1000 for k, v in load_file(tensor_file).items()}, evil)
    meta = json.loads(meta_file.read_text())
    meta["file"] = "../../../../elsewhere/evil.safetensors"
    meta_file.write_text(json.dumps(meta))


PROBES = {
    "nan values": (edit_tensor(lambda t: torch.full_like(t, math.nan)), "NaN or infinite"),
    "inf value": (edit_tensor(lambda t: t.index_fill(0, torch.tensor([0]), math.inf)), "NaN or infinite"),
    "tokens 1e15": (edit_meta(tokens=10**15), "tokens 1000000000000000 is not"),
    "negative tokens": (edit_meta(tokens=-4), "tokens -4 is not"),
    "nan tokens": (edit_meta(tokens=math.nan), "'tokens' should be an integer"),
    "1x1 tensor": (edit_tensor(lambda t: torch.ones(1, 1)), "has shape [1, 1]"),
    "float16 tensor": (edit_tensor(lambda t: t.half()), "torch.float16"),
    "missing tensor": (edit_meta(file="path-0002.safetensors"), "is not this result's file"),
    "file outside the store": (evil_file, "is not this result's file"),
    "nan train loss": (edit_meta(train_loss=math.nan), "train_loss is nan"),
    "wrong path": (edit_meta(path=2), "path is 2"),
    # a path's first result has no norm history: bounded by the module it would move (issue 29, item 1)
    "huge first result": (edit_tensor(lambda t: t.index_fill(0, torch.tensor([0]), 1e30)), "resilience.max_update_ratio"),
}


@pytest.mark.parametrize("probe", PROBES)
def test_a_tampered_result_is_rejected_requeued_and_never_applied(probe, trained, tiny_routed, tmp_path, caplog):
    results, clean = trained
    tamper, reason = PROBES[probe]
    case = fresh(tiny_routed, tmp_path)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    tamper(case)
    with caplog.at_level(logging.WARNING):
        case.coordinator.tick()
    assert case.coordinator.committed == 0  # the round waits for a good result of the tampered path
    task = case.coordinator.tasks[task_key(TAMPERED, 0)]
    assert (task.status, task.attempt) == ("open", 1)
    assert reason in case.checks.verdicts[(task.key, 0)]
    assert f"rejected the result of {task.key} attempt 0" in caplog.text
    push_result(case.setup, task, results[TAMPERED], island="j")  # attempt 1, as an honest island trains it
    case.coordinator.tick()
    assert case.coordinator.committed == 1
    for name, tensors in clean.items():
        for key, value in case.store.read_module(1, name).items():
            torch.testing.assert_close(value, tensors[key], rtol=0, atol=0)


def test_an_outlier_norm_against_the_paths_history_is_rejected(trained, tiny_routed, tmp_path):
    results, _ = trained
    case = fresh(tiny_routed, tmp_path, ("resilience.max_norm_ratio=10",))
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in results[TAMPERED].pseudo_gradient.values()))
    case.checks.norms[TAMPERED] = [norm / 20]  # its earlier results were 20 times smaller
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    case.coordinator.tick()
    assert "resilience.max_norm_ratio 10" in case.checks.verdicts[(task_key(TAMPERED, 0), 0)]
    assert case.coordinator.committed == 0
    case.checks.norms[TAMPERED] = [norm / 5]  # within the ratio
    push_result(case.setup, case.coordinator.tasks[task_key(TAMPERED, 0)], results[TAMPERED], island="j")
    case.coordinator.tick()
    assert case.coordinator.committed == 1


def test_a_task_rejected_again_and_again_stops_the_run_with_the_reasons(trained, tiny_routed, tmp_path):
    results, _ = trained
    case = fresh(tiny_routed, tmp_path, ("resilience.max_rejections=2",))
    tamper = edit_meta(tokens=7)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    tamper(case)
    case.coordinator.tick()
    push_result(case.setup, case.coordinator.tasks[task_key(TAMPERED, 0)], results[TAMPERED], island="i")
    tamper(case, attempt=1)
    with pytest.raises(RuntimeError, match=r"2 results of path-0001-round-000001 were rejected.*tokens 7"):
        case.coordinator.tick()


def test_store_names_cannot_leave_the_store(tmp_path):
    from dipaco.store.module_store import StoreError

    (tmp_path / "secret").write_text("x")
    store = ModuleStore(str(tmp_path / "store"))
    for name in ("../secret", "results/../../secret", "/etc/passwd", "a//b", ""):
        with pytest.raises(StoreError, match="does not stay inside the store"):
            store.read_bytes(name)
    shutil.rmtree(tmp_path / "store", ignore_errors=True)


def test_each_result_is_found_by_one_listing_and_its_json_read_once(trained, tiny_routed, tmp_path, monkeypatch):
    """The coordinator lists a round's results folder instead of asking whether each result exists, and
    the JSON the checks read is the one the policy and the outer step use: read once per result."""
    results, clean = trained
    case = fresh(tiny_routed, tmp_path)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    reads, checks = [], []
    read_bytes, exists = case.store.read_bytes, case.store.exists
    monkeypatch.setattr(case.store, "read_bytes", lambda relative: reads.append(relative) or read_bytes(relative))
    monkeypatch.setattr(case.store, "exists", lambda relative: checks.append(relative) or exists(relative))
    assert case.coordinator.tick() is False and case.coordinator.committed == 1
    metas = [r for r in reads if r.startswith("results/") and r.endswith(".json")]
    assert len(metas) == len(set(metas)) == len(case.tasks)
    assert not [c for c in checks if c.startswith("results/")]
    for name, tensors in clean.items():  # the same outer step
        assert all(torch.equal(t, case.store.read_module(1, name)[k]) for k, t in tensors.items())


def test_the_board_is_serialised_and_written_only_when_it_changed(tiny_routed, tmp_path, monkeypatch):
    """An idle tick serialises nothing (at 16x16 that was 256 tasks' JSON every tick); a hand-out is written."""
    from dipaco.islands.coordinator import task_board as board_module
    from dipaco.store.board import read_board, write_board, write_heartbeat
    from dipaco.store.records import Board, Heartbeat

    case = fresh(tiny_routed, tmp_path)
    written, serialised = [], []
    to_json = Board.to_json
    monkeypatch.setattr(board_module, "write_board", lambda store, board: written.append(board) or write_board(store, board))
    monkeypatch.setattr(Board, "to_json", lambda self: serialised.append(self) or to_json(self))
    case.coordinator.tick()  # nothing happened since the fixture's tick
    assert written == [] and serialised == []
    write_heartbeat(case.store, Heartbeat(island="i", incarnation="x", seq=1, status="idle", task=None, pinned=(),
                                          last_path=None, finished=(), time=0.0, failures=0))
    case.coordinator.tick()  # the island gets a task
    assert len(written) == 1 and [t.island for t in read_board(case.store).tasks.values()].count("i") == 1
    before = len(serialised)  # the comparison and write_board's own
    case.coordinator.tick()
    assert len(written) == 1 and len(serialised) == before


def test_a_huge_first_result_is_refused_by_name_and_no_other_path_is_blamed(trained, tiny_routed, tmp_path):
    """One tensor of path 1's first result set to 1e30 before receipt: refused naming path 1's result and
    the bound; every other path's result is received; the round then commits the clean modules."""
    results, clean = trained
    case = fresh(tiny_routed, tmp_path)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    PROBES["huge first result"][0](case)
    case.coordinator.tick()
    refused = [k for k, v in case.checks.verdicts.items() if v is not None]
    assert refused == [(task_key(TAMPERED, 0), 0)]
    assert all(t.status == "received" for t in case.coordinator.tasks.values() if t.path != TAMPERED)
    push_result(case.setup, case.coordinator.tasks[task_key(TAMPERED, 0)], results[TAMPERED], island="j")
    case.coordinator.tick()
    assert case.coordinator.committed == 1
    for name, tensors in clean.items():
        for key, value in case.store.read_module(1, name).items():
            assert bool(torch.isfinite(value).all())
            torch.testing.assert_close(value, tensors[key], rtol=0, atol=0)


def hold_round(case: Case) -> None:
    """Receive every path's result (the round is due), without closing it: the coordinator's close is held."""
    closer = case.coordinator.closer
    due = closer.due
    closer.due = lambda *args, **kwargs: False
    case.coordinator.tick()
    closer.due = due


def test_a_result_changed_after_its_receipt_is_not_applied_and_its_path_redoes_it(trained, tiny_routed, tmp_path):
    """What is applied is what was checked (issue 29, item 2): path 1's received result is overwritten with
    NaN before the round closes; the outer step refuses those bytes, nothing is committed, path 1's task
    opens again, and once it reports again the round commits the clean modules."""
    results, clean = trained
    case = fresh(tiny_routed, tmp_path)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    hold_round(case)
    assert all(t.status == "received" for t in case.coordinator.tasks.values())
    edit_tensor(lambda t: torch.full_like(t, math.nan))(case)
    case.coordinator.tick()
    assert case.coordinator.committed == 0  # nothing committed from changed bytes
    task = case.coordinator.tasks[task_key(TAMPERED, 0)]
    assert (task.status, task.attempt) == ("open", 1)
    push_result(case.setup, task, results[TAMPERED], island="j")
    case.coordinator.tick()
    assert case.coordinator.committed == 1
    for name, tensors in clean.items():
        for key, value in case.store.read_module(1, name).items():
            torch.testing.assert_close(value, tensors[key], rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["nan", "truncated"])
def test_a_restarted_coordinator_checks_received_results_again(trained, tiny_routed, tmp_path, damage):
    """Issue 29, item 3: results received by one coordinator, then damaged while none runs; the next
    coordinator checks them again, refuses the damaged one (no stuck run), and the round commits clean."""
    results, clean = trained
    case = fresh(tiny_routed, tmp_path)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    hold_round(case)
    case.coordinator.board.write(case.store, case.coordinator.lease)
    case.coordinator.lease.release()  # the coordinator stops
    _, tensor_file = result_files(case, TAMPERED)
    if damage == "nan":
        edit_tensor(lambda t: torch.full_like(t, math.nan))(case)
    else:
        tensor_file.write_bytes(tensor_file.read_bytes()[:-100])
    config = load_config(case.root / "run" / "config.yaml", ["hardware.device=cpu", "run.rounds=2"])
    restarted = Coordinator(case.store, case.setup.topology, settings=CoordinatorSettings.from_config(config),
                            sizes=PathFactory(config, _run_dir(case)).path_sizes)
    task = restarted.tasks[task_key(TAMPERED, 0)]
    assert (task.status, task.attempt) == ("open", 1)
    restarted.tick()
    assert restarted.committed == 0
    push_result(case.setup, restarted.tasks[task_key(TAMPERED, 0)], results[TAMPERED], island="j")
    restarted.tick()
    assert restarted.committed == 1
    for name, tensors in clean.items():
        for key, value in case.store.read_module(1, name).items():
            torch.testing.assert_close(value, tensors[key], rtol=0, atol=0)


def _run_dir(case: Case):
    from dipaco.run_dir import RunDir

    return RunDir(case.root / "run")


def test_the_outer_step_never_writes_a_module_that_is_not_finite(trained, tiny_routed, tmp_path):
    """The last line of defence (the checks above refuse such results first): an outer step that would give a
    non-finite module raises naming the module and its results, and the round is not committed."""
    from dipaco.config import OuterConfig
    from dipaco.islands.coordinator.outer_step import apply_round

    results, _ = trained
    case = fresh(tiny_routed, tmp_path)
    for p, task in case.tasks.items():
        push_result(case.setup, task, results[p], island="i")
    hold_round(case)
    edit_tensor(lambda t: torch.full_like(t, math.inf))(case)
    pending = list(case.coordinator.tasks.values())
    with pytest.raises(RuntimeError, match=r"round 1: module .* would not be finite .*path-0001-round-000001"):
        apply_round(case.store, case.setup.topology, round=1, pending=pending,
                    config=OuterConfig(decay="keep", weighting="uniform"))
    assert case.store.current_round() == 0
