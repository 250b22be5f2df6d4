"""Write a benchmark's results to bench/results/<name>.{json,md} with the machine they were measured on.

    from bench.recording import write_results   # in a bench/bench_*.py script, after sys.path.insert(0, ROOT)
    write_results("routing", results, markdown)
    write_results("capacity", results, markdown, results_dir=EXPERIMENT_RESULTS)   # an experiments/ script

Every results file says where its figures come from: `source` (measured by which command, at which
commit, on which date), `reproduce` (the command that writes the file again) and `machine` (CPU model,
usable cores, torch version and CPU capability, CUDA device, load average). The markdown table gets the
same in one line under its title, so a figure quoted from it in the README or docs/ names its machine.
Files transcribed from older notes (no script can rewrite them) carry a hand-written `source` instead.

Provenance: `commit` and `clean` (`dipaco.code_version`: no tracked change, no untracked code) of the tree
that measured, and `trained_at`, the code that trained the models a script read from run directories
(`run_code`: train.json's and the dense summaries' `code`), when it passes them. A figure is quotable
(`quotable`) only from a clean tree whose models were all trained from clean trees; the source line says
which ("from a clean tree", or "not quotable").
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

from dipaco.code_version import code_version, describe_code

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
    """The checked-out commit (short), with "+local changes" when the tree is not clean (`code_version`)."""
    code = code_version(ROOT)
    if code is None:
        return None
    return code["commit"][:7] + ("" if code["clean"] else "+local changes")


def run_code(run: Path) -> list[dict]:
    """The code that trained a run directory's models: train.json's sessions and the dense summaries'
    (warm start, baselines), each `{"what", "commit", "clean"}`; a model trained before they were
    recorded has commit and clean None."""
    out = []
    train = run / "train.json"
    if train.exists():
        summary = json.loads(train.read_text())
        sessions = summary.get("code") or []
        if summary.get("rounds") and (not sessions or sessions[0].get("first_round", 1) > 1):
            out.append({"what": f"{run.name}: rounds trained before the code was recorded", "commit": None, "clean": None})
        out += [{"what": f"{run.name}: rounds from {s.get('first_round', 1)}", "commit": s.get("commit"),
                 "clean": s.get("clean")} for s in sessions]
    for dense in sorted([run / "pretrain", *(run / "baselines").glob("*")]):
        if (dense / "summary.json").exists():
            code = json.loads((dense / "summary.json").read_text()).get("code") or {}
            out.append({"what": f"{run.name}: {dense.relative_to(run)}", "commit": code.get("commit"),
                        "clean": code.get("clean")})
    return out


def distinct_code(runs: Iterable[Path]) -> list[dict]:
    """`run_code` of several runs, one entry per distinct (commit, clean tree): the first model each trained."""
    seen: dict[tuple, dict] = {}
    for run in runs:
        for code in run_code(run):
            seen.setdefault((code["commit"], code["clean"]), code)
    return list(seen.values())


def quotable(record: dict) -> bool:
    """Whether a results record's figures may be quoted: measured from a clean tree, and every model it
    read trained from one. A file written before `clean` was recorded: its source does not say
    "+local changes" (hand-written sources claim nothing)."""
    if "clean" not in record:
        return "+local changes" not in str(record.get("source", ""))
    return record["clean"] is True and all(t.get("clean") is True for t in record.get("trained_at") or [])


def describe_provenance(record: dict) -> str:
    """"at commit 95b2359 from a clean tree" or "... from a tree with local changes (not quotable)", with
    the code that trained the models when it is recorded."""
    tree = "a clean tree" if record["clean"] else "a tree with local changes"
    text = f"at commit {(record['commit'] or 'unknown')[:7]} from {tree}"
    if record.get("trained_at"):
        text += f", the models trained at {', '.join(sorted({describe_code(t) for t in record['trained_at']}))}"
    return text + ("" if quotable(record) else " (not quotable)")


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


def write_results(name: str, results: dict, markdown: str, *, results_dir: Path | None = None,
                  trained_at: list[dict] | None = None) -> Path:
    """Write <results_dir>/<name>.json (results + source, reproduce, commit, clean, trained_at, machine)
    and <name>.md; results_dir defaults to bench/results (`RESULTS`).

    `markdown` is the benchmark's own text; the source line goes under its first (title) line.
    `trained_at`: the code that trained the models read from run directories (`run_code`), when the
    script did not train them all in this process. Returns the JSON path.
    """
    command = command_line()
    code = code_version(ROOT)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    provenance = {"commit": code["commit"] if code else None, "clean": bool(code and code["clean"]),
                  **({"trained_at": trained_at} if trained_at is not None else {})}
    record = {"source": f"measured by `{command}` {describe_provenance(provenance)} on {date}",
              "reproduce": command, **provenance, "machine": machine(), **results}
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
