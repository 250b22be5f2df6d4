"""Every byte on the wire against quality: `compression.codec`s (SparseLoCo's recipe among them), `outer.fragments`,
AdamW or Muon inside and `outer.decay` average or keep, side by side on the same seeds, one island per path.

    python bench/bench_compression.py --rounds 100 --only "float32" "topk 1% 2b EF decay 0.95"   # bench/results/wire.*
    python bench/bench_compression.py --chosen "topk 1% 2b EF decay 0.95" --seeds 0 1 --keep      # every seed, resumed
    python bench/bench_compression.py --keep --collect-only  # the results from the runs already made

`configs/demo.yaml`'s recipe at the reduced model (`--set`, default width 64 and sequences of 128 tokens),
fp32, sync rounds, `hardware.islands` = the grid's paths (each island downloads what its path needs). Per
seed the warm start, routing and shards are made once; then every variant trains from the same version 0 on
the same shards with the same data order, so a variant differs only in what crosses the wire and how the
inner and outer steps use it; every variant scores the same held-out tokens (prefix routing).

Per variant (bench/wire_rows.py): `inner_optimizer`, `outer_decay`, the inner-state checkpoint interval K
(`--inner-checkpoint-every`), `rounds`, `seeds`, routed perplexity and `perplexity_vs_float32_pct` against
float32 DiLoCo with the same inner optimizer and outer decay (mean over the seeds both have, and each seed),
and the bytes the islands measured at the store (train.json's `traffic`, `dipaco.store.ledger`) per applied
result (path-round) by direction and kind, `module_fallbacks` (train.json). `ratio_training_traffic` = float32
DiLoCo's 2 x the path's float32 bytes over pseudo-gradients up + module updates down + manifests and checksums
read (full module reads, an island's joining read and its fallbacks, are not training traffic);
`ratio_everything` over every byte the islands moved but the published inputs (shards, config);
`ratio_vs_data_parallel` = a ring all-reduce of a float32 gradient per inner step among the same islands,
both ways, over everything. The chosen setting (`--chosen`, default: the lowest perplexity among the
variants at `ratio_training_traffic` >= `--min-ratio` at the first seed) and its float32 baseline train at
every seed of `--seeds`; the others at the first only. bench/wire_report.py judges the chosen setting
against the issue's bars (>= 100x training traffic, <= +1.0% mean and <= +2% each seed, >= 100 rounds, >= 50x
everything) and float32 DiLoCo's training traffic against 1.05 x 2 x its float32 bytes. Writes
bench/results/<name>.{json,md} (default wire).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import Runner, mode_perplexity, read_json  # noqa: E402
from bench.recording import distinct_code, write_results  # noqa: E402
from bench.wire_report import float32_check, markdown, verdict  # noqa: E402
from bench.wire_rows import BASELINES, baseline_of, choose, collect, row_of  # noqa: E402
from dipaco.config import load_config  # noqa: E402

log = logging.getLogger("bench_compression")
REDUCED = ["sharding.seq_len=128", "model.hidden_size=64"]


def topk(density: float, bits: int, feedback: bool) -> list[str]:
    return ["compression.codec=topk", f"compression.density={density}", f"compression.bits={bits}",
            f"compression.error_feedback={str(feedback).lower()}"]


def sparseloco(density: float, beta: float, *, muon: bool, keep: bool) -> tuple[str, list[str]]:
    """SparseLoCo's recipe (2 bits, error feedback decaying by beta, no outer momentum) at `density`, with Muon
    inside (MuLoCo) or AdamW, under `outer.decay` keep or average."""
    name = f"topk {round(density * 100)}% 2b EF decay {beta:g}" + (", Muon" if muon else "") + (", decay keep" if keep else "")
    return name, [*topk(density, 2, True), f"compression.ef_decay={beta}", *(["inner.optimizer=muon"] if muon else []),
                  *(["outer.decay=keep"] if keep else [])]


def kept_local(density: float, bits: int, *, muon: bool = False, keep: bool = False,
               results: bool = False) -> tuple[str, list[str]]:
    """Top-k with error feedback on the shared modules only: the private modules stay on their island
    (`outer.private_modules: local`) and the path's last task sends everything it holds at int8
    (`compression.last_task: int8`); with Muon inside or `outer.decay: keep`; `results`: the islands download
    the other islands' encoded results (`compression.download: results`), not a re-encoded update."""
    name = (f"topk {density * 100:g}% {bits}b EF, private local, last int8" + (", Muon" if muon else "")
            + (", decay keep" if keep else "") + (", download results" if results else ""))
    return name, [*topk(density, bits, True), "outer.private_modules=local", "compression.last_task=int8",
                  *(["inner.optimizer=muon"] if muon else []), *(["outer.decay=keep"] if keep else []),
                  *(["compression.download=results"] if results else [])]


