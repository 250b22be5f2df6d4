"""More paths at the same path size: DiPaCo grids of 2x2, 4x4 and 8x8 paths against dense models of 1x and 4x
a path's parameters, each the mean of several seeds (the same seeds for every model).

    python bench/bench_grid_scaling.py                              # 3 seeds, ~1.5 h on 2 cores
    python bench/bench_grid_scaling.py --seeds 0 --grids 2x2 4x4 --dense 1 4 16 --name grid-scaling-quick
    python bench/bench_grid_scaling.py --keep --collect-only        # the results from the runs already made
    python bench/bench_grid_scaling.py --grids --warm-start 400 --dense 16 --dense-set inner.lr=1e-3 \
        --name grid-scaling-dense16x-lr1e-3                          # a dense model alone, at its own lr
    python bench/bench_grid_scaling.py --config configs/large.yaml --grids 2x2 4x4 8x8 16x16 --seeds 0 \
        --dense 1 --dense-compute 2x2 4x4 --set ...                   # the large corpus (docs/grids.md)

Every model is `configs/demo.yaml`'s recipe at the reduced model (`--set`, default width 64 and sequences of
128 tokens, so that 64 paths' shards still hold more tokens than a path trains on), fp32, sync rounds:
- DiPaCo grids (`--grids`): the same path model, the same per-path steps (`run.rounds` x `inner.steps`) and
  the same dense warm start (`--warm-start` steps, by default the 2x2 grid's: the recipe's 50%), whatever the
  number of paths; routed by the k-means router on the warm start's features (prefix), by the paths'
  likelihood of the prefix, and the oracle path, in sample and split (chosen on one half of a document's
  tokens, scoring the other: docs/evaluation.md) (neither deployable);
- dense models of `--dense` times a path's parameters (1 and 4 by default) (a wider path model, width chosen for the parameter
  count): a 1x1 grid, so each gets its own warm start of its own size for the same warm-start steps and then
  the same per-path steps on every training document: the same sequential steps as one path. 1x is the
  dense model of equal steps. `--dense-compute GRID` also trains each for as many training FLOPs after the
  warm start as that grid's paths together (equal compute);
Per grid it also records the paths' training shards (tokens, and the epochs a path's steps make of them) and
the held-out documents routed to each path: where more paths stop helping, these say whether the shards
or the routing are why. Every model scores the same held-out tokens. Writes
bench/results/<name>.{json,md,png}.
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

import yaml  # noqa: E402

from bench.quality_runs import Runner, mode_perplexity, read_json, warm_start_steps_as_fraction  # noqa: E402
from bench.recording import RESULTS, distinct_code, markdown_table, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("bench_grid_scaling")
REDUCED = ["sharding.seq_len=128", "model.hidden_size=64"]
MODES = ["prefix", "likelihood:4", "likelihood", "oracle", "oracle-split"]
MODE_NAMES = {"prefix": "routed (k-means on the prefix)",
              "likelihood:4": "routed (likelihood among the k-means router's 4 best paths)",
              "likelihood": "routed (paths' likelihood of the prefix)",
              "oracle": "oracle path", "oracle-split": "split oracle (chosen on one half, scores the other)"}

STEP_NAMES = {"likelihood:4": "routed by likelihood among the k-means router's 4 best paths",
              "likelihood": "routed by the paths' likelihood", "oracle-split": "by the split oracle"}


def grid_levels(grid: str) -> list[int]:
    """"4x4" -> [4, 4]."""
    try:
        levels = [int(n) for n in grid.lower().split("x")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"--grids: {grid!r} is not a grid like 2x2 or 4x4")
    return levels


def dense_models(multiples: list[int], widths: dict[int, int], *, compute_of: list[str],
                 rounds: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each dense k× model: as many steps as one path ("dense kx"), and for each grid
    of `compute_of` as many training FLOPs after the warm start as that grid's paths together ("dense kx,
    GRID compute": run.rounds x paths / k; left out where that is the equal-steps model itself)."""
    out = []
    for k in multiples:
        out.append((f"dense {k}x", [f"model.hidden_size={widths[k]}"]))
        for grid in compute_of:
            path_rounds = rounds * math.prod(grid_levels(grid))
            if path_rounds % k:
                raise ValueError(f"--dense-compute {grid}: {path_rounds} path rounds do not divide into {k}x rounds")
            if path_rounds // k != rounds:
                out.append((f"dense {k}x, {grid} compute", [f"model.hidden_size={widths[k]}",
                                                            f"run.rounds={path_rounds // k}"]))
    return out


