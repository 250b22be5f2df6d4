"""The quality benchmark at half the demo's budget: `python bench/bench_quality.py --budget 0.5 --name paths`.

    python bench/bench_paths.py --large-hidden 0    # as `make bench` runs it (no dense-large model)

Writes bench/results/paths.{json,md,png}. Other options go through to bench_quality.py, e.g. `--budget 1`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parent / "bench_quality.py"
    sys.exit(subprocess.call([sys.executable, str(script), "--budget", "0.5", "--name", "paths", *sys.argv[1:]]))
