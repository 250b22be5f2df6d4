"""Quality and bytes of sparse pseudo-gradients: `compression.codec` none vs topk, with and without error feedback.

    python experiments/sparse_codec.py                     # the reduced demo, one island (~15 CPU-minutes)
    python experiments/sparse_codec.py --rounds 10 --inner-steps 10 --only none "topk 3% 2b EF"
    python experiments/sparse_codec.py --rounds 20 --only none "topk 3% 2b EF" "topk 3% 2b no EF" --name sparse-codec-r20

configs/demo.yaml (its recipe: a dense warm start, routing on its features, 2x2 grid; with its 50% warm start
every DiPaCo round trains in the inner lr's decay, so every outer step is a plain average) at the reduced model
of experiments/recipe_search.py (width 64, sequences of 128), fp32, sync rounds: the warm start, routing
and shards are made once, then every variant trains from the same version 0 on the same shards (same seed,
so a variant differs only in what its pseudo-gradients lose on the way) and scores the same held-out
tokens (prefix routing, last round). Reported per variant: routed perplexity, the bytes of the
pseudo-gradients applied (train.json's `bytes_up`), and how many times more float32 DiLoCo and data
parallel would have sent for the same training (train.json's `bytes_float32`, `bytes_data_parallel`: the
same results in float32, a float32 gradient per inner step).

Writes experiments/results/sparse-codec.json and .md, with the machine, command and commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import dipaco  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("experiments.sparse_codec")
REDUCED = ["sharding.seq_len=128", "model.hidden_size=64"]  # experiments/recipe_search.py's reduced model
TOPK = ["compression.codec=topk", "compression.chunk=4096"]
VARIANTS = {  # name -> overrides
    "none": ["compression.codec=none"],
    "int8": ["compression.codec=int8"],
    "topk 3% 2b EF": [*TOPK, "compression.density=0.03", "compression.bits=2", "compression.error_feedback=true"],
    "topk 3% 2b no EF": [*TOPK, "compression.density=0.03", "compression.bits=2", "compression.error_feedback=false"],
    "topk 3% 8b EF": [*TOPK, "compression.density=0.03", "compression.bits=8", "compression.error_feedback=true"],
    "topk 1% 2b EF": [*TOPK, "compression.density=0.01", "compression.bits=2", "compression.error_feedback=true"],
    "topk 10% 2b EF": [*TOPK, "compression.density=0.1", "compression.bits=2", "compression.error_feedback=true"],
    "topk 10% 4b EF": [*TOPK, "compression.density=0.1", "compression.bits=4", "compression.error_feedback=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="outer rounds (the demo's)")
    parser.add_argument("--inner-steps", type=int, default=10, help="inner steps per round, H (the demo's)")
    parser.add_argument("--runs", help="where the runs go (default runs/exp-<name>)")
    parser.add_argument("--only", nargs="*", help=f"run only these variants (of {list(VARIANTS)})")
    parser.add_argument("--name", default="sparse-codec", help="the results file's name")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    runs = Path(args.runs or ROOT / "runs" / f"exp-{args.name}")
    shutil.rmtree(runs, ignore_errors=True)
    started = time.perf_counter()
    config = str(ROOT / "configs" / "demo.yaml")
    common = [*REDUCED, f"run.rounds={args.rounds}", f"inner.steps={args.inner_steps}", "hardware.precision=fp32",
              "hardware.islands=1", "hardware.threads_per_island=1", "eval.baselines=false", "eval.modes=[prefix]"]
    base = runs / "base"
    options = ["--config", config, "--run", str(base), *common]
    dipaco("pretrain", *options)
    dipaco("route", *options)
    dipaco("shard", *options)
    rows = []
    unknown = set(args.only or ()) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; they are {list(VARIANTS)}")
    for name in args.only or VARIANTS:
        overrides = VARIANTS[name]
        run = runs / name.replace(" ", "-").replace("%", "pc")
        for part in ("tokenizer", "pretrain", "routing", "shards"):
            if (base / part).exists():
                shutil.copytree(base / part, run / part)
        variant = ["--config", config, "--run", str(run), *common, *overrides]
        dipaco("train", *variant)
        dipaco("eval", *variant)
        rows.append(collect(run, name=name, overrides=overrides))
        log.info("%s: perplexity %.2f, %d bytes up", name, rows[-1]["perplexity"], rows[-1]["bytes_up"])
    results = {"rows": rows, "rounds": args.rounds, "inner_steps": args.inner_steps, "common": common,
               "seconds": time.perf_counter() - started}
    path = write_results(args.name, results, markdown(results), results_dir=EXPERIMENT_RESULTS)
    print(path.with_suffix(".md").read_text())


def collect(run: Path, *, name: str, overrides: list[str]) -> dict:
    evaluation = json.loads((run / "eval.json").read_text())
    train = json.loads((run / "train.json").read_text())
    routed = next(m for m in evaluation["models"] if m["model"].startswith("DiPaCo"))
    sent = train["bytes_up"]
    return {"variant": name, "overrides": overrides, "perplexity": routed["perplexity"], "bytes_up": sent,
            "bytes_float32": train["bytes_float32"], "bytes_data_parallel": train["bytes_data_parallel"],
            "times_fewer_than_float32": train["bytes_float32"] / sent, "times_fewer_than_data_parallel":
            train["bytes_data_parallel"] / sent, "scored_tokens": evaluation["scored_tokens"],
            "train_seconds": train["seconds"]}


def markdown(results: dict) -> str:
    headers = ["variant", "routed perplexity", "vs none", "pseudo-gradient bytes applied", "x fewer than float32 DiLoCo",
               "x fewer than data parallel"]
    dense = next((r["perplexity"] for r in results["rows"] if r["variant"] == "none"), None)
    rows = [[r["variant"], f"{r['perplexity']:.2f}", f"{100 * (r['perplexity'] / dense - 1):+.1f}%" if dense else "-",
             f"{r['bytes_up']:,}", f"{r['times_fewer_than_float32']:.1f}", f"{r['times_fewer_than_data_parallel']:.0f}"]
            for r in results["rows"]]
    tokens = results["rows"][0]["scored_tokens"] if results["rows"] else 0
    return (
        f"# Sparse pseudo-gradients: codec none vs topk, with and without error feedback "
        f"({results['rounds']} rounds x {results['inner_steps']} inner steps, width 64, seq 128, fp32)\n\n"
        f"configs/demo.yaml's recipe at the reduced model, every variant from the same warm start, shards and "
        f"version 0 (same seed, sync rounds); routed perplexity on {tokens:,} held-out tokens (prefix routing, "
        f"last round). topk: chunks of 4096, density and bits as named; EF = compression.error_feedback. With the "
        f"recipe's 50% warm start every DiPaCo round trains in the inner lr's decay, so every outer step is a plain "
        f"average (outer.decay: average).\n\n"
        + markdown_table(headers, rows)
        + f"\n\nWall time: {results['seconds']:.0f}s.\n\n```\n" + format_table(headers, rows) + "\n```\n"
    )


if __name__ == "__main__":
    main()
