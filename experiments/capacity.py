"""The capacity-bound regime (issue 10, item 5): DiPaCo ÷ dense-equal-compute against training tokens per parameter.

    python experiments/capacity.py                                  # the sweep (~45 min on 2 cores of its own)
    python experiments/capacity.py --points 2x100,4x125 --jobs 1    # some points: ROUNDSxH
    python experiments/capacity.py --collect-only                   # rewrite the results from finished runs
    python experiments/capacity.py --set ... --set corpus.router_fraction=0.05 --reroute-final   # discriminative router

At the demo's size every model sees under 2 training tokens per parameter and extra steps beat
everything: the dense path-size model given all the compute wins. Here the path model is tiny (by
default width 32, 2 blocks, a 1,024-token vocabulary, sequences of 128: about 66k parameters, half
of them the embedding) and each point of the sweep trains it longer, so that the dense model runs
out of capacity (many tokens per parameter, several epochs of the corpus) while DiPaCo, at the same
compute per token, holds more parameters (its paths' level modules and, with
`topology.private_embeddings`, each path's own embedding and head).

Each point `ROUNDSxH` is one `bench_quality.compare` at one budget, in its own folder
`<runs>/<ROUNDS>x<H>`: the demo recipe (configs/demo.yaml: a dense warm start of `--warm-fraction`
of the compute, base-model routing, DiLoCo's outer step) with `--set` (every model) and `--dipaco`
(DiPaCo only) overrides, ROUNDS rounds of H inner steps after the warm start; the dense path-size
models at equal steps and equal compute (warm start included); DiLoCo with P = paths replicas of the
path model (its own outer step, which is also DiPaCo's here), unless `--no-diloco`. Points run
`--jobs` at a time (largest first); each model's torch uses `--threads` threads (1: with 2 cores
shared, more threads than cores make every step several times slower).

Writes experiments/results/<name>.{json,md,png}: per point the perplexities, each model's training tokens,
parameters (in all and without the embedding), tokens per parameter and epochs of the corpus, the
ratio DiPaCo ÷ dense-equal-compute and DiPaCo against DiLoCo; the PNG plots the ratio against the
dense-equal-compute model's training tokens per parameter.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_quality import compare  # noqa: E402
from bench.quality_runs import Runner, read_json  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, write_results  # noqa: E402
from dipaco.config import Config, load_config  # noqa: E402

log = logging.getLogger("experiments.capacity")

# The tiny path model of the sweep (every model) and DiPaCo's extra capacity (DiPaCo only).
CAPACITY_SET = ["sharding.vocab_size=1024", "sharding.seq_len=128", "model.hidden_size=32", "model.n_layers=2",
                "model.n_heads=2", "hardware.precision=fp32"]
CAPACITY_DIPACO = ["topology.blocks_per_level=[1,1]", "topology.private_embeddings=true"]
DEFAULT_POINTS = "2x100,4x125,5x160,8x200,16x250"
MODES = ["prefix", "likelihood", "oracle"]


@dataclass(frozen=True)
class Point:
    """One budget of the sweep: `rounds` rounds of `inner_steps` after a `pretrain_steps` warm start."""

    rounds: int
    inner_steps: int
    pretrain_steps: int
    n_paths: int

    @property
    def name(self) -> str:
        return f"{self.rounds}x{self.inner_steps}"

    @property
    def total_steps(self) -> int:
        """Path-model steps in all (the dense-equal-compute model's steps): warm start + paths x rounds x H."""
        return self.pretrain_steps + self.n_paths * self.rounds * self.inner_steps

    def overrides(self) -> list[str]:
        return [f"run.rounds={self.rounds}", f"inner.steps={self.inner_steps}",
                f"warm_start.fraction={self.pretrain_steps / self.total_steps!r}"]  # exactly pretrain_steps


def parse_points(text: str) -> list[tuple[int, int]]:
    """`"2x100,4x125"` -> [(2, 100), (4, 125)] (ROUNDSxH), with a clear error for anything else."""
    points = []
    for item in text.split(","):
        rounds, sep, steps = item.strip().partition("x")
        if not sep or not rounds.isdigit() or not steps.isdigit() or int(rounds) < 1 or int(steps) < 1:
            raise ValueError(f"--points: {item.strip()!r} is not ROUNDSxH with both >= 1 (e.g. 4x125)")
        points.append((int(rounds), int(steps)))
    if len(set(points)) != len(points):
        raise ValueError(f"--points {text!r} names a point twice")
    return points


def plan(config: Config, points: list[tuple[int, int]], *, warm_fraction: float) -> list[Point]:
    """The sweep's points for DiPaCo's resolved `config`, largest first: the warm start is `warm_fraction`
    of each point's total compute (paths x rounds x H path-model steps after it)."""
    if not 0 <= warm_fraction < 1:
        raise ValueError(f"--warm-fraction must be in [0, 1), got {warm_fraction}")
    n_paths = config.topology.replicas
    for k in config.topology.levels:
        n_paths *= k
    out = []
    for rounds, inner_steps in points:
        grid = n_paths * rounds * inner_steps
        out.append(Point(rounds, inner_steps, round(grid * warm_fraction / (1 - warm_fraction)), n_paths))
    return sorted(out, key=lambda p: -p.total_steps)


def display_path(path: Path) -> str:
    """`path` relative to the repository when it lies inside it (results files name no local folders)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def embedding_parameters(config: Config) -> int:
    """Parameters of one embedding table (tied with the head): vocabulary x width."""
    return config.sharding.vocab_size * config.model.hidden_size


def corpus_train_tokens(run: Path) -> int:
    """Training tokens of the whole corpus: the warm start's single-path shards (0 without a warm start)."""
    index = read_json(run / "pretrain" / "shards" / "index.json")
    return sum(p["train"]["tokens"] for p in index.get("paths", []))


def summarise(point: Point, result: dict, *, embedding: int, corpus_tokens: int) -> dict:
    """Add each model's tokens per parameter and epochs, and the point's ratios, to `compare`'s result."""
    for row in result["rows"]:
        row["params_non_embedding"] = row["params_per_path"] - embedding
        row["tokens_per_param"] = row["total_tokens"] / row["params_total"]
        row["tokens_per_path_param"] = row["total_tokens"] / row["params_per_path"]
        row["epochs"] = row["total_tokens"] / corpus_tokens if corpus_tokens else None
    by = {r["kind"]: r for r in result["rows"]}
    dense = by["dense-equal-compute"]
    ours = by["dipaco-prefix"]["perplexity"]
    return {
        "point": point.name, "rounds": point.rounds, "inner_steps": point.inner_steps,
        "pretrain_steps": point.pretrain_steps, "total_steps": point.total_steps,
        "dense_tokens_per_param": dense["tokens_per_param"], "epochs": dense["epochs"],
        "dipaco": ours, "oracle": by.get("dipaco-oracle", {}).get("perplexity"),
        "dipaco_first_router": by.get("dipaco-prefix-before-reroute", {}).get("perplexity"),
        "dense_equal_compute": dense["perplexity"], "dense_equal_steps": by.get("dense-equal-steps", {}).get("perplexity"),
        "diloco": by.get("diloco", {}).get("perplexity"),
        "ratio": ours / dense["perplexity"],
        "dipaco_likelihood": by.get("dipaco-likelihood", {}).get("perplexity"),
        "ratio_likelihood": by["dipaco-likelihood"]["perplexity"] / dense["perplexity"]
        if "dipaco-likelihood" in by else None,
        "vs_diloco": 1 - ours / by["diloco"]["perplexity"] if "diloco" in by else None,
        "scored_tokens": result["scored_tokens"], "rows": result["rows"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="DiPaCo's config (the recipe)")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"override for every model (default: {' '.join(CAPACITY_SET)})")
    parser.add_argument("--dipaco", action="append", default=None, metavar="KEY=VALUE",
                        help=f"override for DiPaCo only (default: {' '.join(CAPACITY_DIPACO)})")
    parser.add_argument("--points", default=DEFAULT_POINTS, help=f"budgets as ROUNDSxH,... (default {DEFAULT_POINTS})")
    parser.add_argument("--warm-fraction", type=float, default=0.25,
                        help="share of each point's compute spent on the dense warm start (default 0.25)")
    parser.add_argument("--reroute-final", action="store_true",
                        help="after each point's last round, re-fit DiPaCo's router discriminatively (`dipaco reroute`; "
                             "needs --set corpus.router_fraction=...); the first router's perplexity is kept too")
    parser.add_argument("--no-diloco", action="store_true", help="skip DiLoCo (a third of the sweep's compute)")
    parser.add_argument("--jobs", type=int, default=2, help="points trained at once (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per training process (default 1)")
    parser.add_argument("--name", default="capacity", help="results name (default capacity)")
    parser.add_argument("--runs", default="", help="where the runs go (default runs/bench-<name>)")
    parser.add_argument("--keep", action="store_true", help="reuse finished stages of an earlier sweep")
    parser.add_argument("--collect-only", action="store_true",
                        help="train nothing: write the results from the finished points in --runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.jobs < 1 or args.threads < 1:
        parser.error(f"--jobs and --threads must be >= 1, got {args.jobs}, {args.threads}")
    set_ = CAPACITY_SET if args.set is None else args.set
    dipaco = CAPACITY_DIPACO if args.dipaco is None else args.dipaco
    config_file = Path(args.config)
    base = [*set_, f"hardware.threads_per_island={args.threads}", "eval.large_hidden_size=0", "eval.large_n_layers=0"]
    config = load_config(config_file, [*base, *dipaco])
    points = plan(config, parse_points(args.points), warm_fraction=args.warm_fraction)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # pretrain / eval processes (islands set theirs from the config)
    root = Path(args.runs or ROOT / "runs" / f"bench-{args.name}")
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    trained_at: list[dict] = []  # the code that trained each point's runs (an earlier invocation's with --keep)

    def run(point: Point) -> dict | None:
        runner = Runner(root / point.name, keep=args.keep or args.collect_only)
        try:
            result = compare(runner, config_file, [*base, *dipaco, *point.overrides()], diloco=not args.no_diloco,
                             diloco_dipaco_outer=False, modes=MODES, collect_only=args.collect_only,
                             reroute_after=(point.rounds,) if args.reroute_final else ())
        except (FileNotFoundError, KeyError, RuntimeError) as err:
            if not args.collect_only:
                raise
            log.warning("point %s is not finished (%s): left out", point.name, err)
            return None
        trained_at.extend(result["trained_at"])
        return summarise(point, result, embedding=embedding_parameters(config),
                         corpus_tokens=corpus_train_tokens(root / point.name / "dipaco"))

    with ThreadPoolExecutor(max_workers=1 if args.collect_only else args.jobs) as pool:
        summaries = [s for s in pool.map(run, points) if s is not None]
    summaries.sort(key=lambda s: s["total_steps"])
    results = {"points": summaries, "set": set_, "dipaco": dipaco, "warm_fraction": args.warm_fraction,
               "config": display_path(config_file), "threads": args.threads, "jobs": args.jobs,
               "embedding_params": embedding_parameters(config), "seconds": time.perf_counter() - started}
    path = write_results(args.name, results, markdown(results), results_dir=EXPERIMENT_RESULTS, trained_at=trained_at)
    plot(results, EXPERIMENT_RESULTS / f"{args.name}.png")
    print(path.with_suffix(".md").read_text())
    print(f"results in {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")


def markdown(results: dict) -> str:
    headers = ["point (rounds x H)", "warm-start steps", "path-model steps in all", "dense tokens / param", "epochs",
               "DiPaCo (prefix)", "oracle", "dense equal compute", "dense equal steps", "DiLoCo",
               "DiPaCo ÷ dense equal compute", "DiPaCo vs DiLoCo"]
    by_likelihood = any(p.get("dipaco_likelihood") for p in results["points"])
    if by_likelihood:  # the `likelihood` eval mode: the paths route by their own loss on the prefix
        headers[6:6] = ["DiPaCo, routed by the paths' likelihood", "its ÷ dense equal compute"]
    rerouted = any(p.get("dipaco_first_router") for p in results["points"])
    if rerouted:  # --reroute-final: DiPaCo (prefix) is routed by the discriminative router
        headers.insert(5, "DiPaCo, k-means router")
    table = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]

    def num(x, fmt=".2f"):
        return "-" if x is None else format(x, fmt)

    for p in results["points"]:
        vs = "-" if p["vs_diloco"] is None else f"{abs(100 * p['vs_diloco']):.1f}% " + (
            "lower" if p["vs_diloco"] >= 0 else "higher")
        table.append(f"| {p['point']} | {p['pretrain_steps']} | {p['total_steps']:,} | {p['dense_tokens_per_param']:.1f} | "
                     f"{num(p['epochs'])} | " + (f"{num(p.get('dipaco_first_router'))} | " if rerouted else "")
                     + f"{p['dipaco']:.2f} | "
                     + (f"{num(p.get('dipaco_likelihood'))} | {num(p.get('ratio_likelihood'), '.3f')} | "
                        if by_likelihood else "")
                     + f"{num(p['oracle'])} | {p['dense_equal_compute']:.2f} | "
                     f"{num(p['dense_equal_steps'])} | {num(p['diloco'])} | **{p['ratio']:.3f}** | {vs} |")
    models = []
    if results["points"]:
        first = results["points"][0]
        for r in first["rows"]:
            models.append(f"| {r['model']} | {r['params_per_path']:,} | {r['params_non_embedding']:,} | "
                          f"{r['params_total']:,} |")
    return (
        "# The capacity-bound regime: DiPaCo ÷ dense equal compute against tokens per parameter\n\n"
        f"`{results['config']}` with `{' '.join(results['set'])}` for every model and `{' '.join(results['dipaco'])}` "
        f"for DiPaCo; a dense warm start of {100 * results['warm_fraction']:.0f}% of each point's compute (counted in "
        "every model's budget). Perplexities on the same held-out tokens within a point "
        f"({', '.join(str(p['scored_tokens']) for p in results['points'])} scored tokens). Tokens per parameter: "
        "the dense-equal-compute model's training tokens over its parameters; epochs: those tokens over the "
        "corpus's training tokens. DiLoCo: P = paths replicas of the path model, its own outer step (DiPaCo's too).\n\n"
        + ("DiPaCo (prefix) is routed by the discriminative router re-fitted after the last round (`dipaco "
           "reroute` on the router split); the k-means column is the same models routed by the first router.\n\n"
           if rerouted else "")
        + "\n".join(table) + "\n\nParameters (the embedding is tied with the head, "
        f"{results['embedding_params']:,} a table):\n\n| model | per path / model | without the embedding | in all |\n"
        "|---|---|---|---|\n" + "\n".join(models)
        + f"\n\nWall time: {results['seconds'] / 60:.1f} min, {results['jobs']} points at a time, "
        f"{results['threads']} torch thread(s) per process.\n"
    )


def plot(results: dict, out: Path) -> None:
    """DiPaCo ÷ dense-equal-compute (and DiPaCo ÷ DiLoCo) against the dense model's tokens per parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["points"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    x = [p["dense_tokens_per_param"] for p in points]
    left.plot(x, [p["ratio"] for p in points], "o-", color="tab:red", label="DiPaCo ÷ dense equal compute")
    diloco = [(p["dense_tokens_per_param"], p["dipaco"] / p["diloco"]) for p in points if p["diloco"]]
    if diloco:
        left.plot(*zip(*diloco), "s--", color="tab:blue", label="DiPaCo ÷ DiLoCo (same compute, same outer bytes)")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.axhline(0.9, color="gray", linewidth=0.8, linestyle=":")
    for p in points:
        left.annotate(p["point"], (p["dense_tokens_per_param"], p["ratio"]), fontsize=7, textcoords="offset points",
                      xytext=(4, 4))
    left.set_xscale("log")
    left.set_xlabel("dense-equal-compute training tokens per parameter")
    left.set_ylabel("perplexity ratio")
    left.legend(fontsize=8)
    left.set_title("ratio at equal compute")
    for key, label, style in [("dipaco", "DiPaCo (prefix routing)", "o-"), ("dense_equal_compute", "dense equal compute", "^-"),
                              ("diloco", "DiLoCo", "s--"), ("dense_equal_steps", "dense equal steps", "v:")]:
        pts = [(p["dense_tokens_per_param"], p[key]) for p in points if p[key]]
        if pts:
            right.plot(*zip(*pts), style, label=label)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("dense-equal-compute training tokens per parameter")
    right.set_ylabel("held-out perplexity")
    right.legend(fontsize=8)
    right.set_title("perplexities")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
