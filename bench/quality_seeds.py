"""The mean and spread over seeds of `bench/bench_quality.py` results: one table a headline can quote.

    python bench/quality_seeds.py quality-private-emb-full quality-private-emb-full-seed1 \\
        quality-private-emb-full-seed2 --name quality-private-emb-full-seeds

Each argument names a results file of bench_quality (in `--results-dir`, default bench/results) run with
the same config, overrides and budget but `run.seed`; every file must score the same held-out tokens and
have the same models. Per model: each seed's perplexity, the mean, the standard deviation and the range.
The comparisons (DiPaCo against DiLoCo under its best outer step, against dense equal steps, ÷ dense
equal compute) are given on the means and on every seed, with how many seeds meet the issue's target.
DiLoCo's best outer step is the DiLoCo row with the lower mean, the same row on every seed.
The result is quotable only when every file it reads is (`bench.recording.quotable`).
A results file of `experiments/capacity.py` (one `bench_quality` comparison per point of its sweep) is
read at its point `--point ROUNDSxH` (default: its only point).
Writes <name>.{json,md,png} next to the files it reads.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import RESULTS, markdown_table, quotable, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402

SEED_OVERRIDE = re.compile(r"^run\.seed=")
DILOCO_KINDS = ("diloco", "diloco-dipaco-outer")


def capacity_point(record: dict, point: str | None, *, name: str) -> dict:
    """A point of an experiments/capacity.py results record, as the bench_quality record it was compared as."""
    points = {p["point"]: p for p in record["points"]}
    if point is None and len(points) == 1:
        point = next(iter(points))
    if point not in points:
        raise SystemExit(f"{name}: give --point, one of {sorted(points)} (got {point!r})")
    p = points[point]
    return {"config": record["config"], "budget": 1.0, "rounds": p["rounds"], "scored_tokens": p["scored_tokens"],
            "test_documents": None, "rows": p["rows"],
            "dipaco_overrides": [*record["set"], *record["dipaco"], f"run.rounds={p['rounds']}",
                                 f"inner.steps={p['inner_steps']}"],
            "pretrain": {"steps": p["pretrain_steps"]}, "outer_steps": {},
            **{k: record[k] for k in ("commit", "clean", "trained_at", "source") if k in record}}


def seed_of(record: dict) -> int:
    """The `run.seed` a bench_quality results record trained with (its config and overrides)."""
    return load_config(ROOT / record["config"], record["dipaco_overrides"]).run.seed


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "seeds": len(values)}


def resolved(record: dict) -> dict:
    """The config a results record's DiPaCo trained with, every field resolved, `run.seed` left out."""
    d = load_config(ROOT / record["config"], record["dipaco_overrides"]).to_dict()
    d["run"].pop("seed")
    return d


def check_sources(records: dict[str, dict]) -> list[int]:
    """Refuse files that are not one comparison at several seeds, naming the file and what differs; their seeds."""
    (first_name, first), *rest = records.items()
    expected = resolved(first)
    for name, record in rest:
        for field in ("config", "budget", "scored_tokens"):
            if record[field] != first[field]:
                raise SystemExit(f"{name}: {field} is {record[field]!r} but {first_name} has {first[field]!r}")
        if [r["model"] for r in record["rows"]] != [r["model"] for r in first["rows"]]:
            raise SystemExit(f"{name}: models {[r['model'] for r in record['rows']]} but {first_name} has "
                             f"{[r['model'] for r in first['rows']]}")
        got = resolved(record)
        differ = [f"{s}.{k}" for s in expected for k in expected[s] if expected[s][k] != got.get(s, {}).get(k)]
        if differ:
            raise SystemExit(f"{name}: {', '.join(differ)} differ from {first_name}'s; only run.seed may differ "
                             f"between the seeds of one comparison")
    seeds = [seed_of(r) for r in records.values()]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"the files {list(records)} trained with seeds {seeds}: each seed once")
    return seeds