def path_parameters(config_file: str, overrides: list[str], *, width: int) -> int:
    """Parameters of one path model of `width` (the config's vocabulary, layers and heads)."""
    from dipaco.model.path_model import PathSpec, count_parameters

    config = load_config(config_file, [*overrides, f"model.hidden_size={width}"])
    spec = PathSpec(model=config.model, vocab_size=config.sharding.vocab_size, seq_len=config.sharding.seq_len)
    return count_parameters(spec.new_model(seed=0))


def width_for(config_file: str, overrides: list[str], *, params: int) -> int:
    """The width (a multiple of 2 x the heads, so head dims stay even) whose path model has about `params`
    parameters."""
    config = load_config(config_file, overrides)
    step = 2 * config.model.n_heads
    width, best = step, None
    while True:
        n = path_parameters(config_file, overrides, width=width)
        if best is None or abs(n - params) < abs(best[1] - params):
            best = (width, n)
        if n > params:
            return best[0]
        width += step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="the recipe")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"override for every model (default {REDUCED})")
    parser.add_argument("--grids", nargs="*", default=["2x2", "4x4", "8x8"],
                        help="DiPaCo grids (none: the dense models alone, with --warm-start)")
    parser.add_argument("--dense", nargs="*", type=int, default=[1, 4],
                        help="dense models of these multiples of a path's parameters")
    parser.add_argument("--dense-compute", nargs="*", default=[], metavar="GRID",
                        help="also train each dense model for as many training FLOPs as these grids' paths together "
                             "after the warm start (run.rounds x paths / multiple), e.g. 2x2 4x4")
    parser.add_argument("--dense-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the dense models only, e.g. inner.lr=1.5e-3 (their own lr: their width is not a path's)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="run.seed of every model")
    parser.add_argument("--all-modes-seeds", type=int, default=1,
                        help="the first this many seeds also route by likelihood and score the oracle paths (all "
                             "score every held-out document with every path: 8x8 spends most of its time there)")
    parser.add_argument("--warm-start", type=int, default=0,
                        help="warm-start steps of every model (default: the first grid's under the recipe)")
    parser.add_argument("--islands", type=int, default=1, help="island processes per DiPaCo run (hardware.islands)")
    parser.add_argument("--name", default="grid-scaling", help="the results files' name")
    parser.add_argument("--results-dir", default=str(RESULTS),
                        help="where the results files go (default bench/results; experiments/results for a research run)")
    parser.add_argument("--runs", default="", help="where the runs go (default runs/bench-<name>)")
    parser.add_argument("--keep", action="store_true", help="reuse the runs (and finished stages) of an earlier invocation")
    parser.add_argument("--collect-only", action="store_true", help="train nothing: the results of the runs in --runs")
    args = parser.parse_args()
    if not args.grids and not args.warm_start:
        parser.error("without --grids, give the dense models' --warm-start steps")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    started = time.perf_counter()
    common = [*(REDUCED if args.set is None else args.set), "hardware.precision=fp32",
              f"hardware.islands={args.islands}", "hardware.threads_per_island=1"]
    first = load_config(args.config, [*common, f"topology.levels={grid_levels((args.grids or ['1x1'])[0])}"])
    warm = args.warm_start or first.pretrain_steps
    width = first.model.hidden_size
    path_params = path_parameters(args.config, common, width=width)
    widths = {k: width if k == 1 else width_for(args.config, common, params=k * path_params) for k in args.dense}
    runner = Runner(Path(args.runs or ROOT / "runs" / f"bench-{args.name}"), keep=args.keep or args.collect_only)
    models = [(f"DiPaCo {grid}", [f"topology.levels={grid_levels(grid)}"], MODES) for grid in args.grids]
    models += [(model, overrides, ["prefix"]) for model, overrides in
               dense_models(args.dense, widths, compute_of=args.dense_compute, rounds=first.run.rounds)]
    runs: dict[str, dict[int, Path]] = {}
    for index, seed in enumerate(args.seeds):
        for model, override, all_modes in models:
            modes = all_modes if index < args.all_modes_seeds else ["prefix"]
            dense = model.startswith("dense")
            overrides = [*common, f"run.seed={seed}", f"warm_start.steps={warm}", *override]
            if dense:
                overrides += ["topology.levels=[1]", *args.dense_set]
            name = f"seed{seed}-{model.replace(',', '').replace(' ', '-')}"
            if args.collect_only:
                run = runner.root / name
                if not (run / "eval.json").exists():
                    log.warning("%s has no eval.json: left out", run)
                    continue
            else:
                resolved = warm_start_steps_as_fraction(Path(args.config), overrides)
                run = runner.pipeline(name, Path(args.config), resolved, baselines=False, modes=modes)
            runs.setdefault(model, {})[seed] = run
            log.info("%s seed %d: %s", model, seed, summary_line(run))
    results = collect(runs, warm=warm, widths=widths, path_params=path_params, common=common,
                      seconds=time.perf_counter() - started)
    results.update(collected_only=args.collect_only, dense_overrides=args.dense_set,
                   config=display_path(Path(args.config)))
    path = write_results(args.name, results, markdown(results), results_dir=Path(args.results_dir), trained_at=distinct_code(run for by_seed in runs.values() for run in by_seed.values()))
    plot(results, path.with_suffix(".png"))
    print(path.with_suffix(".md").read_text())


def display_path(path: Path) -> str:
    """`path` relative to the repository where it lies in it (as the results name it)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def summary_line(run: Path) -> str:
    evaluation = read_json(run / "eval.json")
    return ", ".join(f"{mode} {value:.2f}" for mode in MODES
                     if (value := mode_perplexity(evaluation, mode)) is not None)


def shard_stats(run: Path, *, tokens_per_path: int) -> dict:
    """The paths' training shards: tokens (min, median, max) and the epochs a path's steps make of them."""
    index = read_json(run / "shards" / "index.json")
    tokens = [p["train"]["tokens"] for p in index["paths"]]
    return {"paths": len(tokens), "tokens_min": min(tokens), "tokens_median": statistics.median(tokens),
            "tokens_max": max(tokens), "epochs_max": tokens_per_path / max(1, min(tokens)),
            "epochs_median": tokens_per_path / max(1, statistics.median(tokens))}


def test_documents(evaluation: dict) -> dict:
    """Held-out documents routed to each path (prefix routing): min, median, max and paths with none."""
    per_path = [p["documents"] for p in evaluation.get("per_path", [])]
    empty = len(evaluation.get("paths_without_test_documents", []))
    counts = per_path + [0] * empty
    return {"min": min(counts), "median": statistics.median(counts), "max": max(counts), "paths_with_none": empty}


def collect(runs: dict[str, dict[int, Path]], *, warm: int, widths: dict[int, int], path_params: int,
            common: list[str], seconds: float) -> dict:
    rows = []
    for model, by_seed in runs.items():
        per_seed = {}
        for seed, run in sorted(by_seed.items()):
            evaluation = read_json(run / "eval.json")
            first = evaluation["models"][0]
            train = read_json(run / "train.json")
            tokens_per_path = train["tokens"] // max(1, first["paths"])
            per_seed[seed] = {
                "run": display_path(run),
                "modes": {mode: mode_perplexity(evaluation, mode) for mode in MODES},
                "paths": first["paths"], "params_per_path": first["params_per_path"],
                "params_total": first["params_total"], "warm_start_steps": first["pretrain_steps"],
                "steps_per_path": first["steps_per_path"], "train_tokens_total": first["train_tokens_total"],
                "shards": shard_stats(run, tokens_per_path=tokens_per_path), "test_documents": test_documents(evaluation),
                "outer_steps": sorted({r.get("outer_step", "?") for r in train["rounds"]}),
                "train_seconds": train["seconds"], "scored_tokens": evaluation["scored_tokens"],
                "inner_lr": yaml.safe_load((run / "config.yaml").read_text())["inner"]["lr"],
            }
        seeds = sorted(per_seed)
        any_seed = per_seed[seeds[0]]
        modes = {}
        for mode in MODES:
            values = [per_seed[s]["modes"][mode] for s in seeds if per_seed[s]["modes"][mode] is not None]
            if values:
                modes[mode] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
                               "std": statistics.stdev(values) if len(values) > 1 else 0.0, "seeds": len(values)}
        rows.append({"model": model, "dense": model.startswith("dense"), "seeds": seeds, "modes": modes,
                     "paths": any_seed["paths"], "params_per_path": any_seed["params_per_path"],
                     "params_total": any_seed["params_total"], "warm_start_steps": any_seed["warm_start_steps"],
                     "steps_per_path": any_seed["steps_per_path"], "shards": any_seed["shards"],
                     "test_documents": any_seed["test_documents"], "inner_lr": any_seed["inner_lr"],
                     "per_seed": per_seed})
    return {"rows": rows, "checks": checks(rows), "warm_start_steps": warm, "path_params": path_params,
            "dense_widths": {str(k): w for k, w in widths.items()}, "common": common, "seconds": seconds}


def checks(rows: list[dict]) -> dict:
    """The issue's comparisons, on the seeds' means (prefix routing; likelihood routing too where scored)."""
    grids = [r for r in rows if not r["dense"] and "prefix" in r["modes"]]
    dense = [r for r in rows if r["dense"] and "prefix" in r["modes"]]
    out: dict[str, float] = {}
    for smaller, larger in zip(grids, grids[1:]):
        a, b = smaller["modes"]["prefix"]["mean"], larger["modes"]["prefix"]["mean"]
        out[f"{larger['model']} routed vs {smaller['model']}"] = b / a - 1
        for mode in ("likelihood:4", "likelihood", "oracle-split"):
            if mode in smaller["modes"] and mode in larger["modes"]:  # the same seeds on both sides
                if smaller["modes"][mode]["seeds"] == larger["modes"][mode]["seeds"]:
                    a, b = smaller["modes"][mode]["mean"], larger["modes"][mode]["mean"]
                    out[f"{larger['model']} vs {smaller['model']}, both {STEP_NAMES[mode]}"] = b / a - 1
    by_grid = {r["model"].removeprefix("DiPaCo "): r for r in grids}
    for row in dense:
        compute_of = row["model"].removesuffix(" compute").partition(", ")[2]
        grid = by_grid.get(compute_of) or (grids[-1] if grids and not compute_of else None)
        if grid is not None:  # the largest grid against each equal-steps model, a grid against its equal compute
            out[f"{grid['model']} routed vs {row['model']}"] = (grid["modes"]["prefix"]["mean"]
                                                                 / row["modes"]["prefix"]["mean"] - 1)
    return out


def cell(row: dict, mode: str) -> str:
    m = row["modes"].get(mode)
    if m is None:
        return "-"
    return f"{m['mean']:.2f} ± {m['std']:.2f}" if m["seeds"] > 1 else f"{m['mean']:.2f}"


def markdown(results: dict) -> str:
    rows = results["rows"]
    seeds = sorted({s for r in rows for s in r["seeds"]})
    every_mode = sorted({s for r in rows for s, v in r["per_seed"].items() if v["modes"].get("oracle") is not None})
    headers = ["model", "paths", "params/path", "params total", "warm start + path steps", "train tokens/path shard (min / median)",
               "epochs of the smallest shard", "inner lr", *[MODE_NAMES[m] for m in MODES],
               "held-out docs per path (min / median)"]
    table = []
    for r in rows:
        s, t = r["shards"], r["test_documents"]
        table.append([r["model"], r["paths"], f"{r['params_per_path']:,}", f"{r['params_total']:,}",
                      f"{r['warm_start_steps']} + {r['steps_per_path']}",
                      f"{s['tokens_min']:,} / {s['tokens_median']:,.0f}", f"{s['epochs_max']:.2f}",
                      f"{r['inner_lr']:g}" if r.get("inner_lr") else "-", *[cell(r, m) for m in MODES], f"{t['min']} / {t['median']:g}"])
    per_seed_headers = ["model", *[f"seed {s} (prefix)" for s in seeds]]
    per_seed = [[r["model"], *[f"{r['per_seed'][s]['modes']['prefix']:.2f}" if s in r["per_seed"] else "-" for s in seeds]]
                for r in rows]
    lines = [f"- {name}: {value:+.1%} perplexity" for name, value in results["checks"].items()]
    tokens = rows[0]["per_seed"][rows[0]["seeds"][0]]["scored_tokens"] if rows else 0
    outer = sorted({o for r in rows for s in r["per_seed"].values() for o in s["outer_steps"]})
    return (
        f"# More paths at the same path size: DiPaCo grids against dense models (mean ± std of seeds {seeds})\n\n"
        f"`{results.get('config', 'configs/demo.yaml')}`'s recipe with {' '.join(results['common'])}: every model the same warm-start steps "
        f"({results['warm_start_steps']}, each dense model its own warm start of its own size) and the same steps "
        f"after it; the dense models are 1x1 grids of a wider path model (widths {results['dense_widths']} for the "
        f"multiples of a path's {results['path_params']:,} parameters) on every training document"
        f"{' with ' + ' '.join(results['dense_overrides']) if results.get('dense_overrides') else ''}. Perplexity on "
        f"{tokens:,} held-out tokens, the same for every model; likelihood routing and the oracle paths at seeds "
        f"{every_mode} only (mean ± std where more than one seed). Outer steps the runs took: {', '.join(outer)}.\n\n"
        + markdown_table(headers, table)
        + "\n\nPer seed (routed by k-means on the prefix):\n\n" + markdown_table(per_seed_headers, per_seed)
        + "\n\nComparisons (means of the seeds, routed by k-means on the prefix unless said; negative = lower perplexity):\n\n"
        + "\n".join(lines)
        + f"\n\n{wall_time(results)}"
        + "\n\n```\n" + format_table(headers, table) + "\n```\n"
    )


def wall_time(results: dict) -> str:
    """The invocation's wall time, or for collected runs the training time they took (train.json, per model)."""
    per_model = [(r["model"], sum(v["train_seconds"] for v in r["per_seed"].values())) for r in results["rows"]]
    trained = ", ".join(f"{model} {seconds / 60:.1f}" for model, seconds in per_model)
    if results.get("collected_only"):
        return (f"Collected from runs trained by earlier invocations (`--keep`). Training took (min, all seeds, "
                f"train.json): {trained}.")
    return f"Wall time: {results['seconds'] / 60:.0f} min; training (min, all seeds): {trained}."


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grids = [r for r in results["rows"] if not r["dense"]]
    for mode in MODES:  # the mean over the seeds that scored the mode, and its std
        points = [(r["paths"], r["modes"][mode]) for r in grids if mode in r["modes"]]
        if points:
            seeds = max(m["seeds"] for _, m in points)
            ax.errorbar([x for x, _ in points], [m["mean"] for _, m in points], yerr=[m["std"] for _, m in points],
                        marker="o", capsize=3, label=f"DiPaCo, {MODE_NAMES[mode]} ({seeds} seed{'s' * (seeds > 1)})")
    first = min((s for r in grids for s in r["seeds"]), default=None)
    points = [(r["paths"], r["per_seed"][first]["modes"]["prefix"]) for r in grids if first in r["per_seed"]]
    if len(points) > 1 and any(r["modes"].get("oracle", {}).get("seeds") == 1 for r in grids):  # like for like with the one-seed modes
        ax.plot([x for x, _ in points], [y for _, y in points], linestyle=":", marker=".", color="C0",
                label=f"DiPaCo, {MODE_NAMES['prefix']} (seed {first})")
    left = min((r["paths"] for r in grids), default=1)
    for r in results["rows"]:
        if r["dense"] and "prefix" in r["modes"]:
            ax.axhline(r["modes"]["prefix"]["mean"], linestyle="--", linewidth=1, color="grey")
            ax.annotate(f"{r['model']} ({r['params_per_path']:,} params, mean of seeds)", (left, r["modes"]["prefix"]["mean"]),
                        fontsize=8, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("paths (same path size and per-path steps)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("DiPaCo grids against dense models (mean of seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
