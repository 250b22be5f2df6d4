"""Summarise finished sync runs for experiments/results/path-holds.{json,md}: the islands' measured inner-state
and module traffic (train.json), the rounds a path changed island (the round manifests), the median round
length and coordinator overhead (a round's length minus its slowest task's training time, from the logs)
and the routed perplexity (eval.json).

    python experiments/path_holds.py main=/tmp/handoff-before2 handoff=/tmp/handoff-after3 --out experiments/results/path-holds.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
from pathlib import Path

DONE = re.compile(r"round-0*(\d+) attempt \d+ done in ([0-9.]+)s")
ROUND = re.compile(r"stages.train INFO: round (\d+):.*, ([0-9.]+)s$")


def moves(run: Path) -> list[list]:
    """[round, path, from island, to island] for every applied result on another island than the path's last."""
    last, moved = {}, []
    for manifest in sorted((run / "store" / "rounds").glob("round-*.json")):
        record = json.loads(manifest.read_text())
        for entry in record["applied"]:
            path, island = entry["path"], entry["island"]
            if path in last and last[path] != island:
                moved.append([record["round"], path, last[path], island])
            last[path] = island
    return moved


def timing(run: Path, log: Path) -> dict:
    """Median task seconds, round seconds and overhead over rounds 2 on (round 1 includes the islands' start)."""
    tasks: dict[int, list[float]] = {}
    for island_log in (run / "logs").glob("island-*.log"):
        for m in DONE.finditer(island_log.read_text()):
            tasks.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    rounds = {int(m.group(1)): float(m.group(2)) for line in log.read_text().splitlines()
              if (m := ROUND.search(line.strip()))}
    later = [r for r in sorted(rounds) if r > 1 and r in tasks]
    return {"task_seconds_median": statistics.median(s for r in later for s in tasks[r]),
            "round_seconds_median": statistics.median(rounds[r] for r in later),
            "overhead_seconds_median": round(statistics.median(rounds[r] - max(tasks[r]) for r in later), 2)}


def summary(run: Path) -> dict:
    traffic = json.loads((run / "train.json").read_text())["traffic"]["by_role"]["island"]
    counts = {f"{kind}_{direction}": traffic[direction].get(kind, {"bytes": 0, "requests": 0})
              for kind in ("inner_state", "module") for direction in ("up", "down")}
    perplexity = json.loads((run / "eval.json").read_text())["models"][0]["perplexity"]
    return {"run": str(run), "island_traffic": counts, "paths_moved": moves(run),
            **timing(run, run.parent / f"{run.name}.log"), "perplexity": perplexity}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="label=run directory (its log is <run>.log beside it)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", default="", help="what was run, on which code")
    args = parser.parse_args()
    rows = {label: summary(Path(path)) for label, path in (r.split("=", 1) for r in args.runs)}
    record = {"source": args.source, "reproduce": "see experiments/results/path-holds.md",
              "machine": {"platform": platform.platform(), "python": platform.python_version()}, "runs": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
