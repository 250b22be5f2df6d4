"""The commit of the code that runs and whether its tree is clean: what a run records of the code that trained it.

    code_version()            # {"commit": "95b2359...", "clean": True}; None outside a git checkout (a wheel)
    code_version(Path("."))   # another checkout

Clean: no tracked file differs from the commit and no untracked file lies in a code folder (dipaco/,
routing/, sharding/, bench/, configs/, experiments/, scripts/). Results folders (bench/results,
experiments/results) are not code: a benchmark that rewrites its results file leaves the tree clean for
the next one. `dipaco train` records it in train.json (`code`), the dense trainer in its summary.json.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout this package was imported from
CODE_FOLDERS = ("dipaco", "routing", "sharding", "bench", "configs", "experiments", "scripts")
NOT_CODE = (":(exclude)bench/results", ":(exclude)experiments/results")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def code_version(root: Path = ROOT) -> dict | None:
    """`{"commit": full sha, "clean": bool}` of the git checkout at `root` (None when `root` is not the top
    of one, e.g. a package installed from a wheel, or git is missing)."""
    try:
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None
        commit = _git(root, "rev-parse", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_CODE)
        untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *CODE_FOLDERS, *NOT_CODE)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "clean": not changed and not untracked}


def describe_code(code: dict | None) -> str:
    """"commit 95b2359 (clean)", "commit 95b2359 with local changes" or "an unknown commit"."""
    if not code or not code.get("commit"):
        return "an unknown commit"
    return f"commit {code['commit'][:7]}" + (" (clean)" if code.get("clean") else " with local changes")
