"""Write a benchmark's results to bench/results/<name>.{json,md} with the machine they were measured on.

    from bench.recording import write_results   # in a bench/bench_*.py script, after sys.path.insert(0, ROOT)
    write_results("routing", results, markdown)
    write_results("capacity", results, markdown, results_dir=EXPERIMENT_RESULTS)   # an experiments/ script

Every results file says where its figures come from: `source` (measured by which command, at which
commit, on which date), `reproduce` (the command that writes the file again) and `machine` (CPU model,
usable cores, torch version and CPU capability, CUDA device, load average). The markdown table gets the
same in one line under its title, so a figure quoted from it in the README or docs/ names its machine.
Files transcribed from older notes (no script can rewrite them) carry a hand-written `source` instead.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # the standard benchmarks' (bench/)
EXPERIMENT_RESULTS = ROOT / "experiments" / "results"  # the research scripts' (experiments/)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the figures depend on: CPU, cores, torch build and CPU capability, CUDA device, load."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def git_commit() -> str | None:
    """The checked-out commit, with "+local changes" when the tracked files differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit}+local changes" if dirty else commit


def command_line() -> str:
    """This process's command, as someone would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def describe(record: dict) -> str:
    """One markdown line: where the figures come from and the machine they were measured on."""
    m = record.get("machine")
    if isinstance(m, dict) and "cpu" in m:
        gpu = f"CUDA device {m['cuda_device']}" if m.get("cuda_device") else "no CUDA device"
        where = (f"{m['cpu']} ({m['cpu_cores_usable']} of {m['cpu_cores']} cores usable, load average "
                 f"{m['load_average']} at the end), torch {m['torch']} (CPU capability {m['cpu_capability']}), {gpu}")
    else:
        where = str(m)
    return f"Source: {record['source']}. Machine: {where}. Reproduce: `{record['reproduce']}`."


def write_results(name: str, results: dict, markdown: str, *, results_dir: Path | None = None) -> Path:
    """Write <results_dir>/<name>.json (results + source, reproduce, machine) and <name>.md; results_dir
    defaults to bench/results (`RESULTS`).

    `markdown` is the benchmark's own text; the source line goes under its first (title) line.
    Returns the JSON path.
    """
    command = command_line()
    commit = git_commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    record = {"source": f"measured by `{command}` at commit {commit} on {date}", "reproduce": command,
              "machine": machine(), **results}
    results_dir = results_dir or RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    (results_dir / f"{name}.md").write_text(with_source(record, markdown))
    return path


def with_source(record: dict, markdown: str) -> str:
    """`markdown` with the source / machine line inserted under its title."""
    title, _, body = markdown.partition("\n")
    return f"{title}\n\n{describe(record)}\n{body}" if title.startswith("#") else f"{describe(record)}\n\n{markdown}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table: a header row, a rule, one row per list (cells formatted with str)."""
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])