def aggregate(records: dict[str, dict]) -> dict:
    """Rows with every seed's perplexity and their spread; the comparisons on the means and per seed."""
    seeds = check_sources(records)
    by_seed = [{row["kind"]: row for row in r["rows"]} for r in records.values()]
    first = next(iter(records.values()))
    rows = []
    for row in first["rows"]:
        values = [rows_of_seed[row["kind"]]["perplexity"] for rows_of_seed in by_seed]
        rows.append({k: row[k] for k in ("model", "kind", "paths", "params_per_path", "params_total",
                                         "pretrain_steps", "steps_per_path", "total_tokens", "flops",
                                         "tokens_per_path_param", "epochs") if k in row}  # the last two: capacity.py's
                    | {"perplexity": spread(values), "per_seed": dict(zip(map(str, seeds), values))})
    mean = {r["kind"]: r["perplexity"]["mean"] for r in rows}
    diloco = [r for r in rows if r["kind"] in DILOCO_KINDS]
    best = min(diloco, key=lambda r: r["perplexity"]["mean"]) if diloco else None

    def comparison(of: str, against: str, *, ratio: bool = False) -> dict | None:
        if of not in mean or against not in mean:
            return None
        if ratio:
            each = [s[of]["perplexity"] / s[against]["perplexity"] for s in by_seed]
            on_means = mean[of] / mean[against]
        else:  # fraction lower perplexity
            each = [1 - s[of]["perplexity"] / s[against]["perplexity"] for s in by_seed]
            on_means = 1 - mean[of] / mean[against]
        return {"on_means": on_means, "per_seed": dict(zip(map(str, seeds), each)), **spread(each)}

    checks = {
        "dipaco_vs_best_diloco": comparison("dipaco-prefix", best["kind"]) if best else None,
        "likelihood_vs_best_diloco": comparison("dipaco-likelihood", best["kind"]) if best else None,
        "before_reroute_vs_best_diloco": comparison("dipaco-prefix-before-reroute", best["kind"]) if best else None,
        "dipaco_vs_diloco": comparison("dipaco-prefix", "diloco"),
        "dipaco_vs_diloco_same_outer": comparison("dipaco-prefix", "diloco-dipaco-outer"),
        "dipaco_over_dense_equal_compute": comparison("dipaco-prefix", "dense-equal-compute", ratio=True),
        "likelihood_over_dense_equal_compute": comparison("dipaco-likelihood", "dense-equal-compute", ratio=True),
        "dipaco_vs_dense_equal_steps": comparison("dipaco-prefix", "dense-equal-steps"),
        "likelihood_vs_dense_equal_steps": comparison("dipaco-likelihood", "dense-equal-steps"),
        "routed_over_oracle": comparison("dipaco-prefix", "dipaco-oracle", ratio=True),
        "likelihood_over_oracle": comparison("dipaco-likelihood", "dipaco-oracle", ratio=True),
    }
    sources = [{"name": name, "seed": seed, "commit": r.get("commit"), "clean": r.get("clean"),
                "quotable": quotable(r)} for (name, r), seed in zip(records.items(), seeds)]
    return {"seeds": seeds, "rows": rows, "checks": checks, "best_diloco": best["model"] if best else None,
            "sources": sources, "config": first["config"], "budget": first["budget"], "rounds": first["rounds"],
            "dipaco_overrides": [o for o in first["dipaco_overrides"] if not SEED_OVERRIDE.match(o)],
            "scored_tokens": first["scored_tokens"], "test_documents": first["test_documents"],
            "pretrain": first["pretrain"], "outer_steps": first.get("outer_steps", {})}


def trained_at(records: dict[str, dict]) -> list[dict]:
    """The code behind every figure read: each file's models and each file's own measurement."""
    out = []
    for name, r in records.items():
        out += [{**t, "what": f"{name}: {t['what']}"} for t in r.get("trained_at") or []]
        out.append({"what": f"{name}: measured", "commit": r.get("commit"), "clean": quotable(r)})
    return out


def fmt(m: dict) -> str:
    return f"{m['mean']:.2f} ± {m['std']:.2f}"


