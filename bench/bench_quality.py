"""DiPaCo against DiLoCo and dense models at the same budget, in one run (the paper's Table 1 at our scale).

    python bench/bench_quality.py                    # the demo recipe at the demo budget (~30-40 min on 2 cores)
    python bench/bench_quality.py --budget 4         # 4x the rounds (and warm-start steps)
    python bench/bench_quality.py --set sharding.seq_len=128 --set model.hidden_size=64 --name quality-small
    python bench/bench_quality.py --dipaco outer.lr=0.7 --dipaco outer.momentum=0.9   # another DiPaCo recipe
    python bench/bench_quality.py --set corpus.router_fraction=0.05 --reroute-after 5,10   # discriminative routing

Trains, on the bundled corpus (or whatever `--config` / `--set corpus.path=...` names), side by side:
- DiPaCo: `--config` (default configs/demo.yaml) with `--set` (every model) and `--dipaco` (DiPaCo only)
  overrides, evaluated with prefix routing, re-routing every 64 tokens and the oracle path;
- DiLoCo: P replicas (P = DiPaCo's paths) of one path-sized model sharing every module, on random
  shares of the data (configs/diloco.yaml), with DiLoCo's own outer step (Nesterov in every round), and
  a second time with DiPaCo's outer section (`outer.decay` included: rounds in the inner lr's decay are
  plain averages, at the demo budget all of them): the same compute and outer bytes;
- dense path-size models for as many steps as one path (equal steps) and as all paths together
  (equal compute), and dense-large (`--large-hidden` x `--large-layers`, about 8x a path) for as many
  steps as one path (`dipaco baselines`).
With `--reroute-after`, DiPaCo re-routes by `dipaco reroute` after those module versions (the last round
only re-fits the router it is evaluated by; the row "by the router before the last re-routing" is the
same models routed by the previous router). `corpus.router_fraction` holds out the documents the phases
score from every model's training, DiLoCo's and the dense baselines' included.
Every model gets the same dense warm start (`warm_start.fraction` of the run, counted in its budget: DiLoCo starts
from the same pretrained model) and scores the same held-out tokens. Compute is reported as total
training tokens per model (warm start included) and FLOPs = 6 x parameters a token passes through x
tokens. The headline is DiPaCo against the better of the DiLoCo rows (DiLoCo under its best outer step);
the header says the outer step each run's rounds took as applied (train.json's rows), and the results
record the commit that trained each run (`trained_at`: with `--keep` it may be an earlier invocation's).
Writes bench/results/<name>.{json,md} and <name>.png (perplexity against training tokens);
`--results-dir experiments/results` for a research run (experiments/README.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import Runner, mode_perplexity, outer_steps, pretrain_summary, read_json  # noqa: E402
from bench.recording import RESULTS, run_code, write_results  # noqa: E402
from dipaco.config import Config, load_config  # noqa: E402

log = logging.getLogger("bench_quality")

# What DiLoCo takes from DiPaCo's resolved config so that both train the same path model the same way.
SHARED_SECTIONS = ("corpus", "sharding", "model", "inner", "warm_start", "hardware")
SHARED_KEYS = {"run": ("rounds", "seed"), "eval": ("batch_size",), "routing": ("prefix_tokens",)}
DILOCO_OWN_OUTER = ["outer.decay=keep"]  # DiLoCo's own outer step: Nesterov in every round
DIPACO_MODES = ["prefix", "every:64", "likelihood", "oracle", "all-paths"]


def as_override(section: str, key: str, value) -> str:
    """`section.key=value` that `dipaco.config.load_config` reads back as `value`."""
    text = value if isinstance(value, str) else json.dumps(value)
    return f"{section}.{key}={text}"


def diloco_overrides(config: Config, *, outer: bool) -> list[str]:
    """configs/diloco.yaml overrides: DiPaCo's path model, data and budget, P = its paths replicas;
    with `outer`, DiPaCo's outer step too."""
    d = config.to_dict()
    out = [as_override(s, k, v) for s in SHARED_SECTIONS for k, v in d[s].items()]
    out += [as_override(s, k, d[s][k]) for s, keys in SHARED_KEYS.items() for k in keys]
    n_paths = 1
    for k in config.topology.levels:
        n_paths *= k
    out += [f"topology.replicas={n_paths * config.topology.replicas}"]
    if outer:
        out += [as_override("outer", k, v) for k, v in d["outer"].items()]
    else:
        out += DILOCO_OWN_OUTER
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="DiPaCo's config (the recipe)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every model (size, data, budget), e.g. model.hidden_size=64")
    parser.add_argument("--dipaco", action="append", default=[], metavar="KEY=VALUE",
                        help="override for DiPaCo only (outer step, routing, topology), e.g. outer.lr=0.7")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="multiply run.rounds, and with it the warm start, by this (2, 4, ...)")
    parser.add_argument("--large-hidden", type=int, default=-1,
                        help="width of dense-large (default 2x a path's; 0 = no dense-large)")
    parser.add_argument("--large-layers", type=int, default=-1, help="blocks of dense-large (default 3x a path's)")
    parser.add_argument("--no-diloco", action="store_true",
                        help="skip both DiLoCo runs (DiPaCo and its dense baselines only)")
    parser.add_argument("--diloco-only", action="store_true",
                        help="train only the DiLoCo runs (another invocation with --no-diloco trains DiPaCo and the "
                             "dense baselines into the same --runs at the same time; then --collect-only writes the results)")
    parser.add_argument("--no-diloco-own", action="store_true",
                        help="skip DiLoCo with its own outer step (e.g. another process trains it into the same --runs)")
    parser.add_argument("--no-diloco-dipaco-outer", action="store_true",
                        help="skip DiLoCo with DiPaCo's outer step")
    parser.add_argument("--reroute-after", default="", metavar="R1,R2",
                        help="DiPaCo's discriminative phases (`dipaco reroute`, needs corpus.router_fraction > 0): "
                             "after these module versions; the last round only re-fits the evaluation's router")
    parser.add_argument("--name", default="", help="results name (default quality, or quality-budget<B>)")
    parser.add_argument("--results-dir", default=str(RESULTS),
                        help="where the results files go (default bench/results; experiments/results for a research run)")
    parser.add_argument("--runs", default="", help="where the runs go (default runs/bench-<name>)")
    parser.add_argument("--keep", action="store_true", help="reuse finished stages of an earlier run of the same name")
    parser.add_argument("--collect-only", action="store_true",
                        help="train nothing: write the results from the runs already in --runs (implies --keep)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    name = args.name or ("quality" if args.budget == 1 else f"quality-budget{args.budget:g}")
    runner = Runner(Path(args.runs or ROOT / "runs" / f"bench-{name}"), keep=args.keep or args.collect_only or args.diloco_only)
    started = time.perf_counter()

    config = load_config(args.config, [*args.set, *args.dipaco])
    budget = [f"run.rounds={max(1, round(config.run.rounds * args.budget))}"]  # the warm start scales with it
    large_hidden = 2 * config.model.hidden_size if args.large_hidden < 0 else args.large_hidden
    large_layers = 3 * config.model.n_layers if args.large_layers < 0 else args.large_layers
    large = [f"eval.large_hidden_size={large_hidden}", f"eval.large_n_layers={large_layers if large_hidden else 0}"]
    if args.diloco_only and (args.no_diloco or args.collect_only):
        parser.error("--diloco-only trains DiLoCo: it cannot go with --no-diloco or --collect-only")
    results = compare(runner, Path(args.config), [*args.set, *args.dipaco, *budget, *large],
                      diloco=not args.no_diloco, diloco_own=not args.no_diloco_own,
                      diloco_dipaco_outer=not args.no_diloco_dipaco_outer,
                      collect_only=args.collect_only, diloco_only=args.diloco_only,
                      reroute_after=tuple(int(r) for r in args.reroute_after.split(",") if r))
    if results is None:
        print(f"DiLoCo trained in {runner.root}; write the results with --collect-only once DiPaCo has finished")
        return
    results.update(budget=args.budget, seconds=time.perf_counter() - started)
    trained_at = results.pop("trained_at")  # the runs may be an earlier invocation's (--keep)
    path = write_results(name, results, markdown(results), results_dir=Path(args.results_dir), trained_at=trained_at)
    plot(results, path.with_suffix(".png"))
    print(path.with_suffix(".md").read_text())
    print(f"results in {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")


def compare(runner: Runner, config_file: Path, dipaco_overrides: list[str], *, diloco: bool = True,
            diloco_own: bool = True, diloco_dipaco_outer: bool = True, modes: list[str] = DIPACO_MODES,
            collect_only: bool = False, diloco_only: bool = False, reroute_after: tuple[int, ...] = ()) -> dict | None:
    """Train (or, with `collect_only`, only read) DiPaCo (`config_file` + `dipaco_overrides`, evaluated in
    `modes`, with its dense baselines) and, when `diloco`, DiLoCo with its own outer step (unless not
    `diloco_own`) and with DiPaCo's (when `diloco_dipaco_outer`) as runs of `runner`; the `collect` dict
    of their perplexities and budgets, with `trained_at`, the code that trained the runs' models
    (`bench.recording.run_code`). `diloco_only`: train the DiLoCo runs alone and return None
    (DiPaCo is another invocation's).
    `reroute_after`: DiPaCo's discriminative re-routing phases (`Runner.pipeline`)."""
    config = load_config(config_file, dipaco_overrides)
    pipeline = runner.pipeline
    if collect_only:
        def pipeline(name, *_, **__):
            return runner.root / name
    dipaco_run = runner.root / "dipaco"
    if not diloco_only:
        dipaco_run = pipeline("dipaco", config_file, dipaco_overrides, baselines=True, modes=modes,
                              reroute_after=reroute_after)

    diloco_file = ROOT / "configs" / "diloco.yaml"
    own = load_config(diloco_file, diloco_overrides(config, outer=False))
    if own.outer.rescale_by_paths:
        raise ValueError(f"{diloco_file} must hold DiLoCo's own outer step (no sqrt(paths) rescale)")
    runs = {}
    if diloco and diloco_own:
        runs["DiLoCo, its own outer step"] = pipeline(
            "diloco", diloco_file, diloco_overrides(config, outer=False), baselines=False, modes=["prefix"])
    if diloco and diloco_dipaco_outer:
        runs["DiLoCo, DiPaCo's outer step"] = pipeline(
            "diloco-dipaco-outer", diloco_file, diloco_overrides(config, outer=True), baselines=False,
            modes=["prefix"])
    if diloco_only:
        return None
    if collect_only:  # a DiLoCo run that never finished has no row (the point is still reported)
        runs = {label: run for label, run in runs.items() if (run / "eval.json").exists()}
    results = collect(config, own, dipaco_run, runs)
    results.update(trained_at=[code for run in (dipaco_run, *runs.values()) for code in run_code(run)],
                   dipaco_overrides=dipaco_overrides,
                   config=str(config_file.resolve().relative_to(ROOT)) if config_file.resolve().is_relative_to(ROOT)
                   else str(config_file))
    return results


def collect(config: Config, diloco_config: Config, dipaco_run: Path, diloco_runs: dict[str, Path]) -> dict:
    ours = read_json(dipaco_run / "eval.json")
    pre = pretrain_summary(dipaco_run)
    pre_steps, pre_tokens = pre.get("steps", 0), pre.get("tokens", 0)
    grid = "x".join(map(str, config.topology.levels))
    rows = []

    def add(model: str, m: dict, *, perplexity: float, kind: str, warm: bool) -> None:
        # eval.json rows say the warm-start steps a model started from and its training tokens in all
        # (a baseline continues from the warm start, or with eval.baselines_init=scratch trains its steps too: dipaco.eval.dense_baselines)
        pretrain_steps = m.get("pretrain_steps", pre_steps if warm else 0)
        total = m.get("train_tokens_total") or (m["tokens_seen"] or 0) + (pre_tokens if warm else 0)
        rows.append({"model": model, "kind": kind, "paths": m["paths"], "params_per_path": m["params_per_path"],
                     "params_total": m["params_total"], "pretrain_steps": pretrain_steps,
                     "steps_per_path": m["steps_per_path"], "total_tokens": total,
                     "flops": 6 * m["params_per_path"] * total, "perplexity": perplexity,
                     "train_seconds": m.get("train_seconds")})

    routed = ours["models"][0]
    labels = {"prefix": f"DiPaCo {grid}, prefix routing", "every:64": f"DiPaCo {grid}, re-route every 64 tokens",
              "likelihood": f"DiPaCo {grid}, routed by the paths' likelihood of the prefix",
              "oracle": f"DiPaCo {grid}, oracle path (not a deployable model)"}
    for mode, label in labels.items():
        perplexity = mode_perplexity(ours, mode) or (routed["perplexity"] if mode == "prefix" else None)
        if perplexity is not None:  # a mode the run did not evaluate has no row
            add(label, routed, perplexity=perplexity, kind=f"dipaco-{mode}", warm=True)
    before = read_json(dipaco_run / "eval-before-reroute.json")  # the last round re-fitted the router
    if before:
        add(f"DiPaCo {grid}, prefix routing by the router before the last re-routing", before["models"][0],
            perplexity=mode_perplexity(before, "prefix") or before["models"][0]["perplexity"],
            kind="dipaco-prefix-before-reroute", warm=True)
    for label, run in diloco_runs.items():
        ev = read_json(run / "eval.json")
        if ev["scored_tokens"] != ours["scored_tokens"]:
            raise RuntimeError(f"DiPaCo scored {ours['scored_tokens']} tokens but {label} {ev['scored_tokens']}")
        add(f"{label} ({ev['models'][0]['paths']} replicas)", ev["models"][0], perplexity=ev["models"][0]["perplexity"],
            kind="diloco" if "own" in label else "diloco-dipaco-outer", warm=True)
    names = {"dense-equal-steps": "dense path-size, equal steps", "dense-equal-compute": "dense path-size, equal compute",
             "dense-large": "dense large, equal steps"}
    for m in ours["models"][1:]:
        add(names.get(m["model"], m["model"]), m, perplexity=m["perplexity"], kind=m["model"], warm=False)
    by = {r["kind"]: r["perplexity"] for r in rows}
    diloco_rows = [r for r in rows if r["kind"] in ("diloco", "diloco-dipaco-outer")]
    best_diloco = min(diloco_rows, key=lambda r: r["perplexity"]) if diloco_rows else None
    checks = {
        "dipaco_vs_best_diloco": 1 - by["dipaco-prefix"] / best_diloco["perplexity"] if best_diloco else None,
        "dipaco_vs_diloco": 1 - by["dipaco-prefix"] / by["diloco"] if "diloco" in by else None,
        "dipaco_vs_diloco_same_outer": (1 - by["dipaco-prefix"] / by["diloco-dipaco-outer"])
        if "diloco-dipaco-outer" in by else None,
        "dipaco_over_dense_equal_compute": by["dipaco-prefix"] / by["dense-equal-compute"],
        "dipaco_vs_dense_equal_steps": (1 - by["dipaco-prefix"] / by["dense-equal-steps"])
        if "dense-equal-steps" in by else None,
        "routed_over_oracle": by["dipaco-prefix"] / by["dipaco-oracle"] - 1 if "dipaco-oracle" in by else None,
        "likelihood_over_oracle": by["dipaco-likelihood"] / by["dipaco-oracle"] - 1
        if "dipaco-likelihood" in by and "dipaco-oracle" in by else None,
        "likelihood_vs_dense_equal_steps": (1 - by["dipaco-likelihood"] / by["dense-equal-steps"])
        if "dipaco-likelihood" in by and "dense-equal-steps" in by else None,
        "routed_before_reroute_over_oracle": by["dipaco-prefix-before-reroute"] / by["dipaco-oracle"] - 1
        if "dipaco-prefix-before-reroute" in by and "dipaco-oracle" in by else None,
        "dipaco_over_dense_large": by["dipaco-prefix"] / by["dense-large"] if "dense-large" in by else None,
    }
    return {"rows": rows, "checks": checks, "scored_tokens": ours["scored_tokens"],
            "test_documents": ours["test_documents"], "per_path": ours["per_path"],
            "all_paths": ours.get("modes", {}).get("all_paths"),
            "routing_agrees_with_shards": ours.get("routing_agrees_with_shards"),
            "pretrain": {"steps": pre_steps, "tokens": pre_tokens},
            "best_diloco": best_diloco["model"] if best_diloco else None,
            "outer_steps": {"DiPaCo": outer_steps(dipaco_run),
                            **{label: outer_steps(run) for label, run in diloco_runs.items()}},
            "dipaco_outer": config.to_dict()["outer"], "diloco_outer": diloco_config.to_dict()["outer"],
            "recipe": {s: config.to_dict()[s] for s in ("routing", "topology", "warm_start", "inner", "outer", "model")},
            "rounds": config.run.rounds,
            "reroute_phases": [{k: phase[k] for k in ("phase", "after_round", "router_documents", "label_sizes",
                                                      "label_agrees_with_previous_router", "mean_nll_best",
                                                      "mean_nll_previous_route")}
                               | {"accuracy": phase["fit"]["accuracy"], "changed": phase["report"]["changed"]}
                               for phase in read_json(dipaco_run / "routing" / "phases.json") or []]}


def markdown(results: dict) -> str:
    headers = ["model", "params/path", "params total", "pretrain steps", "steps/path", "total train tokens",
               "FLOPs (6ND)", "perplexity"]
    table = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in results["rows"]:
        table.append(f"| {r['model']} | {r['params_per_path']:,} | {r['params_total']:,} | {r['pretrain_steps']} | "
                     f"{r['steps_per_path']}{' x ' + str(r['paths']) if r['paths'] > 1 else ''} | "
                     f"{r['total_tokens']:,} | {r['flops']:.2e} | {r['perplexity']:.2f} |")
    c = results["checks"]

    def lower(x):
        return "-" if x is None else f"{abs(100 * x):.1f}% {'lower' if x >= 0 else 'higher'} perplexity"

    best = c.get("dipaco_vs_best_diloco")
    check_lines = [
        f"- DiPaCo (prefix routing) against DiLoCo under its best outer step ({results['best_diloco']}): "
        f"{lower(best)} (target: at least 5% lower)" if best is not None
        else "- DiPaCo against DiLoCo: not run (`--no-diloco`)",
        f"- DiPaCo against DiLoCo with its own outer step: {lower(c['dipaco_vs_diloco'])}"
        if c["dipaco_vs_diloco"] is not None
        else "- DiPaCo against DiLoCo with its own outer step: not run (`--no-diloco` or `--no-diloco-own`)",
        f"- DiPaCo against DiLoCo with DiPaCo's outer step: {lower(c['dipaco_vs_diloco_same_outer'])}",
        f"- DiPaCo ÷ dense equal compute: {c['dipaco_over_dense_equal_compute']:.2f} (target: ≤ 1.5 at the demo "
        f"budget, ≤ 1.2 at 4x)",
        f"- DiPaCo against dense equal steps: {lower(c['dipaco_vs_dense_equal_steps'])}",
    ]
    if c["routed_over_oracle"] is not None:
        check_lines.append(f"- routed ÷ oracle − 1: {100 * c['routed_over_oracle']:+.1f}% (target: within 2%)")
    if c.get("likelihood_over_oracle") is not None:
        check_lines.append(f"- routed by the paths' likelihood of the prefix ÷ oracle − 1: "
                           f"{100 * c['likelihood_over_oracle']:+.1f}%; against dense equal steps: "
                           f"{lower(c['likelihood_vs_dense_equal_steps'])}")
    if c.get("routed_before_reroute_over_oracle") is not None:
        check_lines.append(f"- routed by the router before the last re-routing ÷ oracle − 1: "
                           f"{100 * c['routed_before_reroute_over_oracle']:+.1f}%")
    if c["dipaco_over_dense_large"] is not None:
        check_lines.append(f"- DiPaCo ÷ dense large: {c['dipaco_over_dense_large']:.2f}")
    o, d = results["dipaco_outer"], results["diloco_outer"]
    applied = "; ".join(f"{model}: {steps}" for model, steps in results.get("outer_steps", {}).items())
    return (
        f"# DiPaCo against DiLoCo and dense models ({results['rounds']} rounds, budget x{results['budget']:g})\n\n"
        f"{results['test_documents']} held-out documents, {results['scored_tokens']:,} tokens scored after the "
        f"routing prefix; every model scores the same tokens. DiPaCo: `{results['config']}` with "
        f"`{' '.join(results['dipaco_overrides'])}`. Warm start: {results['pretrain']['steps']} dense steps "
        f"({results['pretrain']['tokens']:,} tokens), counted in every model's total.\n"
        f"Outer steps as applied (train.json's rows): {applied or 'not recorded'}. Configured: DiPaCo lr {o['lr']}, "
        f"momentum {o['momentum']}, rescale {o['rescale_by_paths']}, weighting {o['weighting']}, outer.decay "
        f"{o['decay']}; DiLoCo's own lr {d['lr']}, momentum {d['momentum']}, rescale {d['rescale_by_paths']}, "
        f"outer.decay {d['decay']}.\n\n"
        + "\n".join(table) + "\n\n" + "\n".join(check_lines)
        + "\n\nPer path (prefix routing): "
        + ", ".join(f"{p['label']} {p['documents']} docs {p['perplexity']:.1f}" for p in results["per_path"]
                    if p["perplexity"])
        + f"\nWall time of this invocation: {results['seconds'] / 60:.1f} min (with `--keep`, stages finished "
        f"by an earlier invocation are reused and not counted); training seconds per model are in the JSON.\n"
    )


def plot(results: dict, out: Path) -> None:
    """Perplexity against total training tokens per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = {"dipaco-prefix": ("tab:red", "o"), "dipaco-every:64": ("tab:orange", "o"),
               "dipaco-likelihood": ("tab:purple", "o"),
               "dipaco-oracle": ("tab:red", "x"), "diloco": ("tab:blue", "s"), "diloco-dipaco-outer": ("tab:cyan", "D"),
               "dense-equal-steps": ("tab:gray", "^"), "dense-equal-compute": ("black", "^"),
               "dense-large": ("tab:green", "v")}
    for r in results["rows"]:
        color, marker = markers.get(r["kind"], ("tab:purple", "*"))
        ax.scatter(r["total_tokens"], r["perplexity"], color=color, marker=marker, s=50,
                   label=f"{r['model']}: {r['perplexity']:.1f}")
    dense = sorted((r["total_tokens"], r["perplexity"]) for r in results["rows"]
                   if r["kind"] in ("dense-equal-steps", "dense-equal-compute"))
    if len(dense) == 2:
        ax.plot(*zip(*dense), color="tab:gray", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("total training tokens per model (warm start included)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"DiPaCo, DiLoCo and dense ({results['rounds']} rounds, budget x{results['budget']:g})")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
