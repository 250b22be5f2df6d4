"""The learned router at 8x8 over seeds: mean and spread of every routing, its gap closed and its cost.

    python experiments/learned_router_seeds.py --seeds 0,1,2 --name learned-router-8x8-seeds

Reads experiments/results/learned-router-8x8-seed<N>.json (experiments/learned_router.py) and, where present,
router-labels-8x8-seed<N>.json (experiments/router_labels.py). Per routing: each seed's perplexity, the mean
and standard deviation, the gap between the k-means router and likelihood routing it closes (on the means and
per seed), and its cost per prefix over the k-means router's: measured (the two-stage routers from the path's
timed forward pass) and counted in multiply-accumulates per token of the model shapes (the path's 4096-token
output layer is a cost the featurizer does not pay). Quotable only when every file it reads is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import EXPERIMENT_RESULTS, quotable, write_results  # noqa: E402

PIPELINE = {"k-means router": "kmeans_router", "learned router (logistic head, the pipeline's)": "learned_router",
            "likelihood (every path reads the prefix)": "likelihood", "oracle path (in sample)": "oracle",
            "split oracle": "oracle_split"}
HEADS = {"ridge head on every path's loss": "regression", "k-means top 2, then likelihood": "k-means top 2, then likelihood",
         "k-means top 4, then likelihood": "k-means top 4, then likelihood"}
LABELS = {"ridge head, every window": ("every window", "mean last layer", "regression"),
          "nearest neighbours + k-means, first windows": ("first windows", "mean last layer", "nearest neighbours + k-means"),
          "nearest neighbours + k-means, every window": ("every window", "mean last layer", "nearest neighbours + k-means")}


def macs_per_token(hf_config: dict) -> tuple[float, float]:
    """(the featurizer's blocks, a path's blocks + output layer) multiply-accumulates per token (Llama shapes:
    q, k, v, o projections and the SwiGLU MLP per block; attention over a 32-token prefix is under 2% and left out)."""
    h, i, v, n = (hf_config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    kv = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]) * hf_config.get("head_dim", h // hf_config["num_attention_heads"])
    blocks = n * (2 * h * h + 2 * h * kv + 3 * h * i)
    return float(blocks), float(blocks + h * v)


def perplexities(seed_record: dict, labels: dict | None) -> dict[str, float]:
    out = {name: seed_record["perplexity"][key] for name, key in PIPELINE.items()}
    out.update({name: seed_record["heads"][key]["perplexity"] for name, key in HEADS.items()})
    if labels is not None:
        for name, (examples, features, head) in LABELS.items():
            out[name] = next(r["perplexity"] for r in labels["rows"]
                             if (r["examples"], r["features"], r["head"]) == (examples, features, head))
    return out


def costs(seed_record: dict, macs: tuple[float, float]) -> dict[str, tuple[float, float]]:
    """{routing: (measured cost over the k-means router, counted)}: a head on the k-means features costs its
    featurize pass; k candidates add k path passes on the prefix; likelihood is 64 path passes."""
    t = seed_record["two_stage_cost"]
    counted_pass = macs[1] / macs[0]
    same_features = (seed_record["routing_cost"]["new_over_previous"], 1.0)  # the learned head's pick, timed
    out = {name: same_features for name in [*LABELS, "ridge head on every path's loss",
                                            "learned router (logistic head, the pipeline's)"]}
    out["k-means router"] = (1.0, 1.0)
    for k in (2, 4):
        out[f"k-means top {k}, then likelihood"] = (t["cost_over_kmeans"][str(k)], 1 + k * counted_pass)
    base = t["kmeans_featurize_ms"] + t["kmeans_assign_ms"]
    out["likelihood (every path reads the prefix)"] = (64 * t["path_prefix_pass_ms"] / base, 64 * counted_pass)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--name", default="learned-router-8x8-seeds")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="where the runs are (for the model shape)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    files = {s: EXPERIMENT_RESULTS / f"learned-router-8x8-seed{s}.json" for s in seeds}
    label_files = {s: EXPERIMENT_RESULTS / f"router-labels-8x8-seed{s}.json" for s in seeds}
    records = {s: json.loads(f.read_text()) for s, f in files.items()}
    labels = {s: json.loads(f.read_text()) if f.exists() else None for s, f in label_files.items()}
    hf = json.loads((args.runs / f"learned-router-8x8-seed{seeds[0]}" / "pretrain" / "hf" / "config.json").read_text())
    macs = macs_per_token(hf)
    per_seed = {s: perplexities(records[s], labels[s]) for s in seeds}
    names = [n for n in per_seed[seeds[0]] if all(n in per_seed[s] for s in seeds)]
    rows = {}
    for name in names:
        values = [per_seed[s][name] for s in seeds]
        gaps = [(per_seed[s]["k-means router"] - per_seed[s][name])
                / (per_seed[s]["k-means router"] - per_seed[s]["likelihood (every path reads the prefix)"]) for s in seeds]
        rows[name] = {"perplexity": values, "mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                      "gap_closed": gaps, "cost": [costs(records[s], macs).get(name) for s in seeds]}
    mean = {n: r["mean"] for n, r in rows.items()}
    for r in rows.values():
        r["gap_closed_on_means"] = (mean["k-means router"] - r["mean"]) / (
            mean["k-means router"] - mean["likelihood (every path reads the prefix)"])
    result = {"seeds": seeds, "files": [str(f.relative_to(ROOT)) for f in files.values()],
              "quotable": all(quotable(json.loads(f.read_text())) for f in [*files.values(), *(f for f in label_files.values() if f.exists())]),
              "macs_per_token": {"featurizer": macs[0], "path": macs[1]}, "model_shape": hf, "rows": rows}
    write_results(args.name, result, markdown(result), results_dir=EXPERIMENT_RESULTS)
    print(markdown(result))


def markdown(r: dict) -> str:
    m = r["macs_per_token"]
    lines = [f"# The learned router at 8x8: {len(r['seeds'])} seeds (seeds {', '.join(map(str, r['seeds']))})", "",
             "Each routing's perplexity on the same held-out documents, per seed and mean ± std; gap closed: of the "
             "gap between the k-means router and likelihood routing (on the means; per seed in brackets); cost: per "
             "prefix over the k-means router's, measured (mean over seeds) / counted in multiply-accumulates per "
             f"token (featurizer {m['featurizer']:,.0f}, a path {m['path']:,.0f}: its output layer is "
             f"{1 - m['featurizer'] / m['path']:.0%} of it). Files: {', '.join(r['files'])}.", "",
             "| routing | " + " | ".join(f"seed {s}" for s in r["seeds"]) + " | mean ± std | gap closed | cost measured / counted |",
             "|---|" + "---|" * len(r["seeds"]) + "---|---|---|"]
    for name, row in r["rows"].items():
        measured = [c for c in row["cost"] if c is not None]
        cost = (f"{statistics.fmean(c[0] for c in measured):.2f}x / {measured[0][1]:.2f}x" if measured else "")
        gaps = ", ".join(f"{g:+.0%}" for g in row["gap_closed"])
        lines.append(f"| {name} | " + " | ".join(f"{p:.2f}" for p in row["perplexity"])
                     + f" | {row['mean']:.2f} ± {row['std']:.2f} | {row['gap_closed_on_means']:+.0%} ({gaps}) | {cost} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
