"""How the outer step weights and normalises pseudo-gradients: `outer.normalize` module vs all,
`outer.weighting` shard vs tokens, with the paper's outer step and with plain averaging.

    python experiments/outer_weighting.py --parallel 3   # ~25 CPU-minutes (reduced demo budget)
    python experiments/outer_weighting.py --rounds 8 --inner-steps 25 --seq-len 256   # the demo's budget

Side by side in one run, on the bundled corpus with configs/demo.yaml (2x2 grid, flat k-means
routing, random initialisation) at a reduced budget: the corpus is routed and sharded once, then
every variant trains from the same module version 0 on the same shards and scores the same held-out
tokens (prefix routing, last round). Variants:
- the paper's outer step: Nesterov SGD lr 0.7, momentum 0.9, √(paths) rescale;
- plain averaging: lr 1, momentum 0, no rescale;
each with weighting shard / normalize module, shard / all, and tokens / module (today's default).
The table also gives each module's effective step scale Σα · s for this run's shard sizes (α the
weights after normalisation, s the √ rescale) — what `normalize` changes.

Writes experiments/results/outer-weighting.json and .md, with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import dipaco  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("experiments.outer_weighting")
PAPER = ["outer.lr=0.7", "outer.momentum=0.9", "outer.nesterov=true", "outer.rescale_by_paths=true"]
PLAIN = ["outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false"]
VARIANTS = [  # (name, outer step, weighting, normalize)
    ("paper, shard, module", PAPER, "shard", "module"),
    ("paper, shard, all", PAPER, "shard", "all"),
    ("paper, tokens, module", PAPER, "tokens", "module"),
    ("plain, shard, module", PLAIN, "shard", "module"),
    ("plain, shard, all", PLAIN, "shard", "all"),
    ("plain, tokens, module", PLAIN, "tokens", "module"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="outer rounds")
    parser.add_argument("--inner-steps", type=int, default=20, help="inner steps per round (H)")
    parser.add_argument("--seq-len", type=int, default=128, help="sharding.seq_len")
    parser.add_argument("--hidden", type=int, default=128, help="model.hidden_size")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "bench-outer-weighting"), help="where the runs go")
    parser.add_argument("--only", nargs="*", help="run only these variants (names as in the table)")
    parser.add_argument("--parallel", type=int, default=1, help="variants trained at once (each on hardware.islands)")
    parser.add_argument("--keep", action="store_true",
                        help="reuse the shards and evaluated variants of an earlier run with the same settings, "
                             "and resume its unfinished ones")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    runs = Path(args.runs)
    if not args.keep:
        shutil.rmtree(runs, ignore_errors=True)
    started = time.perf_counter()
    config = str(ROOT / "configs" / "demo.yaml")
    common = [f"run.rounds={args.rounds}", f"inner.steps={args.inner_steps}", f"sharding.seq_len={args.seq_len}",
              f"model.hidden_size={args.hidden}", "hardware.precision=fp32",
              "eval.baselines=false", "eval.modes=[]"]
    base = runs / "shards"
    if not (base / "shards" / "index.json").exists():
        dipaco("route", "--config", config, "--run", str(base), *common)
        dipaco("shard", "--config", config, "--run", str(base), *common)

    def variant(name: str, outer: list[str], weighting: str, normalize: str) -> dict:
        run = runs / name.replace(", ", "-")
        if not (args.keep and (run / "eval.json").exists()):
            if not (args.keep and (run / "store").exists()):  # with --keep a started variant resumes
                shutil.rmtree(run, ignore_errors=True)
                for part in ("tokenizer", "routing", "shards"):
                    shutil.copytree(base / part, run / part)
            overrides = [*common, *outer, f"outer.weighting={weighting}", f"outer.normalize={normalize}"]
            dipaco("train", "--config", config, "--run", str(run), *overrides)
            dipaco("eval", "--config", config, "--run", str(run), *overrides)
        row = collect(run, name=name, weighting=weighting, normalize=normalize)
        log.info("%s: perplexity %.2f", name, row["perplexity"])
        return row

    chosen = [v for v in VARIANTS if not args.only or v[0] in args.only]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # each variant is its own processes
        rows = list(pool.map(lambda v: variant(*v), chosen))
    results = {"rows": rows, "scales": module_scales(base), "rounds": args.rounds, "inner_steps": args.inner_steps,
               "seq_len": args.seq_len, "hidden_size": args.hidden, "seconds": time.perf_counter() - started}
    path = write_results("outer-weighting", results, markdown(results), results_dir=EXPERIMENT_RESULTS)
    print(path.with_suffix(".md").read_text())
    print(f"results in {path} and {path.with_suffix('.md')}")


def collect(run: Path, *, name: str, weighting: str, normalize: str) -> dict:
    evaluation = json.loads((run / "eval.json").read_text())
    train = json.loads((run / "train.json").read_text())
    routed = evaluation["models"][0]
    return {"variant": name, "weighting": weighting, "normalize": normalize, "perplexity": routed["perplexity"],
            "train_loss_last_round": mean(train["rounds"][-1]["train_loss"].values()), "scored_tokens": evaluation["scored_tokens"], "tokens_seen": routed["tokens_seen"],
            "train_seconds": train["seconds"]}


def module_scales(base: Path) -> dict:
    """Σα · s of each module for this run's shard sizes, a whole round of fresh results, per variant."""
    from dipaco.config import OuterConfig, load_config
    from dipaco.optim.weighting import result_weights
    from dipaco.pipeline.context import PathFactory
    from dipaco.run_dir import RunDir
    from dipaco.store.records import ManifestEntry

    factory = PathFactory(load_config(RunDir(base).config), RunDir(base))
    topology, sizes = factory.topology, factory.path_sizes
    out = {"shard_tokens": list(sizes.shard_tokens), "step_tokens": sizes.step_tokens, "modules": {}}
    for name in topology.modules:
        paths = topology.paths_of_module(name)
        entries = [ManifestEntry(key=f"p{p}", path=p, base=0, attempt=0, staleness=0, tokens=sizes.step_tokens,
                                 seconds=0.0, bytes=0, train_loss=0.0, val_loss_start=0.0, factor=1.0) for p in paths]
        scales = {}
        for normalize in ("module", "all"):
            for rescale in (True, False):
                weights, total = result_weights(entries, n_paths=topology.n_paths, sizes=sizes,
                                                config=OuterConfig(weighting="shard", normalize=normalize))
                scales[f"{normalize}, {'sqrt rescale' if rescale else 'no rescale'}"] = (
                    sum(weights) / total * (len(paths) ** 0.5 if rescale else 1.0))
        out["modules"][name] = {"paths": list(paths), **scales}
    return out


