"""End to end: `dipaco run` on the tiny config over a slice of the bundled corpus, then resume.

Real components throughout (HF datasets, tokenizers, faiss, transformers, island processes). The run
is conftest's session-wide `tiny_trained` (3 rounds, baselines, every eval mode); the slow tests kill
or pause `dipaco train` on a copy of `tiny_routed` and resume it.

    make test                                         # the fast tests
    python -m pytest tests/test_end_to_end.py -m slow  # kill / pause and resume
"""

import json
import math
import os
import signal
import time

import pytest
import torch
from cli_helpers import TINY, copy_run, dipaco, dipaco_in_process, start_dipaco
from transformers import AutoTokenizer

from dipaco.code_version import code_version
from dipaco.config import load_config
from dipaco.pipeline.context import PathFactory
from dipaco.stages.evaluate import format_results, wire_bytes
from routing.assignments import Assignments
from routing.router import Router
from sharding.reader import ShardReader


def test_every_artifact_is_written_and_readable(tiny_trained):
    run = tiny_trained
    config = load_config(run.config)
    assert AutoTokenizer.from_pretrained(run.tokenizer).eos_token == "<|endoftext|>"
    router = Router.load(run.routing)
    assignments = Assignments.load(run.routing)
    assert assignments.router_fingerprint == router.fingerprint()
    reader = ShardReader(run.shards)
    assert reader.verify() > 0
    assert reader.n_paths == 4 and reader.router_fingerprint == router.fingerprint()
    factory = PathFactory(config, run)
    assert factory.store.current_round() == config.run.rounds
    summary = json.loads(run.train_summary.read_text())
    assert [r["round"] for r in summary["rounds"]] == list(range(1, config.run.rounds + 1))
    # compression.download: update (the default): the islands rebuilt each version from the published updates
    assert summary["module_fallbacks"] == 0 and summary["bytes_module_updates"] > 0
    assert summary["download_flush"]["flush"] and summary["download_flush"]["bytes"] > 0
    code = code_version()  # the code that trained it: this checkout's (one session)
    assert summary["code"] == [{"commit": code and code["commit"], "clean": code and code["clean"], "first_round": 1}]
    for name in ("dense-equal-steps", "dense-equal-compute"):
        assert (run.baselines / name / "model.safetensors").exists()


def test_evaluation_json_compares_routed_paths_with_both_baselines(tiny_trained):
    config = load_config(tiny_trained.config)
    results = json.loads(tiny_trained.eval_results.read_text())
    vocabulary = len(AutoTokenizer.from_pretrained(tiny_trained.tokenizer))  # what a blind guess spreads over
    models = {m["model"]: m for m in results["models"]}
    assert set(models) == {"DiPaCo 2x2 routed", "dense-equal-steps", "dense-equal-compute"}
    steps = config.run.rounds * config.inner.steps
    assert models["dense-equal-steps"]["steps_per_path"] == steps
    assert models["dense-equal-compute"]["steps_per_path"] == 4 * steps
    for m in models.values():
        assert 1 < m["perplexity"] < vocabulary, m  # better than a blind guess over the run's vocabulary
    # every model scores the same tokens: each test document's after the routing prefix, none of the prefix
    docs, _, _ = PathFactory(config, tiny_trained).reader.test_documents()
    prefix = config.routing.prefix_tokens
    after_prefix = sum(max(0, len(doc) - prefix) for doc in docs)
    assert results["scored_tokens"] == after_prefix < sum(len(doc) for doc in docs)
    for m in models.values():
        assert (m["scored_tokens"], m["skipped_prefix_tokens"]) == (after_prefix, prefix), m
    assert sum(p["documents"] for p in results["per_path"]) == results["test_documents"] > 0
    assert sum(p["tokens"] for p in results["per_path"]) == results["scored_tokens"]
    routed = [p for p in results["per_path"] if p["documents"]]
    nll = sum(p["tokens"] * math.log(p["perplexity"]) for p in routed)
    assert models["DiPaCo 2x2 routed"]["perplexity"] == pytest.approx(math.exp(nll / results["scored_tokens"]))
    train = json.loads(tiny_trained.train_summary.read_text())  # the wire's bytes, as training counted them
    wire = results["bytes"]
    assert (wire["sent"], wire["float32_diloco"], wire["data_parallel"]) == (
        train["bytes_up"], train["bytes_float32"], train["bytes_data_parallel"])
    assert wire["sent_per_path"] == pytest.approx(train["bytes_up"] / 4)
    assert wire["times_fewer_than_data_parallel"] == pytest.approx(train["bytes_data_parallel"] / train["bytes_up"])
    assert 0 < wire["peak_round"] <= wire["sent"]
    assert results["traffic"] == train["traffic"] and results["traffic"]["up_bytes"] > wire["sent"]  # measured, all kinds
    older = wire_bytes({"bytes_up": 10, "bytes_float32": 40, "bytes_data_parallel": 400}, n_paths=2)  # a train.json without peaks
    assert older["peak_round"] is None and "would send 4.0x that" in format_results({**results, "bytes": older})


