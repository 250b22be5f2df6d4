"""Compare two runs' evaluations side by side (e.g. the demo before and after a refactor) and record it.

    python experiments/demo_compare.py BEFORE_RUN AFTER_RUN --name demo-layout-check \
        --before-label "25606d7" --after-label "f12451c" --command "make demo ARGS='hardware.precision=fp32'"

Reads `<run>/eval.json` of both runs and writes experiments/results/<name>.{json,md}: every model's
perplexity, every eval mode's, and whether the all-paths tables are equal, with the machine.
Needs two finished runs; `make experiments` does not run it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import EXPERIMENT_RESULTS, run_code, write_results  # noqa: E402


def rows(evaluation: dict) -> dict[str, float]:
    out = {r["model"]: r["perplexity"] for r in evaluation["models"]}
    out.update({f"mode {r['mode']} ({r['checkpoints']})": r["perplexity"] for r in evaluation.get("modes", {}).get("rows", [])})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")
    parser.add_argument("--command", default="make demo", help="how each run was made")
    args = parser.parse_args()
    before, after = (json.loads((run / "eval.json").read_text()) for run in (args.before, args.after))
    b, a = rows(before), rows(after)
    table = [{"row": k, "before": b[k], "after": a.get(k), "identical": b[k] == a.get(k)} for k in b]
    all_paths = before.get("modes", {}).get("all_paths") == after.get("modes", {}).get("all_paths")
    results = {"runs": {"before": args.before_label, "after": args.after_label, "command": args.command},
               "rows": table, "all_paths_identical": all_paths, "all_identical": all(r["identical"] for r in table) and all_paths}
    lines = [f"# {args.name}: `{args.command}` at {args.before_label} and at {args.after_label}", "",
             f"| row | {args.before_label} | {args.after_label} | identical |", "|---|---:|---:|---|"]
    lines += [f"| {r['row']} | {r['before']:.4f} | {r['after']:.4f} | {'yes' if r['identical'] else 'NO'} |" for r in table]
    lines += ["", f"All-paths table identical: {'yes' if all_paths else 'NO'}."]
    path = write_results(args.name, results, "\n".join(lines) + "\n", results_dir=EXPERIMENT_RESULTS,
                         trained_at=run_code(args.before) + run_code(args.after))
    print("\n".join(lines))
    print(f"\nwritten to {path}")
    return 0 if results["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
