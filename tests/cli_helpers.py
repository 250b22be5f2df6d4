"""Running the real `dipaco` command from end-to-end tests (offline, one torch thread per process)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DIPACO_THREADS": "1"}


def dipaco(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run `python -m dipaco <args>` in the repository root; fail the test with its output if it fails."""
    result = subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"dipaco {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result