VARIANTS: dict[str, list[str]] = {  # name -> overrides
    # float32 DiLoCo, the baseline of every row with the same inner optimizer and outer decay (wire_rows.BASELINES)
    "float32": ["compression.codec=none"],
    "float32, Muon": ["compression.codec=none", "inner.optimizer=muon"],
    "float32, decay keep": ["compression.codec=none", "outer.decay=keep"],
    "float32, Muon, decay keep": ["compression.codec=none", "inner.optimizer=muon", "outer.decay=keep"],
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
    # SparseLoCo: the error-feedback accumulator decays (beta) and takes the outer momentum's place; with Muon
    # inside (MuLoCo) and with the outer momentum kept in the decay (outer.decay keep), so that it replaces one
    **dict(sparseloco(d, beta, muon=muon, keep=keep)
           for d in (0.01, 0.02, 0.03) for beta in (0.9, 0.95) for muon in (False, True) for keep in (False, True)),
    # the shared modules compressed, the private ones kept on their island (docs/islands.md)
    **dict(kept_local(d, 2) for d in (0.03, 0.05, 0.1)),
    **dict([kept_local(0.05, 2, muon=True)]),  # (with outer.decay keep the config refuses private modules local)
    **dict(kept_local(d, 2, results=True) for d in (0.04, 0.05, 0.06)),
    "float32, private local": ["compression.codec=none", "outer.private_modules=local"],
    "topk 3% 2b EF decay 0.95, outer lr 1": [*topk(0.03, 2, True), "compression.ef_decay=0.95", "outer.lr=1.0"],
    "topk 3% 2b EF, Muon": [*topk(0.03, 2, True), "inner.optimizer=muon"],
    "topk 3% 2b EF decay 0.95, outer lr 1, Muon": [*topk(0.03, 2, True), "compression.ef_decay=0.95", "outer.lr=1.0",
                                                   "inner.optimizer=muon"],
}

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="the recipe")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"override for every variant (default {REDUCED})")
    parser.add_argument("--rounds", type=int, default=None, help="run.rounds (default: the recipe's)")
    parser.add_argument("--inner-checkpoint-every", type=int, default=None, metavar="K",
                        help="resilience.inner_checkpoint_every for every variant (default: the recipe's)")
    parser.add_argument("--only", nargs="+", help=f"these variants only (of {list(VARIANTS)})".replace("%", "%%"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="run.seed; variants other than "
                        "the chosen ones and their float32 baselines train at the first only")
    parser.add_argument("--chosen", nargs="*", default=None, help="the variants every seed trains (with their baselines)")
    parser.add_argument("--min-ratio", type=float, default=100.0,
                        help="the chosen setting: the best perplexity among variants this many times fewer training bytes than float32 DiLoCo")
    parser.add_argument("--name", default="wire", help="the results files' name")
    parser.add_argument("--runs", default="", help="where the runs go (default runs/bench-<name>)")
    parser.add_argument("--keep", action="store_true", help="reuse the runs (and finished stages) of an earlier invocation")
    parser.add_argument("--collect-only", action="store_true", help="train nothing: the results of the runs in --runs")
    args = parser.parse_args(argv)
    unknown = (set(args.only or ()) | set(args.chosen or ())) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; they are {list(VARIANTS)}")
    return args


def common_overrides(args: argparse.Namespace) -> list[str]:
    """What every variant runs with: the reduced model, fp32, one thread, one island per path."""
    common = [*(REDUCED if args.set is None else args.set), "hardware.precision=fp32", "hardware.threads_per_island=1"]
    if args.rounds is not None:
        common.append(f"run.rounds={args.rounds}")
    if args.inner_checkpoint_every is not None:
        common.append(f"resilience.inner_checkpoint_every={args.inner_checkpoint_every}")
    common.append(f"hardware.islands={paths_of(load_config(args.config, common))}")  # one island per path
    return common


def baseline_name(config_file: str, overrides: list[str]) -> str:
    """The float32 variant a variant is compared with (its inner optimizer and outer decay)."""
    config = load_config(config_file, overrides)
    return baseline_of(config.inner.optimizer, config.outer.decay)


def main() -> None:
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    started = time.perf_counter()
    common = common_overrides(args)
    runner = Runner(Path(args.runs or ROOT / "runs" / f"bench-{args.name}"), keep=args.keep or args.collect_only)
    names = args.only or list(VARIANTS)
    baselines = {name: baseline_name(args.config, [*common, *VARIANTS[name]]) for name in {*names, *(args.chosen or ())}}
    names = list(dict.fromkeys([*(baselines[n] for n in names), *names]))  # each row's float32 first
    runs: dict[str, dict[int, Path]] = {}

    def train(name: str, seed: int) -> None:
        run = runner.root / f"seed{seed}-{slug(name)}"
        if not args.collect_only:
            overrides = [*common, f"run.seed={seed}", *VARIANTS[name]]
            run = runner.pipeline(run.name, Path(args.config), overrides, baselines=False, modes=["prefix"])
        if (run / "eval.json").exists():
            runs.setdefault(name, {})[seed] = run
            log.info("%s seed %d: perplexity %.2f", name, seed, mode_perplexity(read_json(run / "eval.json"), "prefix"))
        else:
            log.warning("%s has no eval.json: left out", run)

    first, *others = args.seeds
    for name in names:
        train(name, first)
    chosen = args.chosen if args.chosen is not None else choose(
        [row_of(name, by_seed, VARIANTS[name]) for name, by_seed in runs.items()], first=first, min_ratio=args.min_ratio)
    for seed in others:
        for name in dict.fromkeys(n for c in chosen for n in (baselines[c], c)):
            train(name, seed)
    if not runs:
        raise SystemExit(f"no finished run in {runner.root}: nothing to report")
    results = results_of(runs, chosen=chosen, args=args, common=common, seconds=time.perf_counter() - started)
    path = write_results(args.name, results, markdown(results),
                         trained_at=distinct_code(run for by_seed in runs.values() for run in by_seed.values()))
    print(path.with_suffix(".md").read_text())


def results_of(runs: dict[str, dict[int, Path]], *, chosen: list[str], args: argparse.Namespace, common: list[str],
               seconds: float) -> dict:
    """The rows (`wire_rows.collect`), the verdict on each chosen variant and the float32 checks."""
    results = collect(runs, chosen=chosen, overrides={name: VARIANTS[name] for name in runs})
    rows = {r["variant"]: r for r in results["rows"]}
    results.update(chosen_by="--chosen" if args.chosen is not None else "min-ratio", min_ratio=args.min_ratio,
                   common=common, seconds=seconds, config=config_name(args.config),
                   verdicts={name: verdict(rows[name]) for name in chosen if name in rows},
                   float32_checks=[float32_check(r) for r in results["rows"] if r["variant"] in BASELINES.values()])
    results["chosen"] = [name for name in chosen if name in rows]
    return results


def config_name(config_file: str) -> str:
    path = Path(config_file).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def slug(name: str) -> str:
    return name.replace(",", "").replace(" ", "-").replace("%", "pc")


def paths_of(config) -> int:
    """The paths of a config's grid (levels' product, times the replicas)."""
    return math.prod(config.topology.levels) * config.topology.replicas


if __name__ == "__main__":
    main()