def markdown(results: dict) -> str:
    headers = ["variant", "weighting", "normalize", "routed perplexity", "train loss (last round)", "train s"]
    rows = [[r["variant"], r["weighting"], r["normalize"], f"{r['perplexity']:.2f}",
             f"{r['train_loss_last_round']:.3f}",
             f"{r['train_seconds']:.0f}"] for r in results["rows"]]
    scales = results["scales"]
    kinds = [k for k in next(iter(scales["modules"].values())) if k != "paths"]
    scale_rows = [[name, len(m["paths"]), *(f"{m[k]:.3f}" for k in kinds)] for name, m in scales["modules"].items()]
    tokens = results["rows"][0]["scored_tokens"] if results["rows"] else 0
    return (
        f"# Outer-step weighting and normalisation ({results['rounds']} rounds x {results['inner_steps']} inner steps, "
        f"seq {results['seq_len']}, width {results['hidden_size']}, fp32)\n\n"
        f"configs/demo.yaml (2x2, random init), every variant from the same shards and version 0; routed perplexity "
        f"on {tokens:,} held-out tokens (prefix routing, last round). paper = Nesterov lr 0.7 / momentum 0.9 with "
        f"the sqrt(paths) rescale; plain = lr 1, momentum 0, no rescale.\n\n"
        + markdown_table(headers, rows)
        + f"\n\nEffective step scale of each module (sum of its weights after normalisation x rescale), shard "
        f"weighting; training-shard tokens per path {scales['shard_tokens']}:\n\n"
        + markdown_table(["module", "paths", *kinds], scale_rows)
        + f"\n\nBenchmark wall time: {results['seconds']:.0f}s.\n\n```\n" + format_table(headers, rows) + "\n```\n"
    )


if __name__ == "__main__":
    main()
