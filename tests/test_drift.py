"""Config drift refused (issue 13, item 5): a stage never reads artifacts made from other config values or
inputs, config.yaml never claims what was not run, and `dipaco run --restart-from STAGE` is the way out."""

import json
import logging
import shutil
from functools import partial

import pytest
from cli_helpers import TINY, copy_run, dipaco_in_process

from dipaco.config import load_config
from dipaco.data import demo_corpus_path
from dipaco.pipeline.fingerprints import (
    DriftError,
    check,
    corpus_changes,
    corpus_digest,
    differences,
    record,
    record_path,
    restart_from,
)
from routing.routing_config import CorpusConfig

TRAINED_PARTS = ("config.yaml", "tokenizer", "routing", "shards", "store", "train.json", "train-fingerprint.json")


def test_run_on_another_corpus_is_refused_and_config_yaml_is_kept(tiny_routed, tmp_path):
    run = copy_run(tiny_routed, tmp_path / "run")
    other = tmp_path / "other.jsonl"
    shutil.copy(demo_corpus_path(), other)
    before = run.config.read_bytes()
    code, log = dipaco_in_process("run", "--config", TINY, "--run", run.root, f"corpus.path={other}")
    assert code == 1
    assert '"demo" → "' + str(other) in log and "--restart-from route" in log and "new --run directory" in log
    assert run.config.read_bytes() == before, "config.yaml claims a corpus nothing was run on"
    assert not run.store.exists() and not run.train_summary.exists()


def test_rerouting_a_trained_run_then_evaluating_is_refused(tiny_trained, tmp_path):
    from dipaco.stages.route import route

    run = copy_run(tiny_trained, tmp_path / "run", TRAINED_PARTS)
    route(load_config(run.config, ["routing.seed=7"]), run)  # a new router; the shards are the old router's
    code, log = dipaco_in_process("eval", "--run", run.root)
    assert code == 1
    assert "router" in log and "routed again after sharding" in log and "--restart-from" in log
    assert not run.eval_results.exists()


def test_keys_a_stage_does_not_depend_on_never_trigger_it(tiny_routed):
    config = load_config(TINY, ["eval.batch_size=99", "inner.steps=9", "run.rounds=7", "routing.hf_batch_size=3",
                                "reroute.c=0.5", "outer.lr=0.3"])
    check(tiny_routed, config, ("route", "shard", "train"))  # no error


@pytest.mark.parametrize(("override", "stage", "expected"), [
    ("routing.svd_dim=8", "route", "routing.svd_dim: 16 → 8"),
    ("corpus.max_documents=500", "route", "corpus.max_documents: 600 → 500"),
    ("sharding.val_fraction=0.2", "shard", "sharding.val_fraction: 0.05 → 0.2"),
    ("sharding.tokens_per_shard=4096", "shard", "sharding.tokens_per_shard: 16777216 → 4096"),
])
def test_a_changed_key_is_named_with_old_and_new_value(tiny_routed, override, stage, expected):
    config = load_config(TINY, [override])
    assert expected in differences(tiny_routed, config, stage)
    with pytest.raises(DriftError, match=f"--restart-from {stage}"):
        check(tiny_routed, config, ("route", "shard"))


def test_train_refuses_a_store_trained_on_other_shards_or_another_model(tiny_routed, tmp_path):
    run = copy_run(tiny_routed, tmp_path / "run")
    config = load_config(TINY)
    record(run, "train", config, shards="0" * 64)
    assert any("shards/index.json" in d for d in differences(run, config, "train"))
    assert any(d.startswith("model.hidden_size: 32 → 64")
               for d in differences(run, load_config(TINY, ["model.hidden_size=64"]), "train"))


def test_a_corpus_edited_in_place_is_found_and_a_touched_one_is_not(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "one"}\n')
    config = CorpusConfig(path=str(corpus))
    saved = corpus_digest(config)
    corpus.touch()
    corpus.write_text('{"text": "one"}\n')  # same bytes, new mtime: the hash settles it
    assert corpus_changes(saved, config) == []
    corpus.write_text('{"text": "two"}\n')
    assert corpus_changes(saved, config) == [f"corpus file {corpus}: content changed (16 → 16 bytes)"]
    (tmp_path / "d").mkdir()
    assert corpus_changes(saved, CorpusConfig(path=str(tmp_path / "d"))) == [f"corpus file {corpus}: gone"]


def test_a_run_without_records_is_accepted_with_a_warning_but_a_router_mismatch_is_not(tiny_routed, tmp_path,
                                                                                        caplog):
    run = copy_run(tiny_routed, tmp_path / "run")
    record_path(run, "route").unlink()
    record_path(run, "shard").unlink()
    with caplog.at_level(logging.WARNING):
        check(run, load_config(TINY, ["routing.svd_dim=8"]), ("route", "shard"))
    assert "made before dipaco recorded fingerprints" in caplog.text
    router = json.loads((run.routing / "router.json").read_text())
    router["fingerprint"] = "f" * 64
    (run.routing / "router.json").write_text(json.dumps(router))
    with pytest.raises(DriftError, match="routed again after sharding"):
        check(run, load_config(TINY), ("route", "shard"))