def markdown(results: dict) -> str:
    seeds = results["seeds"]
    headers = ["model", "params/path", "steps/path", "total train tokens", f"perplexity, mean ± std of {len(seeds)} seeds",
               "range", *(f"seed {s}" for s in seeds)]
    table = [[r["model"], f"{r['params_per_path']:,}", f"{r['steps_per_path']}" + (f" x {r['paths']}" if r["paths"] > 1 else ""),
              f"{r['total_tokens']:,}", fmt(r["perplexity"]), f"{r['perplexity']['min']:.2f}–{r['perplexity']['max']:.2f}",
              *(f"{r['per_seed'][str(s)]:.2f}" for s in seeds)] for r in results["rows"]]
    if all("tokens_per_path_param" in r for r in results["rows"]):  # a capacity point: how saturated each model is
        headers.insert(4, "train tokens per path parameter (epochs)")
        for row, r in zip(table, results["rows"]):
            row.insert(4, f"{r['tokens_per_path_param']:.1f} ({r['epochs']:.2f})")
    c = results["checks"]
    at_4x = results["budget"] >= 4
    targets = {  # the targets: (label, how a figure meets it or None, the target in words)
        "dipaco_vs_best_diloco": (f"DiPaCo (prefix routing) against DiLoCo under its best outer step "
                                  f"({results['best_diloco']})", lambda x: x >= 0.10, "at least 10% lower"),
        "likelihood_vs_best_diloco": ("DiPaCo routed by the paths' likelihood of the prefix (deployable) against "
                                      "DiLoCo under its best outer step", lambda x: x >= 0.10, "at least 10% lower"),
        "before_reroute_vs_best_diloco": ("DiPaCo routed by the router before the last re-routing (k-means, where "
                                          "one phase ran) against DiLoCo under its best outer step", None, ""),
        "dipaco_vs_diloco": ("DiPaCo against DiLoCo with its own outer step", None, ""),
        "dipaco_vs_diloco_same_outer": ("DiPaCo against DiLoCo with DiPaCo's outer step", None, ""),
        "dipaco_over_dense_equal_compute": ("DiPaCo ÷ dense equal compute", (lambda x: x <= 1.0) if at_4x else None,
                                            "≤ 1.0 at 4x the demo's budget"),
        "likelihood_over_dense_equal_compute": ("DiPaCo routed by the paths' likelihood ÷ dense equal compute", None, ""),
        "dipaco_vs_dense_equal_steps": ("DiPaCo against dense equal steps", None, ""),
        "likelihood_vs_dense_equal_steps": ("DiPaCo routed by the paths' likelihood against dense equal steps",
                                            None, ""),
        "routed_over_oracle": ("DiPaCo routed ÷ oracle", None, ""),
        "likelihood_over_oracle": ("DiPaCo routed by the paths' likelihood ÷ oracle", None, ""),
    }
    lines = []
    for key, (label, meets, target) in targets.items():
        x = c.get(key)
        if x is None:
            continue
        if key.endswith(("equal_compute", "oracle")):  # a ratio of perplexities
            show, spread_of = (lambda v: f"{v:.3f}"), f"{x['std']:.3f}"
        else:  # the fraction by which DiPaCo's perplexity is lower
            show, spread_of = (lambda v: f"{100 * v:.1f}% lower"), f"{100 * x['std']:.1f} points"
        line = (f"- {label}: {show(x['on_means'])} on the means; per seed "
                + ", ".join(f"{show(v)} (seed {s})" for s, v in x["per_seed"].items())
                + f", std {spread_of}")
        if meets:
            met = sum(meets(v) for v in x["per_seed"].values())
            line += (f"; target {target}: {'met' if meets(x['on_means']) else 'missed'} on the means, "
                     f"met by {met} of {len(seeds)} seeds")
        lines.append(line)
    sources = ", ".join(f"[{s['name']}]({s['name']}.md) (seed {s['seed']}, commit {str(s['commit'])[:7]}"
                        f"{'' if s['quotable'] else ', not quotable'})" for s in results["sources"])
    applied = "; ".join(f"{model}: {steps}" for model, steps in results["outer_steps"].items())
    return (f"# DiPaCo against DiLoCo and dense models over seeds {', '.join(map(str, seeds))} "
            f"({results['rounds']} rounds, budget x{results['budget']:g})\n\n"
            f"The mean and standard deviation of {len(seeds)} runs of one comparison (`bench/bench_quality.py`, or a point of "
            f"`experiments/capacity.py`) that differ only in "
            f"`run.seed` (the same seeds for every model): {sources}. "
            f"{str(results['test_documents']) + ' held-out documents, ' if results['test_documents'] else ''}"
            f"{results['scored_tokens']:,} tokens scored; DiPaCo: `{results['config']}` with "
            f"`{' '.join(results['dipaco_overrides'])}`; warm start {results['pretrain']['steps']} dense steps, counted "
            f"in every model's total. Outer steps as applied (seed {seeds[0]}): {applied or 'not recorded'}.\n\n"
            + markdown_table(headers, table) + "\n\n" + "\n".join(lines) + "\n")


def plot(results: dict, out: Path) -> None:
    """Each model's mean perplexity with its seeds' range, against its total training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in results["rows"]:
        p = r["perplexity"]
        ax.errorbar([r["total_tokens"]], [p["mean"]], yerr=[[p["mean"] - p["min"]], [p["max"] - p["mean"]]],
                    fmt="o", capsize=4, label=f"{r['model']}: {fmt(p)}")
    ax.set_xlabel("total training tokens (warm start included)")
    ax.set_ylabel("held-out perplexity (mean, bars: the seeds' range)")
    ax.set_title(f"DiPaCo against DiLoCo and dense models, seeds {', '.join(map(str, results['seeds']))}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("names", nargs="+", help="bench_quality results names (without .json), one per seed")
    parser.add_argument("--name", required=True, help="the results name to write")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where the files are read and written")
    parser.add_argument("--point", default=None, metavar="ROUNDSxH",
                        help="the point of experiments/capacity.py results to read (default: their only one)")
    args = parser.parse_args()
    if len(args.names) < 2:
        parser.error("give at least two seeds' results")
    results_dir = Path(args.results_dir)
    records = {}
    for name in args.names:
        path = results_dir / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"{path}: no such results file (run bench/bench_quality.py --name {name} first)")
        record = json.loads(path.read_text())
        records[name] = capacity_point(record, args.point, name=name) if "points" in record else record
    results = aggregate(records)
    path = write_results(args.name, results, markdown(results), results_dir=results_dir, trained_at=trained_at(records))
    plot(results, path.with_suffix(".png"))
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
