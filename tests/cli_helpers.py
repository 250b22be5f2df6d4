"""Running the real `dipaco` command from tests (the one way tests start it), and copying a run.

`dipaco` and `start_dipaco` start `python -m dipaco` processes; `dipaco_in_process` calls the same entry
point in the test's process, for commands whose output is an exit code and a message.

The environment the processes inherit (offline Hugging Face, one torch thread) is set in conftest.py.
"""

import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dipaco.run_dir import RunDir

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
ENV = os.environ  # live: what conftest.py sets
ROUTED_PARTS = ("config.yaml", "tokenizer", "routing", "shards")  # what `dipaco route` and `dipaco shard` write


def _command(args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "dipaco", *args]


def dipaco(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run `python -m dipaco <args>` in the repository root; fail the test with its output if it fails."""
    result = subprocess.run(_command(args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"dipaco {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def dipaco_in_process(*args: str | Path) -> tuple[int, str]:
    """`dipaco <args>` through `dipaco.cli.main` in this process, without an interpreter's start-up (seconds
    of imports): its exit code and what it logged (at least its warnings and errors)."""
    from dipaco.cli import main

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        code = main([str(a) for a in args])
    finally:
        logging.getLogger().removeHandler(handler)
    return code, stream.getvalue()


def start_dipaco(*args: str) -> subprocess.Popen:
    """Start `python -m dipaco <args>` in a new session (kill it and its children with os.killpg), output dropped."""
    return subprocess.Popen(_command(args), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def copy_run(source: RunDir, root: Path, parts: tuple[str, ...] = ROUTED_PARTS) -> RunDir:
    """A copy of `parts` of the run `source` at `root`, for a test that writes into a run other tests share."""
    root.mkdir(parents=True)
    for part in parts:
        copy = shutil.copytree if (source.root / part).is_dir() else shutil.copy2
        copy(source.root / part, root / part)
    return RunDir(root)
