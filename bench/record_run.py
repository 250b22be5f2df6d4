"""Record one finished run's evaluation (e.g. `make demo`) as a results file, with its wall time.

    /usr/bin/time -f %e make demo            # note the seconds
    python bench/record_run.py runs/demo --name demo --command "make demo" --wall-seconds 912

Reads `<run>/eval.json` and writes bench/results/<name>.{json,md} (or `--results-dir`'s): every model's
row (warm start, steps, training tokens, perplexity), every eval mode, the checks the quality issue names
(DiPaCo ÷ dense equal compute, DiPaCo against dense equal steps, routed ÷ oracle), the outer step each
span of rounds took (train.json's rows), the wall time, the machine and the code that trained the run.
Not a `bench_*.py` script: `make bench` does not run it (it needs a finished run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import outer_steps  # noqa: E402
from bench.recording import RESULTS, run_code, write_results  # noqa: E402


def checks(evaluation: dict) -> dict[str, float]:
    """The quality figures derived from the models and modes (absent rows give no figure)."""
    models = {m["model"].split(" routed")[0] if m["model"].startswith("DiPaCo") else m["model"]: m["perplexity"]
              for m in evaluation["models"]}
    modes = {r["mode"]: r["perplexity"] for r in evaluation.get("modes", {}).get("rows", []) if r["checkpoints"] == "last"}
    dipaco = next((v for k, v in models.items() if k.startswith("DiPaCo")), None)
    out = {}
    if dipaco is not None and "dense-equal-compute" in models:
        out["dipaco_over_dense_equal_compute"] = dipaco / models["dense-equal-compute"]
    if dipaco is not None and "dense-equal-steps" in models:
        out["dipaco_vs_dense_equal_steps"] = dipaco / models["dense-equal-steps"] - 1
    if "prefix" in modes and "oracle" in modes:
        out["routed_over_oracle"] = modes["prefix"] / modes["oracle"] - 1
    if "likelihood" in modes and "oracle" in modes:
        out["likelihood_over_oracle"] = modes["likelihood"] / modes["oracle"] - 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--results-dir", default=str(RESULTS),
                        help="where the results files go (default bench/results; experiments/results for a research run)")
    parser.add_argument("--command", default="make demo", help="how the run was made")
    parser.add_argument("--wall-seconds", type=float, default=None, help="the whole command's wall time")
    parser.add_argument("--note", default="", help="a line on the conditions (load, precision)")
    args = parser.parse_args()
    evaluation = json.loads((args.run / "eval.json").read_text())
    figures = checks(evaluation)
    results = {"command": args.command, "wall_seconds": args.wall_seconds, "note": args.note,
               "models": evaluation["models"], "modes": evaluation.get("modes", {}).get("rows", []), "checks": figures,
               "outer_steps": outer_steps(args.run)}
    lines = [f"# `{args.command}`: the run's evaluation", ""]
    if args.note:
        lines += [args.note, ""]
    if args.wall_seconds is not None:
        lines += [f"Wall time of the whole command: {args.wall_seconds / 60:.1f} min ({args.wall_seconds:.0f} s).", ""]
    lines += [f"{evaluation['test_documents']} held-out documents, {evaluation['scored_tokens']:,} tokens scored "
              f"after a {evaluation['prefix_tokens']}-token routing prefix. Outer steps as applied (train.json's "
              f"rows): {results['outer_steps']}.", "",
              "| model | params/path | params total | warm start | steps/path | steps in all | train tokens (all) | train s | perplexity |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in evaluation["models"]:
        lines.append(f"| {m['model']} | {m['params_per_path']:,} | {m['params_total']:,} | {m.get('pretrain_steps', 0)} | "
                     f"{m['steps_per_path']} | {m.get('steps_total', m['steps_per_path'])} | "
                     f"{m.get('train_tokens_total', m.get('tokens_seen', 0)):,} | {m['train_seconds']:.0f} | {m['perplexity']:.2f} |")
    lines += ["", "| eval mode | checkpoints | perplexity |", "|---|---|---:|"]
    lines += [f"| {r['mode']} | {r['checkpoints']} | {r['perplexity']:.3f} |" for r in results["modes"]]
    lines += [""]
    names = {"dipaco_over_dense_equal_compute": "DiPaCo ÷ dense equal compute",
             "dipaco_vs_dense_equal_steps": "DiPaCo against dense equal steps (perplexity, relative)",
             "routed_over_oracle": "routed ÷ oracle − 1",
             "likelihood_over_oracle": "routed by the paths' likelihood of the prefix ÷ oracle − 1"}
    lines += [f"- {names[k]}: {v:.3f}" if k == "dipaco_over_dense_equal_compute" else f"- {names[k]}: {v:+.1%}"
              for k, v in figures.items()]
    path = write_results(args.name, results, "\n".join(lines) + "\n", results_dir=Path(args.results_dir),
                         trained_at=run_code(args.run))
    print("\n".join(lines))
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
