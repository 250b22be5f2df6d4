"""Where dipaco may write: nothing over what it did not create.

    with output_dir(Path("out/path3"), overwrite=False, protected=[run.root], what="dipaco export") as tmp:
        model.save_pretrained(tmp)             # renamed to out/path3 when the block ends
    check_run_dir(run.root)                    # before a stage writes into a run directory

An output directory is written whole under a fresh hidden sibling (`.<name>.dipaco-tmp-<random>`),
marked with `.dipaco-output` (who wrote it, when, its files), then renamed into place, so a reader sees
the old export or the whole new one. The target must be new, empty, or an earlier dipaco output (its
marker says so) and then only with `overwrite`, and only when it holds no file the marker does not list
(one a person added is never deleted); a file, a directory of anything else, a run directory or
anything inside one (`protected`) is refused before any work. Siblings are never touched: the
temporary names are unique and only what this call created is removed. A write that fails (a full disk)
is an `OutputError` naming the target and the last file written, and leaves nothing behind.

A run directory gets the marker `.dipaco-run`; a non-empty directory that has neither it nor any
artifact of a run is refused as `--run`, so `dipaco route --run ~/Documents` writes nothing there. The
commands that make a run's artifacts (`dipaco run`, `route`, `shard`, ...) hold `.dipaco-lock` in it
while they run: a second one on the same directory is refused, naming the first.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

OUTPUT_MARKER = ".dipaco-output"
RUN_MARKER = ".dipaco-run"
LOCK_FILE = ".dipaco-lock"  # held by the command writing the run's artifacts (`locked_run_dir`)
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
        added = foreign_files(out)
        if added:
            raise OutputError(f"{out} holds an earlier dipaco output, but also files dipaco did not write there: "
                              f"{', '.join(added[:5])}{' ...' if len(added) > 5 else ''}; --overwrite would delete "
                              f"them: move them out, or choose another directory")


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() or p.is_symlink())


def foreign_files(out: Path) -> list[str]:
    """Files in the dipaco output `out` that its marker does not list (added after the export); [] for a
    marker from before the lists."""
    try:
        written = json.loads((out / OUTPUT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        written = None
    if not isinstance(written, list):
        return []
    return [name for name in _files(out) if name not in set(written) | {OUTPUT_MARKER}]


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
        try:
            yield tmp
            marker = {"written_by": what, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "files": _files(tmp)}
            (tmp / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n")
        except Exception as err:
            if not (isinstance(err, OSError) or type(err).__name__ == "SafetensorError"):
                raise
            raise OutputError(f"{what} could not write {out}: {_written(tmp)} ({type(err).__name__}: {err}); nothing "
                              f"was left behind{_disk_full_hint(err, out)}") from None
        check_output_target(out, overwrite=overwrite, protected=protected)  # it may have appeared meanwhile
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _written(tmp: Path) -> str:
    """What a failed write had written last (the file it failed on, most likely)."""
    files = [p for p in tmp.rglob("*") if p.is_file()]
    if not files:
        return "no file written"
    last = max(files, key=lambda p: p.stat().st_mtime_ns)
    return f"the last file written was {last.relative_to(tmp)} ({last.stat().st_size:,} bytes)"


def _disk_full_hint(err: BaseException, out: Path) -> str:
    full = getattr(err, "errno", None) == errno.ENOSPC or "StorageFull" in str(err) or "No space left" in str(err)
    if not full:
        return ""
    free = shutil.disk_usage(out.parent).free
    return f": the disk holding {out.parent} is full ({free:,} bytes free); free some space or export elsewhere"


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


@contextmanager
def locked_run_dir(root: Path, *, command: str) -> Iterator[None]:
    """Hold the run directory's lock (`.dipaco-lock`, an exclusive flock, released when the process ends
    however it ends) while `command` runs; a second command that wants it is refused at once, naming the
    holder, instead of racing the first over the same files."""
    with open(root / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            holder = lock.read().strip() or "a dipaco command"
            raise OutputError(f"run directory {root} is in use by {holder}; wait for it to end, or use "
                              f"another --run") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"dipaco {command} (pid {os.getpid()} on {socket.gethostname()}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        lock.flush()
        yield


def check_writable(directory: Path) -> None:
    """Fail now, before any work, when `directory` cannot take new files (read-only, no permission)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dipaco-write-check-"):
            pass
    except OSError as err:
        raise OutputError(f"{directory} is not writable ({err.strerror or err}); dipaco writes its results "
                          f"there: fix its permissions or use another directory") from None
