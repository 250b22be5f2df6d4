"""dipaco.code_version on a scratch git checkout, and train.json's record of each session's code."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dipaco.code_version import code_version, describe_code
from dipaco.stages.train import code_sessions


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> Path:
    root = tmp_path / "repo"
    for name in ("dipaco/a.py", "bench/results/x.md", "README.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("one\n")
    git(root.parent, "init", "-q", str(root))
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_a_clean_checkout_gives_its_commit(checkout):
    assert code_version(checkout) == {"commit": git(checkout, "rev-parse", "HEAD"), "clean": True}
    assert describe_code(code_version(checkout)) == f"commit {git(checkout, 'rev-parse', 'HEAD')[:7]} (clean)"


@pytest.mark.parametrize("change", ["dipaco/a.py", "README.md", "dipaco/new.py"])
def test_a_changed_tracked_file_or_new_code_makes_it_dirty(checkout, change):
    (checkout / change).write_text("two\n")
    code = code_version(checkout)
    assert code["clean"] is False and describe_code(code).endswith("with local changes")


@pytest.mark.parametrize("change", ["bench/results/x.md", "bench/results/new.json", "notes.txt"])
def test_results_and_files_outside_the_code_leave_it_clean(checkout, change):
    (checkout / change).write_text("two\n")
    assert code_version(checkout)["clean"] is True


def test_outside_a_checkout_or_below_its_top_there_is_no_version(checkout, tmp_path):
    (tmp_path / "plain").mkdir()
    assert code_version(tmp_path / "plain") is None
    assert code_version(checkout / "dipaco") is None  # a package inside another project's checkout
    assert describe_code(None) == "an unknown commit"


def test_train_json_records_a_session_when_the_code_changes():
    clean = {"commit": "a" * 40, "clean": True}
    sessions = code_sessions([], clean, first_round=1)
    assert sessions == [{**clean, "first_round": 1}]
    assert code_sessions(sessions, clean, first_round=4) == sessions  # resumed with the same code
    dirty = code_sessions(sessions, {**clean, "clean": False}, first_round=4)
    assert dirty == [*sessions, {**clean, "clean": False, "first_round": 4}]
    assert code_sessions(dirty, None, first_round=2) == [*sessions, {"commit": None, "clean": None, "first_round": 2}]
