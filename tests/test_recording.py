"""bench/recording.py: the provenance a results file records, and when its figures may be quoted."""

from __future__ import annotations

import json

import pytest

from bench import recording
from bench.recording import describe_provenance, quotable, run_code, write_results

CLEAN = {"commit": "a" * 40, "clean": True}


def test_a_run_directory_says_the_code_that_trained_each_model(tmp_path):
    run = tmp_path / "dipaco"
    (run / "pretrain").mkdir(parents=True)
    (run / "baselines" / "dense-equal-steps").mkdir(parents=True)
    (run / "pretrain" / "summary.json").write_text(json.dumps({"steps": 5, "code": CLEAN}))
    (run / "baselines" / "dense-equal-steps" / "summary.json").write_text(json.dumps({"steps": 5}))  # before `code`
    rows = [{"round": r} for r in (1, 2, 3)]
    (run / "train.json").write_text(json.dumps({"rounds": rows, "code": [{**CLEAN, "clean": False, "first_round": 2}]}))
    assert run_code(run) == [
        {"what": "dipaco: rounds trained before the code was recorded", "commit": None, "clean": None},
        {"what": "dipaco: rounds from 2", "commit": "a" * 40, "clean": False},
        {"what": "dipaco: baselines/dense-equal-steps", "commit": None, "clean": None},
        {"what": "dipaco: pretrain", **CLEAN},
    ]


def test_only_a_clean_tree_with_models_from_clean_trees_is_quotable():
    assert quotable({"commit": "a" * 40, "clean": True})
    assert quotable({"commit": "a" * 40, "clean": True, "trained_at": [{"what": "x", **CLEAN}]})
    assert not quotable({"commit": "a" * 40, "clean": False})
    assert not quotable({"commit": "a" * 40, "clean": True, "trained_at": [{"what": "x", "commit": None, "clean": None}]})
    assert not quotable({"source": "measured by `x` at commit 6db885c+local changes on 2026-12-02"})  # older files
    assert quotable({"source": "measured by `x` at commit 6db885c on 2026-12-02"})
    assert quotable({"source": "transcribed from the README of commit 25606d7"})


@pytest.mark.parametrize("clean", [True, False])
def test_the_source_line_says_whether_the_tree_was_clean(tmp_path, monkeypatch, clean):
    monkeypatch.setattr(recording, "code_version", lambda root: {**CLEAN, "clean": clean})
    trained = [{"what": "dipaco: rounds from 1", **CLEAN}]
    path = write_results("x", {"value": 1.5}, "# X\n\nbody\n", results_dir=tmp_path, trained_at=trained)
    record = json.loads(path.read_text())
    assert (record["commit"], record["clean"], record["trained_at"], record["value"]) == ("a" * 40, clean, trained, 1.5)
    line = path.with_suffix(".md").read_text().splitlines()[2]
    assert describe_provenance(record) in line and "the models trained at commit aaaaaaa (clean)" in line
    assert ("from a clean tree" in line and "not quotable" not in line) if clean else \
        ("from a tree with local changes" in line and line.count("(not quotable)") == 1)
