"""Kept as a name: `python bench/bench_paths.py` is `python bench/bench_quality.py --budget 0.5 --name paths`.

bench/bench_quality.py replaced this script (it compares DiPaCo with DiLoCo, run with both outer
steps, and the dense baselines, all counting the warm start); the reduced budget here is the one this
script used to run (4 of the demo's 8 rounds). Other options go through to it, e.g. `--budget 1`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parent / "bench_quality.py"
    sys.exit(subprocess.call([sys.executable, str(script), "--budget", "0.5", "--name", "paths", *sys.argv[1:]]))
