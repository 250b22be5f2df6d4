"""End to end: `dipaco run` on the tiny config over a slice of the bundled corpus, then resume.

Real components throughout (HF datasets, tokenizers, faiss, transformers, island processes).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli_helpers import ENV, ROOT, TINY, dipaco
from transformers import AutoTokenizer

from dipaco.config import load_config
from dipaco.run_dir import RunDir
from dipaco.stages.context import PathFactory
from routing.router import Assignments, Router
from sharding.reader import ShardReader


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> RunDir:
    run = RunDir(tmp_path_factory.mktemp("tiny"))
    dipaco("run", "--config", str(TINY), "--run", str(run.root))
    return run


def test_every_artifact_is_written_and_readable(tiny_run):
    run = tiny_run
    config = load_config(run.config)
    assert AutoTokenizer.from_pretrained(run.tokenizer).eos_token == "<|endoftext|>"
    router = Router.load(run.routing)
    assignments = Assignments.load(run.routing)
    assert assignments.router_fingerprint == router.fingerprint()
    reader = ShardReader(run.shards)
    assert reader.verify() > 0
    assert reader.n_paths == 4 and reader.router_fingerprint == router.fingerprint()
    factory = PathFactory(config, run)
    assert factory.store.current_round() == config.train.rounds
    summary = json.loads(run.train_summary.read_text())
    assert [r["round"] for r in summary["rounds"]] == list(range(1, config.train.rounds + 1))
    for name in ("dense-equal-steps", "dense-equal-compute"):
        assert (run.baselines / name / "model.safetensors").exists()


def test_evaluation_json_compares_routed_paths_with_both_baselines(tiny_run):
    config = load_config(tiny_run.config)
    results = json.loads(tiny_run.eval_results.read_text())
    models = {m["model"]: m for m in results["models"]}
    assert set(models) == {"DiPaCo 2x2 routed", "dense-equal-steps", "dense-equal-compute"}
    steps = config.train.rounds * config.inner.steps
    assert models["dense-equal-steps"]["steps_per_path"] == steps
    assert models["dense-equal-compute"]["steps_per_path"] == 4 * steps
    for m in models.values():
        assert 1 < m["perplexity"] < 2 * 512, m  # better than a blind guess over a 512-token vocabulary
    assert sum(p["documents"] for p in results["per_path"]) == results["test_documents"] > 0
    assert sum(p["tokens"] for p in results["per_path"]) == results["scored_tokens"]
    routed = [p for p in results["per_path"] if p["documents"]]
    nll = sum(p["tokens"] * math.log(p["perplexity"]) for p in routed)
    assert models["DiPaCo 2x2 routed"]["perplexity"] == pytest.approx(math.exp(nll / results["scored_tokens"]))


def test_a_killed_train_resumes_without_losing_or_redoing_work(tiny_run, tmp_path):
    """Kill `dipaco train` (coordinator and islands) right after round 1 commits, then run it again:
    round-2 results that islands had finished are reused, and the modules equal the uninterrupted run's."""
    run = RunDir(tmp_path / "resumed")
    for part in ("tokenizer", "routing", "shards"):
        shutil.copytree(tiny_run.root / part, run.root / part)
    common = ["--config", str(TINY), "--run", str(run.root)]
    proc = subprocess.Popen([sys.executable, "-m", "dipaco", "train", *common], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = run.store / "state.json"
    deadline = time.monotonic() + 120
    while not (state.exists() and json.loads(state.read_text())["round"] >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, "training ended before round 1 committed"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(state.read_text())["round"] == 1, "killed too late to test resuming"
    dipaco("island", *common, "--path", "2")  # one island finishes round 2 on its own (a no-op if it had)
    finished = {p: p.stat().st_mtime_ns for p in (run.store / "results" / "round-000002").glob("*.safetensors")}

    dipaco("train", *common)
    for path, mtime in finished.items():
        assert path.stat().st_mtime_ns == mtime, f"{path.name} was finished before the kill but trained again"
    config = load_config(TINY)
    resumed, straight = PathFactory(config, run).store, PathFactory(config, tiny_run).store
    assert resumed.current_round() == straight.current_round() == 2
    for name in PathFactory(config, run).topology.modules:
        a, b = resumed.read_module(2, name), straight.read_module(2, name)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_cli_errors_name_the_problem(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dipaco", "train", "--config", str(TINY), "--run",
                             str(tmp_path), "inner.stepz=3"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert result.returncode == 1 and "inner.stepz" in result.stderr
    result = subprocess.run([sys.executable, "-m", "dipaco", "eval", "--config", str(TINY), "--run", str(tmp_path)],
                            cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert result.returncode == 1 and "run `dipaco " in result.stderr


def test_help_explains_every_stage():
    for stage in ("run", "route", "shard", "train", "island", "baselines", "eval"):
        out = subprocess.run([sys.executable, "-m", "dipaco", stage, "--help"], cwd=ROOT, env=ENV,
                             capture_output=True, text=True)
        assert out.returncode == 0 and "--config" in out.stdout and "--run" in out.stdout


def test_a_grid_that_does_not_match_the_shards_is_refused(tiny_run, tmp_path):
    run = RunDir(tmp_path / "other")
    shutil.copytree(tiny_run.shards, run.shards)
    shutil.copytree(tiny_run.tokenizer, run.tokenizer)
    result = subprocess.run([sys.executable, "-m", "dipaco", "train", "--config", str(TINY), "--run", str(run.root),
                             "topology.levels=[3]"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert result.returncode == 1 and "holds 4 paths" in result.stderr and "gives 3" in result.stderr


def test_a_paused_run_resumes_with_the_next_train(tiny_run, tmp_path):
    """`train.stop_after_round` pauses a run; the next `dipaco train` restarts the coordinator over the
    existing task board (a board read back at start must still be written when it changes)."""
    run = RunDir(tmp_path / "paused")
    for part in ("tokenizer", "routing", "shards"):
        shutil.copytree(tiny_run.root / part, run.root / part)
    common = ["--config", str(TINY), "--run", str(run.root)]
    dipaco("train", *common, "train.stop_after_round=1", timeout=120)
    assert json.loads(run.train_summary.read_text())["rounds_completed"] == 1
    dipaco("train", *common, timeout=120)
    assert json.loads(run.train_summary.read_text())["rounds_completed"] == 2
