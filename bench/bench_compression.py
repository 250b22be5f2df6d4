"""Bytes on the wire against quality: every `compression.codec` (and `outer.fragments`) side by side, the same seeds.

    python bench/bench_compression.py                        # every variant at seed 0, the chosen one at seeds 0 and 1
    python bench/bench_compression.py --only float32 int8 "topk 3% 2b EF" --seeds 0 --name compression-quick
    python bench/bench_compression.py --keep --collect-only  # the results from the runs already made

`configs/demo.yaml`'s recipe at the reduced model (`--set`, default width 64 and sequences of 128 tokens),
fp32, sync rounds. Per seed the warm start, routing and shards are made once; then every variant trains
from the same version 0 on the same shards with the same data order, so a variant differs only in what its
pseudo-gradients lose on the way, and every variant scores the same held-out tokens (prefix routing).

Per variant: routed perplexity, and the bytes of the pseudo-gradients applied, from the round manifests
(`store/rounds/round-*.json`): per path and round (what one island uploads for one task) the mean and the
peak, and per round over all paths the peak; against float32 DiLoCo (the same results as float32
tensors: every module of the path every round) and data parallel (a float32 gradient per inner step, as
`train.json`'s `bytes_data_parallel`). The chosen setting (`--chosen`, default: the lowest perplexity
among the variants ≥ `--min-ratio` times fewer bytes than float32 at the first seed) and float32 train at
every seed of `--seeds`; the others at the first seed only. Writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import Runner, mode_perplexity, read_json  # noqa: E402
from bench.recording import distinct_code, markdown_table, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.store.board import read_manifest  # noqa: E402
from dipaco.store.module_store import ModuleStore  # noqa: E402
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
    parser.add_argument("--only", nargs="+", help=f"these variants only (of {list(VARIANTS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="run.seed; variants other than "
                        "float32 and the chosen one train at the first only")
    parser.add_argument("--chosen", nargs="*", default=None, help="the variants every seed trains (besides float32)")
    parser.add_argument("--min-ratio", type=float, default=100.0,
                        help="the chosen setting: the best perplexity among variants this many times fewer bytes than float32")
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
    common = [*(REDUCED if args.set is None else args.set), "hardware.precision=fp32", "hardware.islands=1",
              "hardware.threads_per_island=1"]
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


def choose(runs: dict[str, dict[int, Path]], *, first: int, min_ratio: float) -> list[str]:
    """The lowest-perplexity variant with at least `min_ratio` times fewer bytes than float32 at seed `first`
    ([] when none has)."""
    float32 = wire(runs["float32"][first])["bytes_applied"]
    candidates = [(mode_perplexity(read_json(by_seed[first] / "eval.json"), "prefix"), name)
                  for name, by_seed in runs.items()
                  if first in by_seed and float32 / wire(by_seed[first])["bytes_applied"] >= min_ratio]
    return [min(candidates)[1]] if candidates else []


def wire(run: Path) -> dict:
    """The bytes of the pseudo-gradients applied in `run`, from its round manifests: per path and round
    (one island's upload for one task) and per round; and the inner state (AdamW moments, error-feedback
    residual) each task uploads besides, so that another island can take the path on (mean over the
    results the store still holds)."""
    store = ModuleStore(str(run / "store"))
    manifests = [read_manifest(store, r) for r in range(1, store.current_round() + 1)]
    applied = [m.applied for m in manifests if m is not None]
    tasks = [entry.bytes for entries in applied for entry in entries]
    per_round = [sum(entry.bytes for entry in entries) for entries in applied]
    train = read_json(run / "train.json")
    inner = [read_json(f).get("bytes_up_inner", 0) for f in (run / "store" / "results").glob("round-*/path-*.json")]
    return {"inner_state_task_mean": statistics.fmean(inner) if inner else None, "bytes_applied": sum(tasks),
            "task_mean": statistics.fmean(tasks), "task_peak": max(tasks),
            "round_peak": max(per_round), "round_mean": statistics.fmean(per_round),
            "round_peak_before_last": max(per_round[:-1] or per_round),
            "float32_task_mean": statistics.fmean(e.float32_bytes for entries in applied for e in entries),
            "bytes_float32": train["bytes_float32"], "bytes_data_parallel": train["bytes_data_parallel"],
            "rounds": len(per_round), "tasks": len(tasks)}


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
    reference = next(iter(float32.values()))["bytes"]
    for row in rows:
        b = next(iter(row["per_seed"].values()))["bytes"]
        row["times_fewer_than_float32"] = b["bytes_float32"] / b["bytes_applied"]
        row["times_fewer_than_data_parallel"] = b["bytes_data_parallel"] / b["bytes_applied"]
        row["peak_round_share"] = b["round_peak"] / reference["round_peak"]
        row["peak_round_share_before_last"] = b["round_peak_before_last"] / reference["round_peak_before_last"]
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
    headers = ["variant", "seeds", "routed perplexity (mean)", "vs float32 (same seeds)", "bytes per path and round (mean / peak)",
               "x fewer than float32 DiLoCo", "x fewer than data parallel", "inner state per task", "peak round / float32's (last round excluded)"]
    table = []
    for r in results["rows"]:
        b = next(iter(r["per_seed"].values()))["bytes"]
        ppl = statistics.fmean(r["per_seed"][s]["perplexity"] for s in r["seeds"])
        table.append([r["variant"], ",".join(map(str, r["seeds"])), f"{ppl:.2f}", f"{r['vs_float32_mean']:+.1%}",
                      f"{b['task_mean']:,.0f} / {b['task_peak']:,}", f"{r['times_fewer_than_float32']:.1f}",
                      f"{r['times_fewer_than_data_parallel']:,.0f}",
                      f"{b['inner_state_task_mean']:,.0f}" if b["inner_state_task_mean"] is not None else "-",
                      f"{r['peak_round_share']:.2f} ({r['peak_round_share_before_last']:.2f})"])
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
        f"Bytes: the pseudo-gradients applied (round manifests); float32 DiLoCo = every module of the path as "
        f"float32 every round; data parallel = a float32 gradient per inner step. topk: per chunk of 4,096 the "
        f"`density` largest, at `bits` bits; EF = error feedback; fragments: `outer.fragments`. Besides its "
        f"pseudo-gradient each task uploads its path's inner state (AdamW moments, residual) to the store, so that "
        f"any island can take the path on; that is a separate column, not counted in the ratios.\n\n"
        + markdown_table(headers, table)
        + (f"\n\nChosen settings (`--chosen`), trained at every seed: {', '.join(chosen)}.\n"
           if results.get("chosen_by") == "--chosen" else
           f"\n\nChosen setting (lowest perplexity at ≥ {results['min_ratio']:g}x fewer bytes than float32, "
           f"trained at every seed): {', '.join(chosen) or 'none reaches that ratio'}.\n")
        + "\n".join(per_seed)
        + f"\n\nWall time: {results['seconds'] / 60:.0f} min.\n\n```\n" + format_table(headers, table) + "\n```\n"
    )


if __name__ == "__main__":
    main()
