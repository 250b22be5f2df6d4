"""Writing nothing over what dipaco did not create (issue 13, item 1): `dipaco.outputs` and `dipaco export`.

Each test named after a reproduction in the issue failed on main before this (export renamed the target
aside and deleted it, and removed `<out>.tmp` / `<out>.old` siblings)."""

import json
import os
from pathlib import Path

import pytest
from cli_helpers import ROOT, copy_run, dipaco_in_process

from dipaco.config import load_config
from dipaco.outputs import OUTPUT_MARKER, OutputError, check_run_dir, check_writable, output_dir
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir


@pytest.fixture(scope="module")
def run(tiny_routed, tmp_path_factory) -> RunDir:
    """The tiny routed run with module version 0 in its store: enough to export (read only)."""
    run = copy_run(tiny_routed, tmp_path_factory.mktemp("outputs") / "run")
    start_or_resume_store(PathFactory(load_config(run.config), run))
    return run


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def export(run: RunDir, out: Path, *extra: str) -> tuple[int, str]:
    return dipaco_in_process("export", out, "--run", run.root, "--round", "0", *extra)


def test_export_refuses_a_directory_of_unrelated_files(run, tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "thesis.txt").write_text("years of work")
    for sibling in ("mine.tmp", "mine.old"):
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "keep.txt").write_text(sibling)
    before = _files(tmp_path)
    for extra in ([], ["--overwrite"]):
        code, log = export(run, target, "--path", "0", *extra)
        assert code == 1 and "was not written by dipaco" in log
    assert _files(tmp_path) == before  # the target and the .tmp / .old siblings untouched


def test_export_into_its_own_run_is_refused_and_the_run_is_intact(run):
    before = _files(run.root)
    for out in (run.root, run.root / "exported", run.root.parent):
        code, log = export(run, out, "--all", "--overwrite")
        assert code == 1 and "run directory" in log, log
    assert _files(run.root) == before


def test_export_onto_a_file_is_refused(run, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code, log = export(run, target, "--path", "0")
    assert code == 1 and "is not a directory" in log
    assert target.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_export_writes_a_marked_directory_and_replaces_it_only_with_overwrite(run, tmp_path):
    out = tmp_path / "path0"
    (tmp_path / "path0.tmp").write_text("a sibling")
    assert export(run, out, "--path", "0")[0] == 0
    assert (out / OUTPUT_MARKER).is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "dipaco_path.json").read_text())["path"] == 0
    code, log = export(run, out, "--path", "1")
    assert code == 1 and "--overwrite" in log
    assert json.loads((out / "dipaco_path.json").read_text())["path"] == 0
    assert export(run, out, "--path", "1", "--overwrite")[0] == 0
    assert json.loads((out / "dipaco_path.json").read_text())["path"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["path0", "path0.tmp"]  # no leftovers, sibling kept


def test_an_empty_directory_is_a_fine_target(run, tmp_path):
    (tmp_path / "empty").mkdir()
    assert export(run, tmp_path / "empty", "--all")[0] == 0
    assert (tmp_path / "empty" / "dipaco_mixture.json").is_file()


def test_a_failed_export_leaves_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError), output_dir(tmp_path / "out", overwrite=False) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("crash mid-export")
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_directory_that_holds_no_run_is_refused_as_run(tmp_path):
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(OutputError, match="holds no dipaco run"):
        check_run_dir(tmp_path)
    code, log = dipaco_in_process("route", "--run", tmp_path)
    assert code == 1 and "holds no dipaco run" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photo.jpg"]


def test_a_read_only_directory_is_named_before_any_work():
    read_only = Path("/proc/self")  # read-only even for root, which ignores permission bits
    with pytest.raises(OutputError, match="is not writable"):
        check_writable(read_only)


# --- issue 29, item 7 ------------------------------------------------------------------------------------
def test_export_onto_a_full_disk_names_the_target_and_leaves_nothing_behind(tmp_path):
    """safetensors reports a full disk as its own SafetensorError, which went up as a traceback."""
    from safetensors import SafetensorError

    with pytest.raises(OutputError, match=r"could not write .*out: the last file written was model\.safetensors .*"
                                          r"SafetensorError.*No space left .* the disk holding .* is full"):
        with output_dir(tmp_path / "out", overwrite=False, what="dipaco export") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x" * 10)
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
    assert list(tmp_path.iterdir()) == []


def test_overwrite_refuses_an_earlier_export_holding_files_a_person_added(run, tmp_path):
    out = tmp_path / "path0"
    assert export(run, out, "--path", "0")[0] == 0
    (out / "my-notes.md").write_text("mine")
    code, log = export(run, out, "--path", "1", "--overwrite")
    assert code == 1 and "files dipaco did not write there: my-notes.md" in log
    assert (out / "my-notes.md").read_text() == "mine"
    (out / "my-notes.md").unlink()
    assert export(run, out, "--path", "1", "--overwrite")[0] == 0


def test_a_second_command_on_the_same_run_directory_is_refused_naming_the_first(tmp_path, monkeypatch):
    """Two `dipaco run` on one fresh directory raced over the same files with a misleading error."""
    from test_drift import stub_stages

    from dipaco.outputs import locked_run_dir

    done: list[str] = []
    stub_stages(monkeypatch, done)
    monkeypatch.setattr("dipaco.stages.pretrain.command", lambda *a: done.append("pretrain"))
    run = tmp_path / "run"
    run.mkdir()
    with locked_run_dir(run, command="run"):  # the first `dipaco run` (its lock, as the other process's would be)
        code, log = dipaco_in_process("run", "--run", run, "--config", ROOT / "configs" / "tiny.yaml")
    assert code == 1 and f"run directory {run} is in use by dipaco run (pid {os.getpid()}" in log
    assert done == []
    assert dipaco_in_process("run", "--run", run, "--config", ROOT / "configs" / "tiny.yaml")[0] == 0  # released
    assert done == ["route", "shard", "train", "baselines", "eval", "report"]
