"""Watching a run: `dipaco status` on a finished and on a running run, and the TensorBoard event files
the coordinator writes every round."""

import json

import pytest
from cli_helpers import TINY, copy_run, dipaco_in_process

from dipaco.config import load_config, save_config
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.islands.island.polling import IslandWorker
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.stages.island import island_setup


def status_of(capsys, *args) -> tuple[str, dict]:
    """`dipaco status ARGS` as text and as JSON."""
    capsys.readouterr()
    code, log = dipaco_in_process("status", *args)
    assert code == 0, log
    text = capsys.readouterr().out
    code, log = dipaco_in_process("status", *args, "--json")
    assert code == 0, log
    return text, json.loads(capsys.readouterr().out)


def tiny_config(run):
    from dipaco.config import load_config

    return load_config(run.config)


def path_parameters(run) -> int:
    """One path model's parameters (every path of the tiny grid has the same shape)."""
    from dipaco.model.path_model import count_parameters
    from dipaco.pipeline.context import PathFactory

    return count_parameters(PathFactory(tiny_config(run), run).new_model())


def test_status_of_a_finished_run(tiny_trained, capsys):
    text, status = status_of(capsys, "--run", tiny_trained.root)
    assert status["finished"] and "round 3 committed, finished" in text
    assert status["results_applied"] == status["results_target"] == 12  # run.rounds=3 x 4 paths
    train = json.loads(tiny_trained.train_summary.read_text())
    assert status["goodput"]["value"] == pytest.approx(train["goodput"]["goodput"])
    assert status["bytes_up"] == train["bytes_up"]
    moved, parameters, steps = status["bytes"], path_parameters(tiny_trained), tiny_config(tiny_trained).inner.steps
    assert moved["sent"] == train["bytes_up"] and sum(moved["by_island"].values()) == moved["sent"]
    assert moved["float32_diloco"] == train["bytes_float32"] == 12 * 4 * parameters  # 12 results of a whole path each
    workers = len(status["islands"])  # the run's islands: data parallel's workers, a ring all-reduce per inner step
    assert moved["data_parallel_workers"] == train["data_parallel_workers"] == workers
    ring = int(2 * (workers - 1) / workers * (steps * moved["float32_diloco"]))
    assert moved["data_parallel"] == train["bytes_data_parallel"] == ring
    traffic = status["traffic"]  # measured by every process, as the coordinator summed it at the end
    assert traffic == train["traffic"] and traffic["ignored"] == []
    assert set(traffic["by_owner"]) == {"coordinator", *(i["island"] for i in status["islands"])}
    assert traffic["by_kind"]["up"]["pseudo_gradient"]["bytes"] >= train["bytes_up"]
    assert f"traffic up (written to the store): {traffic['up_bytes'] / 1e6:.2f} MB" in text
    assert 0 < sum(moved["by_module"].values()) < moved["sent"]  # the modules' spans, without each file's header
    assert "bytes applied:" in text and "float32 DiLoCo would send" in text
    # the tiny config's Nesterov (with the sqrt(paths) rescale) ran in every round, as train.json records
    steps = "rounds 1-3: Nesterov SGD lr 0.7, momentum 0.9, sqrt(paths) rescale"
    assert status["outer_steps"] == steps and f"outer steps (train.json): {steps}" in text
    assert status["last_round"]["outer_step"] == "Nesterov SGD lr 0.7, momentum 0.9, sqrt(paths) rescale"
    assert status["queue"] == {"open": 0, "assigned": 0, "received": 0, "lost": 0, "cancelled": 0, "cut": 0}
    assert status["cancelled"] == {"tasks": 0, "how": "train.json"}  # sync never cancels
    assert [p["results_applied"] for p in status["paths"]] == [3, 3, 3, 3]
    last = {r["round"]: r for r in train["rounds"]}[3]
    sent = [r["bytes_up"] for r in train["rounds"]]  # the peak round, and the steady state's without the paths' last tasks
    assert [r["bytes_up_final"] for r in train["rounds"]] == [0, 0, last["bytes_up"]] == [0, 0, train["bytes_up_final"]]
    assert train["bytes_up_peak_round"] == max(sent) and train["bytes_up_peak_round_excluding_final"] == max(sent[:2])
    for p in status["paths"]:
        assert p["train_loss"] == pytest.approx(last["train_loss"][str(p["path"])]) and p["train_loss_round"] == 3
        assert p["val_loss_version"] == 3 and p["best_val_loss"] <= p["val_loss"]
    assert {i["status"] for i in status["islands"]} == {"done"} and not any(i["alive"] for i in status["islands"])
    code, log = dipaco_in_process("status", "--run", tiny_trained.root, "--watch", "0.1")  # finished: one view
    assert code == 0 and capsys.readouterr().out.count("round 3 committed, finished") == 1
    code, log = dipaco_in_process("status", "--run", tiny_trained.root, "--watch", "-1")
    assert code == 1 and "--watch must be >= 0" in log
    # the store alone says the same about the board (goodput is train.json's)
    _, alone = status_of(capsys, "--store", tiny_trained.store)
    assert alone["results_applied"] == 12 and alone["paths"] == status["paths"] and alone["results_target"] is None