def test_restart_from_moves_that_stage_and_later_ones_aside(tiny_routed, tmp_path):
    run = copy_run(tiny_routed, tmp_path / "run")
    config = load_config(TINY, ["sharding.val_fraction=0.2"])
    moved = restart_from(run, config, "shard")
    assert (moved / "shards" / "index.json").exists() and not run.shards.exists()
    assert (run.routing / "assignments.json").exists()  # route is kept
    check(run, config, ("route", "shard", "train"))  # nothing stale left
    with pytest.raises(ValueError, match="store.url"):
        restart_from(run, load_config(TINY, ["store.url=s3://bucket/x"]), "route")


def test_run_restart_from_shard_redoes_it_with_the_new_value(tiny_routed, tmp_path, monkeypatch):
    run = copy_run(tiny_routed, tmp_path / "run")
    done = []
    def stage_done(config, run, args, *, alongside=None, stage):
        if alongside is not None:  # the baselines run the train stage alongside (eval.baselines_with_train)
            alongside()
        done.append(stage)

    commands = {"train": "train.command_train", "baselines": "baselines.command", "eval": "evaluate.command",
                "report": "report.command"}
    for stage, function in commands.items():  # the stages after shard are tested elsewhere
        monkeypatch.setattr(f"dipaco.stages.{function}", partial(stage_done, stage=stage))
    code, log = dipaco_in_process("run", "--config", TINY, "--run", run.root, "sharding.val_fraction=0.2",
                                  "--restart-from", "shard")
    assert code == 0, log
    assert json.loads(record_path(run, "shard").read_text())["keys"]["sharding.val_fraction"] == 0.2
    assert "val_fraction: 0.2" in run.config.read_text()
    assert done == ["train", "baselines", "eval", "report"]
    assert list((run.root / "superseded").glob("*/shards/index.json"))


def test_a_corpus_moved_with_the_same_content_is_not_a_change(tmp_path):
    """The bundled corpus of a checkout moved elsewhere (or a data folder renamed) is the same corpus; a
    file with other content under the new path is still named, and so is the one it replaced."""
    (tmp_path / "a").mkdir()
    corpus = tmp_path / "a" / "c.jsonl"
    corpus.write_text('{"text": "one"}\n')
    saved = corpus_digest(CorpusConfig(path=str(corpus)))
    moved = tmp_path / "b" / "c.jsonl"
    moved.parent.mkdir()
    corpus.rename(moved)
    assert corpus_changes(saved, CorpusConfig(path=str(moved))) == []
    moved.write_text('{"text": "two"}\n')
    assert corpus_changes(saved, CorpusConfig(path=str(moved))) == [f"corpus file {corpus}: gone",
                                                                     f"corpus file {moved}: new"]


def stub_stages(monkeypatch, done: list[str], stages=("route", "shard", "train", "baselines", "eval", "report")):
    """`dipaco run`'s stages replaced by stubs that note their names in `done` (the stages are tested elsewhere)."""
    commands = {"route": "route.command", "shard": "shard.command", "train": "train.command_train",
                "baselines": "baselines.command", "eval": "evaluate.command", "report": "report.command"}

    def stage_done(config, run, args, *, alongside=None, stage):
        if alongside is not None:
            alongside()
        done.append(stage)

    for stage in stages:
        monkeypatch.setattr(f"dipaco.stages.{commands[stage]}", partial(stage_done, stage=stage))


@pytest.mark.parametrize("interrupted", ["route", "shard"])
def test_a_stage_interrupted_after_its_artifacts_but_before_its_record_is_redone(tiny_routed, tmp_path, monkeypatch,
                                                                                  caplog, interrupted):
    """Issue 29, item 6: a Ctrl-C in routing's last second leaves assignments.json without fingerprint.json
    (and no shards). The next `dipaco run`, here on another corpus, routed nothing and exited 0 with a
    config.yaml claiming that corpus; now the stage is redone (and every stage after it), never skipped.
    Likewise shards/index.json without shards/fingerprint.json."""
    run = copy_run(tiny_routed, tmp_path / "run")
    record_path(run, interrupted).unlink()
    if interrupted == "route":
        shutil.rmtree(run.shards)
    done: list[str] = []
    stub_stages(monkeypatch, done)
    other = tmp_path / "other.jsonl"  # routing again may take another corpus; a finished routing may not
    shutil.copy(demo_corpus_path(), other)
    with caplog.at_level(logging.WARNING):
        code, log = dipaco_in_process("run", "--config", TINY, "--run", run.root,
                                      *([f"corpus.path={other}"] if interrupted == "route" else []))
    assert code == 0, log
    assert done == ["route", "shard", "train", "baselines", "eval", "report"][["route", "shard"].index(interrupted):]
    assert "made before dipaco recorded fingerprints" not in caplog.text
    assert f"but not the record of a finished `dipaco {interrupted}`" in caplog.text


def test_a_run_made_before_records_is_not_routed_again(tiny_routed, tmp_path, monkeypatch):
    run = copy_run(tiny_routed, tmp_path / "run")
    record_path(run, "route").unlink()
    record_path(run, "shard").unlink()
    done: list[str] = []
    stub_stages(monkeypatch, done)
    code, log = dipaco_in_process("run", "--config", TINY, "--run", run.root)
    assert code == 0, log
    assert done == ["train", "baselines", "eval", "report"]
