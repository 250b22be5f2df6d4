"""The paper's Table 1 / Table 3 at our scale: routed DiPaCo paths against dense models and DiLoCo.

    python bench/bench_paths.py                  # ~8-12 min on 2 idle CPU cores (reduced budget)
    python bench/bench_paths.py --rounds 8       # the demo's full 8 rounds (about twice as long)

On the bundled corpus, side by side in one run, with the demo architecture (1.3M-parameter paths):
- DiPaCo 2x2 (4 paths; configs/demo.yaml) evaluated with prefix routing, early stopping (each path
  at its best round by validation loss), re-routing every 64 tokens, and the oracle path;
- dense path-size models trained on all data for as many steps as one path (equal steps) and as
  all paths together (equal compute);
- dense-large: about 8x a path's parameters (width 256, 12 blocks), as many steps as one path;
- DiLoCo: one path trained by 4 replica islands on random quarters of the data (configs/diloco.yaml),
  the same compute as DiPaCo, twice: with DiLoCo's own outer step (Nesterov lr 0.7, momentum 0.9, no
  rescale: the config's) and with the outer step DiPaCo uses here.
Every model scores the same held-out tokens (after the 32-token routing prefix). DiPaCo's outer step:
plain averaging (outer.lr=1, momentum=0, no sqrt rescale), the setting measured to work at this scale.

Reduced budget (default): `--rounds 4` x 25 inner steps of batch 8 x 256 tokens per path (the demo
runs 8). Compute is reported as training tokens and FLOPs ≈ 6 x (parameters a token passes through)
x tokens. Writes bench/results/paths.json and bench/results/paths.md, with the machine they were
measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import write_results  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("bench_paths")
OUTER = ["outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false"]
DILOCO_OUTER = {  # the DiLoCo rows: its own outer step (configs/diloco.yaml), and DiPaCo's in this comparison
    "own-outer": [],
    "dipaco-outer": OUTER,
}
DILOCO_LABELS = {"own-outer": "DiLoCo, 4 replicas, DiLoCo's outer step (Nesterov 0.7/0.9, no rescale)",
                 "dipaco-outer": "DiLoCo, 4 replicas, DiPaCo's outer step here (plain averaging)"}


def dipaco(*args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log.info("$ dipaco %s", " ".join(args))
    subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="outer rounds (25 inner steps each)")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "bench-paths"), help="where the runs go")
    parser.add_argument("--keep", action="store_true", help="reuse finished stages of an earlier bench run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    runs = Path(args.runs)
    if runs.exists() and not args.keep:
        shutil.rmtree(runs)
    started = time.perf_counter()
    common = [f"train.rounds={args.rounds}", *OUTER]
    dipaco_run = runs / "dipaco-2x2"
    dipaco("run", "--config", str(ROOT / "configs" / "demo.yaml"), "--run", str(dipaco_run), *common,
           "eval.best=true", "eval.modes=[prefix,every:64,oracle,all-paths]",
           "eval.large_hidden_size=256", "eval.large_n_layers=12")
    diloco_runs = {}
    for variant, outer in DILOCO_OUTER.items():
        diloco_run = diloco_runs[variant] = runs / f"diloco-4-{variant}"
        if not (diloco_run / "tokenizer").exists():  # the same tokenizer, so the test tokens are the same
            shutil.copytree(dipaco_run / "tokenizer", diloco_run / "tokenizer")
        dipaco("run", "--config", str(ROOT / "configs" / "diloco.yaml"), "--run", str(diloco_run),
               f"train.rounds={args.rounds}", *outer, "eval.baselines=false", "eval.modes=[prefix]")
    results = collect(dipaco_run, diloco_runs)
    results.update(rounds=args.rounds, inner_steps=25, seconds=time.perf_counter() - started)
    path = write_results("paths", results, markdown(results))
    print(path.with_suffix(".md").read_text())
    print(f"results in {path} and {path.with_suffix('.md')}")


def collect(dipaco_run: Path, diloco_runs: dict[str, Path]) -> dict:
    ours = json.loads((dipaco_run / "eval.json").read_text())
    dilocos = {variant: json.loads((run / "eval.json").read_text()) for variant, run in diloco_runs.items()}
    for diloco in dilocos.values():
        if ours["scored_tokens"] != diloco["scored_tokens"]:
            raise RuntimeError(f"DiPaCo scored {ours['scored_tokens']} tokens but DiLoCo {diloco['scored_tokens']}")
    train = json.loads((dipaco_run / "train.json").read_text())
    best = json.loads((dipaco_run / "store" / "best.json").read_text())
    models = {m["model"]: m for m in ours["models"]}
    routed = next(m for m in ours["models"] if m["model"].startswith("DiPaCo"))
    rows = []

    def add(name: str, *, params: int, params_total: int, steps: int, tokens: int, ppl: float, note: str = ""):
        rows.append({"model": name, "params": params, "params_total": params_total, "steps_per_model": steps,
                     "train_tokens": tokens, "flops": 6 * params * tokens, "perplexity": ppl, "note": note})

    for name, label in (("dense-equal-steps", "dense path-size, equal steps"),
                        ("dense-equal-compute", "dense path-size, equal compute"),
                        ("dense-large", "dense large (~8x a path), equal steps")):
        m = models[name]
        add(label, params=m["params_per_path"], params_total=m["params_total"], steps=m["steps_per_path"],
            tokens=m["tokens_seen"], ppl=m["perplexity"])
    for variant, diloco in dilocos.items():
        d = diloco["models"][0]
        add(DILOCO_LABELS[variant], params=d["params_per_path"], params_total=d["params_total"],
            steps=d["steps_per_path"], tokens=d["tokens_seen"], ppl=d["perplexity"], note="4 x steps, averaged")
    labels = {("prefix", "last"): "DiPaCo 2x2, prefix routing", ("prefix", "best"): "DiPaCo 2x2, prefix + early stopping",
              ("every:64", "last"): "DiPaCo 2x2, re-route every 64", ("every:64", "best"): "DiPaCo 2x2, every 64 + early stopping",
              ("oracle", "last"): "DiPaCo 2x2, oracle path", ("oracle", "best"): "DiPaCo 2x2, oracle + early stopping"}
    for r in ours["modes"]["rows"]:
        add(labels[r["mode"], r["checkpoints"]], params=routed["params_per_path"], params_total=routed["params_total"],
            steps=routed["steps_per_path"], tokens=routed["tokens_seen"], ppl=r["perplexity"],
            note="4 paths x steps")
    return {
        "rows": rows,
        "scored_tokens": ours["scored_tokens"],
        "test_documents": ours["test_documents"],
        "best_rounds": ours["modes"]["best_rounds"],
        "best_kept_bytes": best.get("kept_bytes"),
        "all_paths": ours["modes"]["all_paths"],
        "dipaco_train_seconds": train.get("seconds"),
    }


def markdown(results: dict) -> str:
    headers = ["model", "params (per path)", "params (total)", "steps", "train tokens", "FLOPs (6ND)", "perplexity"]
    rows = [[r["model"], f"{r['params']:,}", f"{r['params_total']:,}",
             f"{r['steps_per_model']}" + (f" ({r['note']})" if r["note"] else ""), f"{r['train_tokens']:,}",
             f"{r['flops']:.2e}", f"{r['perplexity']:.2f}"] for r in results["rows"]]
    by_name = {r["model"]: r["perplexity"] for r in results["rows"]}
    large = by_name["dense large (~8x a path), equal steps"]
    ours = by_name["DiPaCo 2x2, every 64 + early stopping"]
    return (
        f"# Routed paths against dense models and DiLoCo ({results['rounds']} rounds x {results['inner_steps']} inner "
        f"steps per path)\n\n"
        f"{results['test_documents']} held-out documents, {results['scored_tokens']:,} tokens scored after the "
        f"routing prefix; every model scores the same tokens.\n\n"
        + "| " + " | ".join(headers) + " |\n|" + "---|" * len(headers) + "\n"
        + "\n".join("| " + " | ".join(map(str, row)) + " |" for row in rows)
        + f"\n\nDiPaCo with re-routing every 64 tokens and early stopping: {ours:.2f} against the dense model "
        f"~8x a path's size: {large:.2f} ({'matches or beats it' if ours <= large else 'does not match it'}).\n"
        f"Best round per path: {results['best_rounds']}; module versions kept only as some path's best: "
        f"{(results['best_kept_bytes'] or 0) / 1e6:.2f} MB.\nBenchmark wall time: {results['seconds']:.0f}s.\n\n```\n"
        + format_table(["(text table)"] + headers[1:], [[r[0], *r[1:]] for r in rows]) + "\n```\n"
    )


if __name__ == "__main__":
    main()
