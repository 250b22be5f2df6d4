"""Where dipaco may write: nothing over what it did not create.

    with output_dir(Path("out/path3"), overwrite=False, protected=[run.root], what="dipaco export") as tmp:
        model.save_pretrained(tmp)             # renamed to out/path3 when the block ends
    check_run_dir(run.root)                    # before a stage writes into a run directory

An output directory is written whole under a fresh hidden sibling (`.<name>.dipaco-tmp-<random>`),
marked with `.dipaco-output` (who wrote it, when), then renamed into place, so a reader sees the old
export or the whole new one. The target must be new, empty, or an earlier dipaco output (its marker
says so) and then only with `overwrite`; a file, a directory of anything else, a run directory or
anything inside one (`protected`) is refused before any work. Siblings are never touched: the
temporary names are unique and only what this call created is removed.

A run directory gets the marker `.dipaco-run`; a non-empty directory that has neither it nor any
artifact of a run is refused as `--run`, so `dipaco route --run ~/Documents` writes nothing there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

OUTPUT_MARKER = ".dipaco-output"
RUN_MARKER = ".dipaco-run"
RUN_ARTIFACTS = ("config.yaml", "tokenizer", "routing", "shards", "store", "pretrain", "baselines", "logs",
                 "train.json", "eval.json", "report.md")  # what a run made before the marker existed


class OutputError(ValueError):
    """A target dipaco refuses to write to; the message says why and what to do instead."""


def is_dipaco_output(directory: Path) -> bool:
    return (directory / OUTPUT_MARKER).is_file()


def check_output_target(out: Path, *, overwrite: bool, protected: Iterable[Path] = ()) -> None:
    """Refuse `out` unless it is new, empty, or (with `overwrite`) an earlier dipaco output outside `protected`."""
    resolved = out.resolve()
    for area in protected:
        area = Path(area).resolve()
        if resolved == area or area in resolved.parents:
            raise OutputError(f"{out} is inside the run directory {area}, whose files belong to the run; "
                              f"write the export to a directory outside it")
        if resolved in area.parents:
            raise OutputError(f"{out} contains the run directory {area}; write the export somewhere else")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{out} exists and is not a directory; choose a new directory name")
    if out.is_dir() and any(out.iterdir()):
        if not is_dipaco_output(out):
            raise OutputError(f"{out} is not empty and was not written by dipaco (no {OUTPUT_MARKER} in it); "
                              f"choose a new or empty directory, dipaco never replaces files it did not write")
        if not overwrite:
            raise OutputError(f"{out} holds an earlier dipaco output; pass --overwrite to replace it, "
                              f"or choose another directory")


@contextmanager
def output_dir(out: str | os.PathLike, *, overwrite: bool, protected: Iterable[Path] = (),
               what: str = "dipaco") -> Iterator[Path]:
    """A fresh temporary directory to fill; it replaces `out` when the block ends (module docstring)."""
    out = Path(out)
    protected = list(protected)
    check_output_target(out, overwrite=overwrite, protected=protected)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.dipaco-tmp-", dir=out.parent))
    try:
        yield tmp
        marker = {"written_by": what, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n")
        check_output_target(out, overwrite=overwrite, protected=protected)  # it may have appeared meanwhile
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` (empty, or checked to be a dipaco output) goes aside first."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.dipaco-old-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)  # put it back
        raise
    shutil.rmtree(old)


def check_run_dir(root: Path) -> None:
    """Refuse a `--run` that is a file, or a non-empty directory holding no run; mark a usable one."""
    if root.exists() and not root.is_dir():
        raise OutputError(f"run directory {root} exists and is not a directory")
    if root.is_dir() and not (root / RUN_MARKER).exists():
        entries = [p.name for p in root.iterdir() if not p.name.startswith(".")]  # .gitkeep, .DS_Store: empty
        if entries and not any(name in RUN_ARTIFACTS for name in entries):
            raise OutputError(f"run directory {root} is not empty and holds no dipaco run (it has "
                              f"{sorted(entries)[:5]}{' ...' if len(entries) > 5 else ''}); use a new or empty directory")


def mark_run_dir(root: Path) -> None:
    """Create the run directory and its marker (once)."""
    root.mkdir(parents=True, exist_ok=True)
    marker = root / RUN_MARKER
    if not marker.exists():
        marker.write_text("a dipaco run directory: dipaco writes and replaces files here\n")


def check_writable(directory: Path) -> None:
    """Fail now, before any work, when `directory` cannot take new files (read-only, no permission)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dipaco-write-check-"):
            pass
    except OSError as err:
        raise OutputError(f"{directory} is not writable ({err.strerror or err}); dipaco writes its results "
                          f"there: fix its permissions or use another directory") from None