def test_status_of_a_running_run(tiny_routed, tmp_path, capsys):
    """A coordinator has handed out tasks; one island has reported, the other is running its task."""
    run = copy_run(tiny_routed, tmp_path / "run", parts=("tokenizer", "routing", "shards"))
    config = load_config(TINY, ["hardware.device=cpu"])
    save_config(config, run.config)
    start_or_resume_store(PathFactory(config, run))
    setup = island_setup(config, run)
    coordinator = Coordinator(setup.store, setup.topology, settings=CoordinatorSettings.from_config(config),
                              sizes=PathFactory(config, run).path_sizes)
    try:
        fast, busy = IslandWorker(setup, name="fast"), IslandWorker(setup, name="busy")
        fast.heartbeat()
        busy.heartbeat()
        coordinator.tick()  # opens a task per path and hands one to each island
        assert fast.poll()  # trains its task and reports it
        coordinator.tick()  # receives it and hands fast the next task; busy's task is still running
        busy_task, fast_task = busy.next_task().key, fast.next_task().key
        busy.presence.world, busy.presence.workers = 1, 2  # an elastic island short of a worker
        busy.heartbeat()

        text, status = status_of(capsys, "--run", run.root)
        assert not status["finished"] and "round 0 committed, running" in text
        assert status["coordinator"]["pid"] > 0 and "coordinator:" in text
        assert status["queue"] == {"open": 1, "assigned": 2, "received": 1, "lost": 0, "cancelled": 0, "cut": 0}
        islands = {i["island"]: i for i in status["islands"]}
        assert islands["busy"]["task"] == busy_task and islands["busy"]["alive"]
        assert islands["fast"]["task"] == fast_task != busy_task and islands["fast"]["alive"]
        assert busy_task in text and "2 running" in text and "1 received" in text
        assert (islands["busy"]["world"], islands["busy"]["workers"], islands["fast"]["workers"]) == (1, 2, 1)
        assert "1 of 2" in text and "1 of 1" in text
        assert status["results_applied"] == 0 and status["results_target"] == 8
    finally:
        coordinator.lease.release()


def test_tensorboard_event_files_hold_every_round(tiny_trained):
    """`dipaco train` wrote per-path losses, outer step norms, bytes, goodput and round times."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tiny_trained.tensorboard))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    modules = PathFactory(load_config(tiny_trained.config), tiny_trained).topology.modules
    expected = ({f"train/loss/path-{p}" for p in range(4)} | {f"val/loss/path-{p}" for p in range(4)}
                | {f"outer/{kind}/{m}" for kind in ("grad_norm", "update_norm") for m in modules}
                | {"bytes/up_pseudo_gradients", "bytes/down_modules", "bytes/down_inner", "bytes/up_inner",
                   "goodput", "round/seconds", "round/applied", "traffic/up_bytes", "traffic/down_bytes",
                   "traffic/up/pseudo_gradient", "traffic/down/module", "traffic/up/inner_state"})
    assert expected <= tags, expected - tags
    train = json.loads(tiny_trained.train_summary.read_text())
    rows = {r["round"]: r for r in train["rounds"]}
    assert [e.step for e in events.Scalars("train/loss/path-1")] == [1, 2, 3]
    for event in events.Scalars("train/loss/path-1"):
        assert event.value == pytest.approx(rows[event.step]["train_loss"]["1"])
    assert [e.step for e in events.Scalars("val/loss/path-0")] == [0, 1, 2, 3]  # version 3 scored at the end
    assert [e.value for e in events.Scalars("bytes/up_pseudo_gradients")] == [rows[t]["bytes_up"] for t in (1, 2, 3)]
    assert all(e.value > 0 for e in events.Scalars("outer/update_norm/embeddings"))
    measured = [e.value for e in events.Scalars("traffic/up/pseudo_gradient")]  # cumulative, as the coordinator read it
    assert measured == sorted(measured) and measured[-1] <= train["traffic"]["by_kind"]["up"]["pseudo_gradient"]["bytes"]
    assert [e.step for e in events.Scalars("traffic/down_bytes")] == [1, 2, 3]
    assert all(0 < e.value <= 1 for e in events.Scalars("goodput"))
    # the tiny config keeps its outer step in every round (outer.decay: keep): train.json and the events agree
    assert [rows[t]["outer_step"] for t in (1, 2, 3)] == ["configured"] * 3
    assert [e.value for e in events.Scalars("outer/plain_average")] == [0.0, 0.0, 0.0]


def test_tensorboard_off_writes_no_event_files(tiny_trained, tmp_path):
    """run.tensorboard: false: the round hook writes nothing (and on, the same call writes the round)."""
    from dipaco.islands.coordinator.metrics import RunMetrics
    from dipaco.store.run_state import committed_record

    store = PathFactory(load_config(tiny_trained.config), tiny_trained).store
    stats = committed_record(store)[1]
    for enabled in (False, True):
        metrics = RunMetrics(tmp_path / f"tb-{enabled}", enabled=enabled)
        metrics.round(store, stats, norms={"embeddings": (1.0, 0.5)}, goodput=0.5)
        metrics.close()
        assert (tmp_path / f"tb-{enabled}").exists() == enabled


def test_status_reads_a_run_without_loading_torch(tiny_trained, tmp_path):
    """`dipaco status --run R --json` (issue 37, item 4) in a fresh interpreter: the committed round, read
    with neither torch, transformers nor safetensors' torch loader imported, and no file of the run written."""
    import subprocess
    import sys

    from cli_helpers import ENV, ROOT

    run = copy_run(tiny_trained, tmp_path / "run", ("config.yaml", "store", "train.json"))
    files = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.root.rglob("*") if p.is_file()}
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "dipaco", "status", "--run", str(run.root),
                             "--json"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    status = json.loads(result.stdout)
    assert status["round"] == load_config(run.config).run.rounds and status["finished"]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "dipaco.store.board" in imported  # the measure sees the status modules themselves
    assert not {"torch", "transformers", "safetensors.torch"} & imported
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.root.rglob("*") if p.is_file()} == files
