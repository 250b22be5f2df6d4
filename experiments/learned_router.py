"""The k-means router, the learned router and likelihood routing on the same trained paths: perplexity,
routing cost in ms per prefix, and documents per path.

    OMP_NUM_THREADS=1 python experiments/learned_router.py --name learned-router-2x2 [--set key=value ...]
    python experiments/learned_router.py --name learned-router-2x2 --collect-only   # the results file again
    OMP_NUM_THREADS=1 python experiments/learned_router.py --preset grid --grid 8x8 --set run.seed=0 \
        --set hardware.threads_per_island=2 --name learned-router-8x8-seed0

One run of configs/demo.yaml at a reduced size (`--preset`, with a 5% router split): `2x2` (`REDUCED`) or
`grid`, bench/bench_grid_scaling.py's setting (`GRID`: its model, fp32, one island, its 400 warm-start
steps and the recipe's per-path steps) at the grid `--grid`. The stages run one by one (pretrain, route,
shard, train with the k-means router), then `dipaco eval` in the prefix (k-means), likelihood, oracle and
split-oracle modes, which keeps every path's loss on every held-out document and their prefix features
(eval-documents.json); then one discriminative phase after the last round (`dipaco reroute`,
`reroute.target=labels`: the learned router), scored on those losses and features (the `prefix` mode's
perplexity routed by it, with no forward pass; experiments/router_heads.py fits other heads the same way). Writes
experiments/results/<name>.{json,md} (`bench.recording`); the run stays in runs/<name>.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_grid_scaling import grid_levels  # noqa: E402
from bench.quality_runs import warm_start_steps_as_fraction  # noqa: E402
from bench.recording import EXPERIMENT_RESULTS, run_code, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.eval.document_losses import routed_perplexity  # noqa: E402
from experiments.router_heads import compare_heads, two_stage_cost  # noqa: E402
from routing.router import Router  # noqa: E402

REDUCED = ["sharding.seq_len=128", "model.hidden_size=64", "run.rounds=4", "inner.steps=25",
           "hardware.precision=fp32", "corpus.router_fraction=0.05", "eval.baselines=false", "eval.best=false",
           "eval.modes=[prefix,likelihood,oracle,oracle-split]"]
GRID = ["sharding.seq_len=128", "model.hidden_size=64", "hardware.precision=fp32", "hardware.islands=1",
        "corpus.router_fraction=0.05", "eval.baselines=false", "eval.best=false", "warm_start.steps=400",
        "eval.modes=[prefix,likelihood,oracle,oracle-split]"]
STAGES = ["pretrain", "route", "shard", "train"]


def dipaco(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, check=True)


def done_stages(run: Path) -> set[str]:
    """The stages this script has finished in `run` (stage-seconds.json), not run again on a restart."""
    record = run / "stage-seconds.json"
    return set(json.loads(record.read_text())) if record.exists() else set()


def timed(run: Path, step: str, *args: str) -> None:
    """`dipaco ARGS`, its wall seconds added to runs/<name>/stage-seconds.json under `step`."""
    started = time.perf_counter()
    dipaco(*args)
    record = run / "stage-seconds.json"
    seconds = json.loads(record.read_text()) if record.exists() else {}
    seconds[step] = time.perf_counter() - started
    record.write_text(json.dumps(seconds, indent=1))


def reroute(run: Path, common: list[str]) -> None:
    """`dipaco reroute` with `reroute.target=labels`. Its shards are not needed (the held-out documents were
    scored before it), so a phase that is recorded but whose shards were refused (a path the learned router
    gives no training document) still counts."""
    try:
        timed(run, "reroute", "reroute", *common, "reroute.target=labels")
    except subprocess.CalledProcessError:
        if not (run / "routing" / "phases.json").exists():
            raise
        print("reroute: the phase is recorded, its shards were refused (see above); the learned router is scored "
              "on eval-documents.json", file=sys.stderr)


def mode_perplexities(eval_json: Path) -> dict[str, float]:
    rows = json.loads(eval_json.read_text())["modes"]["rows"]
    return {row["mode"]: row["perplexity"] for row in rows if row["checkpoints"] == "last"}


def per_path(choice: np.ndarray, n_paths: int) -> dict:
    """Held-out documents per path under a routing: min / median / max and the paths with none."""
    counts = np.bincount(choice, minlength=n_paths)
    return {"min": int(counts.min()), "median": float(np.median(counts)), "max": int(counts.max()),
            "paths_with_none": int((counts == 0).sum())}


def test_routing(run: Path) -> dict:
    """Every routing of the held-out documents, from eval-documents.json (each path's loss on each document
    and its prefix features, from the eval with the k-means router): the k-means router (checked against
    eval.json's `prefix` row and against routing/phase-0 on the same features), the learned router (routing/,
    on the same features: the `prefix` mode's perplexity it would get), likelihood and the oracle path;
    perplexity, agreement with the oracle path and documents per path."""
    record = json.loads((run / "eval-documents.json").read_text())
    paths = np.asarray(record["paths"])
    features = np.asarray(record["features"], dtype=np.float32)
    kmeans = np.asarray(record["routed"])
    if record["router"] != "kmeans" or not np.array_equal(
            paths[Router.load(run / "routing" / "phase-0").path_costs(features).argmin(axis=1)], kmeans):
        raise SystemExit(f"{run / 'eval-documents.json'} is not the k-means router's (routing/phase-0) evaluation")
    choices = {"kmeans_router": kmeans,
               "learned_router": paths[Router.load(run / "routing").path_costs(features).argmin(axis=1)],
               "likelihood": paths[np.argmin(record["prefix_nll"], axis=1)],
               "oracle": paths[np.argmin(record["scored_nll"], axis=1)]}
    out = {name: {"perplexity": routed_perplexity(record, choice),
                  "agrees_with_oracle": float(np.mean(choice == choices["oracle"])),
                  "test_documents_per_path": per_path(choice, len(paths))} for name, choice in choices.items()}
    evaluated = mode_perplexities(run / "eval.json")
    for name, mode in (("kmeans_router", "prefix"), ("likelihood", "likelihood"), ("oracle", "oracle")):
        if not math.isclose(out[name]["perplexity"], evaluated[mode], rel_tol=1e-9):
            raise SystemExit(f"eval-documents.json gives {name} {out[name]['perplexity']}, eval.json {evaluated[mode]}")
    out["oracle_split"] = {"perplexity": evaluated["oracle-split"]}
    return out


def train_seconds(train: dict) -> float:
    """train.json's seconds; for a training stopped before its last round, the sum of its rounds'."""
    return train["seconds"] if "seconds" in train else sum(r["seconds"] for r in train["rounds"])


def collect(run: Path, overrides: list[str], seconds: float) -> dict:
    routed = test_routing(run)
    ppl = {name: r["perplexity"] for name, r in routed.items()}
    phase = json.loads((run / "routing" / "phases.json").read_text())[-1]
    k, learned, lik = ppl["kmeans_router"], ppl["learned_router"], ppl["likelihood"]
    return {
        "overrides": overrides,
        "perplexity": ppl,
        "gap_closed": (k - learned) / (k - lik) if k != lik else None,
        "learned_over_split_oracle": learned / ppl["oracle_split"] - 1,
        "test_routing": routed,
        "routing_cost": phase["routing_cost"],
        "balance": phase["balance"],
        "router_documents": phase["router_documents"],
        "label_sizes": phase["label_sizes"],
        "label_agrees_with_kmeans": phase["label_agrees_with_previous_router"],
        "fit_accuracy": phase["fit"]["accuracy"],
        "round": json.loads((run / "eval.json").read_text())["round"],
        "rounds": load_config(run / "config.yaml").run.rounds,
        "heads": compare_heads(run),
        "two_stage_cost": two_stage_cost(run),
        "stage_seconds": json.loads((run / "stage-seconds.json").read_text()),
        "train_seconds": train_seconds(json.loads((run / "train.json").read_text())),
        "seconds": seconds,
    }


def routing_rows(r: dict) -> list[str]:
    """The table of routings: perplexity, agreement with the oracle path, documents per path, cost."""
    cost, bal, routed = r["routing_cost"], r["balance"], r["test_routing"]
    lines = ["| routing | perplexity | agrees with the oracle path | held-out docs per path min / median / max "
             "(paths with none) | ms per prefix (featurize + pick) | train docs per path min / median / max "
             "| entropy (bits) |", "|---|---|---|---|---|---|---|"]
    for name, key, cost_key in (("k-means router", "kmeans_router", "previous"), ("learned router", "learned_router", "new"),
                                ("likelihood (every path reads the prefix)", "likelihood", None),
                                ("oracle path (in sample)", "oracle", None)):
        t, d = routed[key], routed[key]["test_documents_per_path"]
        cells = [name, f"{t['perplexity']:.2f}", f"{t['agrees_with_oracle']:.1%}",
                 f"{d['min']} / {d['median']:g} / {d['max']} ({d['paths_with_none']})"]
        if cost_key:
            c, b = cost[cost_key], bal[cost_key]
            cells += [f"{c['ms_per_document']:.3f} ({c['featurize_ms_per_document']:.3f} + "
                      f"{c['assign_ms_per_document']:.4f})", f"{b['min']} / {b['median']:g} / {b['max']}",
                      f"{b['entropy_bits']:.2f} of {b['max_entropy_bits']:.2f}"]
        else:
            cells += ["not timed" if key == "likelihood" else "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"| split oracle (chosen on one half, scores the other) | {routed['oracle_split']['perplexity']:.2f} "
                 "| | | | | |")
    return lines


def heads_rows(heads: dict, kmeans: float, likelihood: float) -> list[str]:
    lines = ["| head | perplexity | gap closed | agrees with the oracle path | held-out docs per path min / median / max "
             "(none) | train docs per path min / median / max, entropy (bits) |", "|---|---|---|---|---|---|"]
    for name, h in heads.items():
        d, b = h["test_documents_per_path"], h.get("train_balance")
        train = f"{b['min']} / {b['median']:g} / {b['max']}, {b['entropy_bits']:.2f}" if b else "-"
        lines.append(f"| {name} | {h['perplexity']:.2f} | {(kmeans - h['perplexity']) / (kmeans - likelihood):.0%} "
                     f"| {h['agrees_with_oracle']:.1%} | {d['min']} / {d['median']:g} / {d['max']} ({d['paths_with_none']}) "
                     f"| {train} |")
    return lines


def markdown(r: dict) -> str:
    p, cost = r["perplexity"], r["routing_cost"]
    gap = "n/a" if r["gap_closed"] is None else f"{r['gap_closed']:.0%}"
    sizes = np.asarray(r["label_sizes"])
    lines = [f"# Learned router vs k-means vs likelihood routing ({r['seconds'] / 60:.0f} min of stages)", "",
             f"{r['config']} + {' '.join(r['overrides'])}; one seed; modules of round {r['round']} of "
             f"{r['rounds']}; the learned router is one `dipaco reroute` phase after it (`reroute.target=labels`); "
             f"one `dipaco eval` scores every path on every held-out document (eval-documents.json), and the k-means "
             "router (routing/phase-0) is scored on the same losses and prefix features.", "",
             *routing_rows(r), "",
             f"- gap between k-means and likelihood routing closed by the learned router: {gap}; the learned router is "
             f"{r['learned_over_split_oracle']:+.1%} from the split oracle",
             f"- learned / k-means routing cost: {cost['new_over_previous']:.2f}x (the same featurizer; picking the "
             f"path costs {cost['previous']['assign_ms_per_document']:.4f} ms (k-means) and "
             f"{cost['new']['assign_ms_per_document']:.4f} ms (learned) per prefix; the rest is the load of the "
             "shared machine between the two timings)",
             f"- {r['router_documents']} router documents; labels per path min / median / max {sizes.min()} / "
             f"{np.median(sizes):g} / {sizes.max()} ({int((sizes == 0).sum())} paths with none); labels agree with "
             f"k-means on {r['label_agrees_with_kmeans']:.1%}; the head predicts the label of {r['fit_accuracy']:.1%} "
             "of them",
             f"- wall seconds per stage: {', '.join(f'{k} {v:.0f}' for k, v in r['stage_seconds'].items())}; "
             f"training {r['train_seconds']:.0f} s (train.json)"]
    if r.get("heads"):
        lines += ["", "## Heads fitted again on the same losses (experiments/router_heads.py, no forward pass)", "",
                  "Gap closed: of the gap between the k-means router and likelihood routing above. The two-stage "
                  "routers read the prefix with k paths more (about k more featurize passes: each path model is the "
                  "warm start's size) and have no training-document column.", "",
                  *heads_rows(r["heads"], p["kmeans_router"], p["likelihood"])]
    if r.get("two_stage_cost"):
        t = r["two_stage_cost"]
        lines += ["", f"Two-stage cost, timed back to back on {t['documents']} router-split prefixes: the k-means router "
                  f"{t['kmeans_featurize_ms'] + t['kmeans_assign_ms']:.3f} ms per prefix (featurize "
                  f"{t['kmeans_featurize_ms']:.3f} + pick {t['kmeans_assign_ms']:.4f}); one path's forward pass on the "
                  f"prefix tokens {t['path_prefix_pass_ms']:.3f} ms; so k candidates cost "
                  + ", ".join(f"{ratio:.2f}x (k={k})" for k, ratio in t["cost_over_kmeans"].items())
                  + " the k-means router (the learned head's pick costs about the k-means one's)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="learned-router-2x2")
    parser.add_argument("--preset", choices=["2x2", "grid"], default="2x2",
                        help="2x2: REDUCED (4 rounds of 25 steps); grid: bench_grid_scaling.py's setting")
    parser.add_argument("--grid", default="8x8", help="with --preset grid: topology.levels, e.g. 8x8")
    parser.add_argument("--config", default="configs/demo.yaml", help="the recipe")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--collect-only", action="store_true", help="write the results file from the kept run")
    args = parser.parse_args()
    run = ROOT / "runs" / args.name
    if args.preset == "grid":
        overrides = warm_start_steps_as_fraction(
            ROOT / args.config, [*GRID, f"topology.levels={grid_levels(args.grid)}", *args.set])
    else:
        overrides = [*REDUCED, *args.set]
    common = ["--config", args.config, "--run", str(run), *overrides]
    if not args.collect_only:
        warm = load_config(ROOT / args.config, overrides).pretrain_steps
        for stage in STAGES:
            if stage not in done_stages(run) and (stage != "pretrain" or warm):
                timed(run, stage, stage, *common)
        if "eval" not in done_stages(run):
            timed(run, "eval", "eval", *common)
        if not (run / "routing" / "phases.json").exists():
            reroute(run, common)
        (run / "wall-seconds.json").write_text(json.dumps(sum(json.loads((run / "stage-seconds.json").read_text()).values())))
    result = {"config": args.config, **collect(run, overrides, json.loads((run / "wall-seconds.json").read_text()))}
    write_results(args.name, result, markdown(result), results_dir=EXPERIMENT_RESULTS, trained_at=run_code(run))
    print(markdown(result))


if __name__ == "__main__":
    main()