@pytest.mark.slow
def test_a_killed_train_resumes_without_losing_or_redoing_work(tiny_routed, tiny_trained, tmp_path):
    """Kill `dipaco train` (coordinator and islands) right after round 1 commits, then run it again:
    round-2 results that islands had finished are reused, and the last modules equal the uninterrupted run's."""
    run = copy_run(tiny_routed, tmp_path / "resumed")
    # the uninterrupted run's settings, keeping every round's results so that reuse can be checked
    common = ["--config", str(tiny_trained.config), "--run", str(run.root), "store.keep_versions=0"]
    proc = start_dipaco("train", *common)
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
    config = load_config(tiny_trained.config)
    resumed, straight = PathFactory(config, run).store, PathFactory(config, tiny_trained).store
    last = config.run.rounds
    assert resumed.current_round() == straight.current_round() == last
    for name in PathFactory(config, run).topology.modules:
        a, b = resumed.read_module(last, name), straight.read_module(last, name)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_cli_errors_name_the_problem(tmp_path):
    code, log = dipaco_in_process("train", "--config", TINY, "--run", tmp_path, "inner.stepz=3")
    assert code == 2 and "inner.stepz" in log  # a config error: a usage error (tests/test_cli_checks.py)
    code, log = dipaco_in_process("eval", "--config", TINY, "--run", tmp_path)
    assert code == 1 and "run `dipaco " in log


def test_help_explains_every_stage(capsys):
    assert "route" in dipaco("--help").stdout  # the command starts
    for stage in ("run", "route", "shard", "train", "island", "baselines", "eval"):
        with pytest.raises(SystemExit) as exit:
            dipaco_in_process(stage, "--help")
        out = capsys.readouterr().out
        assert exit.value.code == 0 and "--config" in out and "--run" in out, stage


def test_a_grid_that_does_not_match_the_shards_is_refused(tiny_routed, tmp_path):
    run = copy_run(tiny_routed, tmp_path / "other", ("shards", "tokenizer"))
    code, log = dipaco_in_process("train", "--config", TINY, "--run", run.root, "topology.levels=[3]")
    assert code == 1 and "topology.levels: [2, 2] → [3]" in log  # the drift check (shards/fingerprint.json)
    (run.shards / "fingerprint.json").unlink()  # shards made before the records: the reader's own check
    code, log = dipaco_in_process("train", "--config", TINY, "--run", run.root, "topology.levels=[3]")
    assert code == 1 and "holds 4 paths" in log and "gives 3" in log


@pytest.mark.slow
def test_a_paused_run_resumes_with_the_next_train(tiny_routed, tmp_path):
    """`run.stop_after_round` pauses a run; the next `dipaco train` restarts the coordinator over the
    existing task board (a board read back at start must still be written when it changes)."""
    run = copy_run(tiny_routed, tmp_path / "paused")
    common = ["--config", str(TINY), "--run", str(run.root)]
    dipaco("train", *common, "run.stop_after_round=1", timeout=120)
    assert json.loads(run.train_summary.read_text())["rounds_completed"] == 1
    dipaco("train", *common, timeout=120)
    assert json.loads(run.train_summary.read_text())["rounds_completed"] == 2


@pytest.mark.slow  # a round with real island processes, then eval and report: ~30 s
def test_a_finished_run_goes_on_when_run_rounds_grows(tiny_trained, tmp_path):
    """Issue 29, item 4, as reported: `dipaco run` (train with island processes) on the finished 3-round run
    with run.rounds=4 ended with "every island process has exited" and rc 1; now it trains round 4."""
    run = copy_run(tiny_trained, tmp_path / "run", tuple(p.name for p in tiny_trained.root.iterdir()))
    code, log = dipaco_in_process("run", "--config", run.config, "--run", run.root, "run.rounds=4")
    assert code == 0, log[-3000:]
    assert json.loads((run.store / "state.json").read_text())["round"] == 4
    assert json.loads(run.eval_results.read_text())["round"] == 4
