"""Bytes on the wire against quality: every `compression.codec` (and `outer.fragments`) side by side, the same seeds.

    python bench/bench_compression.py                        # every variant at seed 0, the chosen one at seeds 0 and 1
    python bench/bench_compression.py --only float32 int8 "topk 3% 2b EF" --seeds 0 --name compression-quick
    python bench/bench_compression.py --keep --collect-only  # the results from the runs already made

`configs/demo.yaml`'s recipe at the reduced model (`--set`, default width 64 and sequences of 128 tokens),
fp32, sync rounds. Per seed the warm start, routing and shards are made once; then every variant trains
from the same version 0 on the same shards with the same data order, so a variant differs only in what its
pseudo-gradients lose on the way, and every variant scores the same held-out tokens (prefix routing).

Per variant: routed perplexity, and the bytes every island measured at the store (train.json's `traffic`,
`dipaco.store.ledger`: counted where they cross, by kind) per applied result (path-round): pseudo-gradients
up, modules down, inner state, manifests, board and heartbeats. `ratio_training_traffic` = float32 DiLoCo's
2 x the path's float32 bytes per path-round (the same results' float32 pseudo-gradients up and modules down)
over the islands' pseudo-gradients up + modules (and module updates) down + manifests and checksums read;
`ratio_everything` over every byte the islands moved but the run's published inputs (shards, config);
`ratio_vs_data_parallel` = data parallel on the same islands (a ring all-reduce of a float32 gradient per
inner step, each way: train.json's `bytes_data_parallel`, both ways) over the same. One island per path.
The chosen setting (`--chosen`, default: the lowest perplexity among the variants with `ratio_training_traffic`
≥ `--min-ratio` at the first seed) and float32 train at every seed of `--seeds`; the others at the first
seed only. Writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import Runner, mode_perplexity, read_json  # noqa: E402
from bench.recording import distinct_code, markdown_table, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("bench_compression")
REDUCED = ["sharding.seq_len=128", "model.hidden_size=64"]


def topk(density: float, bits: int, feedback: bool) -> list[str]:
    return ["compression.codec=topk", f"compression.density={density}", f"compression.bits={bits}",
            f"compression.error_feedback={str(feedback).lower()}"]


VARIANTS: dict[str, list[str]] = {  # name -> overrides
    "float32": ["compression.codec=none"],
    "int8": ["compression.codec=int8"],
    "int4": ["compression.codec=int4"],
    **{f"topk {round(d * 100)}% {b}b {'EF' if ef else 'no EF'}": topk(d, b, ef)
       for d in (0.01, 0.03, 0.1) for b in (2, 4) for ef in (True, False)},
    "float32, 3 fragments": ["compression.codec=none", "outer.fragments=3"],
    "float32, 4 fragments": ["compression.codec=none", "outer.fragments=4"],
    "int8, 4 fragments": ["compression.codec=int8", "outer.fragments=4"],
    "int8, 3 fragments": ["compression.codec=int8", "outer.fragments=3"],
    "topk 10% 4b EF, 3 fragments": [*topk(0.1, 4, True), "outer.fragments=3"],
    "topk 10% 2b EF, 3 fragments": [*topk(0.1, 2, True), "outer.fragments=3"],
    # SparseLoCo: the error-feedback accumulator decays (beta) and takes the outer momentum's place
    **{f"topk {round(d * 100)}% 2b EF decay {beta:g}": [*topk(d, 2, True), f"compression.ef_decay={beta}"]
       for d in (0.01, 0.03) for beta in (0.9, 0.95)},
    "topk 3% 2b EF decay 0.95, outer lr 1": [*topk(0.03, 2, True), "compression.ef_decay=0.95", "outer.lr=1.0"],
    # Muon inside (MuLoCo): compare with "float32, Muon", the same inner optimizer
    "float32, Muon": ["compression.codec=none", "inner.optimizer=muon"],
    "topk 3% 2b EF, Muon": [*topk(0.03, 2, True), "inner.optimizer=muon"],
    "topk 3% 2b EF decay 0.95, Muon": [*topk(0.03, 2, True), "compression.ef_decay=0.95", "inner.optimizer=muon"],
    "topk 3% 2b EF decay 0.95, outer lr 1, Muon": [*topk(0.03, 2, True), "compression.ef_decay=0.95", "outer.lr=1.0",
                                                   "inner.optimizer=muon"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="the recipe")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"override for every variant (default {REDUCED})")
    parser.add_argument("--only", nargs="+", help=f"these variants only (of {list(VARIANTS)})".replace("%", "%%"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="run.seed; variants other than "
                        "float32 and the chosen one train at the first only")
    parser.add_argument("--chosen", nargs="*", default=None, help="the variants every seed trains (besides float32)")
    parser.add_argument("--min-ratio", type=float, default=100.0,
                        help="the chosen setting: the best perplexity among variants this many times fewer training bytes than float32 DiLoCo")
    parser.add_argument("--name", default="compression", help="the results files' name")
    parser.add_argument("--runs", default="", help="where the runs go (default runs/bench-<name>)")
    parser.add_argument("--keep", action="store_true", help="reuse the runs (and finished stages) of an earlier invocation")
    parser.add_argument("--collect-only", action="store_true", help="train nothing: the results of the runs in --runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    unknown = set(args.only or ()) | set(args.chosen or ())
    unknown -= set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; they are {list(VARIANTS)}")
    started = time.perf_counter()
    common = [*(REDUCED if args.set is None else args.set), "hardware.precision=fp32", "hardware.threads_per_island=1"]
    common.append(f"hardware.islands={paths_of(load_config(args.config, common))}")  # one island per path
    runner = Runner(Path(args.runs or ROOT / "runs" / f"bench-{args.name}"), keep=args.keep or args.collect_only)
    names = args.only or list(VARIANTS)
    if "float32" not in names:
        names = ["float32", *names]
    runs: dict[str, dict[int, Path]] = {}

    def train(name: str, seed: int) -> None:
        run = runner.root / f"seed{seed}-{slug(name)}"
        if not args.collect_only:
            overrides = [*common, f"run.seed={seed}", *VARIANTS[name]]
            load_config(args.config, overrides)  # a variant the config refuses stops here, before any training
            run = runner.pipeline(run.name, Path(args.config), overrides, baselines=False, modes=["prefix"])
        if (run / "eval.json").exists():
            runs.setdefault(name, {})[seed] = run
            log.info("%s seed %d: perplexity %.2f", name, seed, mode_perplexity(read_json(run / "eval.json"), "prefix"))
        else:
            log.warning("%s has no eval.json: left out", run)

    first, *others = args.seeds
    for name in names:
        train(name, first)
    chosen = args.chosen if args.chosen is not None else choose(runs, first=first, min_ratio=args.min_ratio)
    chosen_by = "--chosen" if args.chosen is not None else "min-ratio"
    for seed in others:
        for name in ["float32", *chosen]:
            train(name, seed)
    results = collect(runs, chosen=chosen, common=common, min_ratio=args.min_ratio,
                      seconds=time.perf_counter() - started)
    results["chosen_by"] = chosen_by
    path = write_results(args.name, results, markdown(results), trained_at=distinct_code(run for by_seed in runs.values() for run in by_seed.values()))
    print(path.with_suffix(".md").read_text())


def slug(name: str) -> str:
    return name.replace(",", "").replace(" ", "-").replace("%", "pc")


def paths_of(config) -> int:
    """The paths of a config's grid (levels' product, times the replicas)."""
    return math.prod(config.topology.levels) * config.topology.replicas


def choose(runs: dict[str, dict[int, Path]], *, first: int, min_ratio: float) -> list[str]:
    """The lowest-perplexity variant whose `ratio_training_traffic` is at least `min_ratio` at seed `first`
    ([] when none has)."""
    candidates = [(mode_perplexity(read_json(by_seed[first] / "eval.json"), "prefix"), name)
                  for name, by_seed in runs.items()
                  if first in by_seed and wire(by_seed[first])["ratio_training_traffic"] >= min_ratio]
    return [min(candidates)[1]] if candidates else []


TRAINING = (("up", "pseudo_gradient"), ("down", "module"), ("down", "module_update"), ("down", "manifests"))


def wire(run: Path) -> dict:
    """The bytes the islands of `run` measured at the store (train.json's `traffic`, by kind), per applied
    result (path-round), and the ratios against float32 DiLoCo and data parallel (module docstring)."""
    train = read_json(run / "train.json")
    islands = train["traffic"]["by_role"]["island"]
    results = train["results_applied"]

    def measured(direction: str, kind: str) -> int:
        return islands[direction].get(kind, {}).get("bytes", 0)

    training = sum(measured(d, k) for d, k in TRAINING)
    everything = sum(cell["bytes"] for d in ("up", "down") for k, cell in islands[d].items() if k != "inputs")
    float32 = 2 * train["bytes_float32"]  # up and down
    data_parallel = 2 * train["bytes_data_parallel"]  # each way, so both ways
    return {"per_result": {f"{d}_{k}": cell["bytes"] / results for d in ("up", "down") for k, cell in islands[d].items()},
            "training_traffic_per_result": training / results, "everything_per_result": everything / results,
            "float32_per_result": float32 / results, "results": results,
            "ratio_training_traffic": float32 / training, "ratio_everything": float32 / everything,
            "ratio_vs_data_parallel": data_parallel / everything if data_parallel else None,
            "data_parallel_workers": train["data_parallel_workers"], "rounds": train["rounds_completed"]}


def collect(runs: dict[str, dict[int, Path]], *, chosen: list[str], common: list[str], min_ratio: float,
            seconds: float) -> dict:
    rows = []
    for name, by_seed in runs.items():
        per_seed = {}
        for seed, run in sorted(by_seed.items()):
            evaluation = read_json(run / "eval.json")
            per_seed[seed] = {"perplexity": mode_perplexity(evaluation, "prefix"), "bytes": wire(run),
                              "scored_tokens": evaluation["scored_tokens"],
                              "run": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run)}
        rows.append({"variant": name, "overrides": VARIANTS[name], "per_seed": per_seed})
    seeds = sorted({s for r in rows for s in r["per_seed"]})
    both = [s for s in seeds if all(s in r["per_seed"] for r in rows if r["variant"] in ("float32", *chosen))]
    float32 = runs_float32(rows)
    for row in rows:
        b = next(iter(row["per_seed"].values()))["bytes"]
        row.update({k: b[k] for k in ("ratio_training_traffic", "ratio_everything", "ratio_vs_data_parallel")})
    for row in rows:
        common_seeds = [s for s in row["per_seed"] if s in float32]
        row["vs_float32_by_seed"] = {s: row["per_seed"][s]["perplexity"] / float32[s]["perplexity"] - 1 for s in common_seeds}
        mean = statistics.fmean(row["per_seed"][s]["perplexity"] for s in common_seeds)
        row["vs_float32_mean"] = mean / statistics.fmean(float32[s]["perplexity"] for s in common_seeds) - 1
        row["seeds"] = common_seeds
    return {"rows": rows, "chosen": chosen, "seeds_of_chosen": both, "min_ratio": min_ratio, "common": common,
            "seconds": seconds}


def runs_float32(rows: list[dict]) -> dict:
    return next(r["per_seed"] for r in rows if r["variant"] == "float32")


def markdown(results: dict) -> str:
    headers = ["variant", "seeds", "routed perplexity (mean)", "vs float32 (same seeds)",
               "pseudo-gradient up", "modules down", "inner state up / down", "manifests, board, heartbeats",
               "x training traffic", "x everything", "x vs data parallel"]
    table = []
    for r in results["rows"]:
        b = next(iter(r["per_seed"].values()))["bytes"]
        per = b["per_result"]
        small = sum(v for k, v in per.items() if k.split("_", 1)[1] in ("manifests", "board", "heartbeats"))
        ppl = statistics.fmean(r["per_seed"][s]["perplexity"] for s in r["seeds"])
        table.append([r["variant"], ",".join(map(str, r["seeds"])), f"{ppl:.2f}", f"{r['vs_float32_mean']:+.1%}",
                      f"{per.get('up_pseudo_gradient', 0):,.0f}", f"{per.get('down_module', 0):,.0f}",
                      f"{per.get('up_inner_state', 0):,.0f} / {per.get('down_inner_state', 0):,.0f}", f"{small:,.0f}",
                      f"{r['ratio_training_traffic']:.2f}", f"{r['ratio_everything']:.2f}",
                      f"{r['ratio_vs_data_parallel']:.1f}" if r["ratio_vs_data_parallel"] else "-"])
    first = results["rows"][0]
    tokens = next(iter(first["per_seed"].values()))["scored_tokens"]
    chosen = results["chosen"]
    per_seed = [f"- {r['variant']}: " + ", ".join(f"seed {s} {r['per_seed'][s]['perplexity']:.2f} "
                                                  f"({r['vs_float32_by_seed'][s]:+.1%})" for s in r["seeds"])
                for r in results["rows"] if r["variant"] in chosen]
    return (
        f"# Bytes on the wire against quality: pseudo-gradient codecs and fragments side by side\n\n"
        f"`configs/demo.yaml`'s recipe with {' '.join(results['common'])}; per seed every variant from the same "
        f"warm start, shards, version 0 and data order; routed perplexity (prefix) on {tokens:,} held-out tokens. "
        f"Bytes: measured by the islands at the store (train.json's `traffic`), per applied result (path-round). "
        f"x training traffic: float32 DiLoCo's 2 x the path's float32 bytes over pseudo-gradients up + modules down "
        f"+ manifests read; x everything: over every byte the islands moved but the published inputs; x vs data "
        f"parallel: a ring all-reduce of a float32 gradient per inner step among the same islands, both ways, over "
        f"everything. topk: per chunk of 4,096 the `density` largest, at `bits` bits; EF = error feedback; "
        f"fragments: `outer.fragments`.\n\n"
        + markdown_table(headers, table)
        + (f"\n\nChosen settings (`--chosen`), trained at every seed: {', '.join(chosen)}.\n"
           if results.get("chosen_by") == "--chosen" else
           f"\n\nChosen setting (lowest perplexity at ≥ {results['min_ratio']:g}x on training traffic, "
           f"trained at every seed): {', '.join(chosen) or 'none reaches that ratio'}.\n")
        + "\n".join(per_seed)
        + f"\n\nWall time: {results['seconds'] / 60:.0f} min.\n\n```\n" + format_table(headers, table) + "\n```\n"
    )


if __name__ == "__main__":
    main()
