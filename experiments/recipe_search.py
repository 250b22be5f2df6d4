"""The DiPaCo recipe search (issue 10, item 4): each lever measured at one reduced budget, same compute.

    python experiments/recipe_search.py                         # every variant not run yet (~2-4 min each)
    python experiments/recipe_search.py --only base,paper-outer  # some variants
    python experiments/recipe_search.py --list                   # the variants and their overrides

Every variant is configs/demo.yaml with the reduced model of `REDUCED` (sequences of 128 tokens, width
64, 4 blocks; 8 rounds x 25 inner steps of batch 8 for a 2x2 grid) plus its own overrides, and spends
the same training compute: paths x rounds x inner steps + warm-start steps = 800 path-model steps (a
dense warm start of 25% = 200 pretrain steps, then 6 rounds). The `base` variant also trains the
dense path-size baselines at equal steps (200) and equal compute (800, from scratch); every variant's
routed perplexity (prefix routing, last round) is divided by that dense-equal-compute perplexity.
All score the same held-out tokens (same tokenizer and test split).

Runs go to runs/recipe-search/<variant> and are kept: a later call only runs the variants that have
no eval.json yet and rewrites experiments/results/recipe-search.{json,md} with every finished variant.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quality_runs import (  # noqa: E402
    Runner,
    mode_perplexity,
    pretrain_summary,
    read_json,
    warm_start_steps_as_fraction,
)
from bench.recording import EXPERIMENT_RESULTS, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402

log = logging.getLogger("experiments.recipe_search")

# The reduced model and budget, and the recipe every variant starts from (the demo's before this search:
# plain averaging, TF-IDF flat k-means routing, no warm start), pinned so that the search does not move
# when configs/demo.yaml takes its findings.
REDUCED = ["sharding.seq_len=128", "model.hidden_size=64", "run.rounds=8", "inner.steps=25",
           "hardware.precision=fp32", "warm_start.steps=0", "routing.featurizer=tfidf",
           "outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false",
           "topology.private_embeddings=false", "inner.schedule=cosine", "warm_start.continue_optimizer=false", "outer.decay=keep"]
PAPER_OUTER = ["outer.lr=0.7", "outer.momentum=0.9", "outer.nesterov=true", "outer.rescale_by_paths=true"]
DILOCO_OUTER = ["outer.lr=0.7", "outer.momentum=0.9", "outer.nesterov=true", "outer.rescale_by_paths=false"]
WARM25 = ["warm_start.steps=200", "run.rounds=6", "routing.featurizer=base-model"]
WARM50 = ["warm_start.steps=400", "run.rounds=4", "routing.featurizer=base-model"]
H10_AFTER_WARM50 = ["inner.steps=10", "run.rounds=10"]  # 400 + 4 paths x 10 rounds x 10 steps = 800
W50_H10 = [*WARM50, *DILOCO_OUTER, *H10_AFTER_WARM50]  # round 3's best, the demo's recipe since
WSD_ADAM = ["inner.schedule=wsd", "warm_start.continue_optimizer=true"]  # round 4's schedule

# name -> (what it tests, overrides on top of configs/demo.yaml + REDUCED). Each spends 800 path-model steps.
# `warm_start.steps=N`: a warm start of N steps, written as its fraction of the run (warm_start_steps_as_fraction).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "base": ("plain averaging, TF-IDF flat k-means, H 25, from random init (the demo before this search)", []),
    "paper-outer": ("Nesterov lr 0.7 / momentum 0.9, sqrt(paths) rescale (the paper's outer step)", PAPER_OUTER),
    "paper-outer-all": ("the paper's outer step with alpha normalised over all paths (outer.normalize all)",
                        [*PAPER_OUTER, "outer.normalize=all"]),
    "diloco-outer": ("Nesterov lr 0.7 / momentum 0.9, no rescale (DiLoCo's outer step)", DILOCO_OUTER),
    "outer-lr0.5-m0.5": ("gentler Nesterov: lr 0.5, momentum 0.5, no rescale",
                         ["outer.lr=0.5", "outer.momentum=0.5", "outer.rescale_by_paths=false"]),
    "H10": ("H = 10 inner steps, 20 rounds", ["inner.steps=10", "run.rounds=20"]),
    "H50": ("H = 50 inner steps, 4 rounds", ["inner.steps=50", "run.rounds=4"]),
    "warm25-tfidf": ("25% dense warm start (200 steps, then 6 rounds), TF-IDF routing",
                     ["warm_start.steps=200", "run.rounds=6"]),
    "warm25": ("25% dense warm start, then routing on the warm-start model's features (base-model)", WARM25),
    "warm50": ("50% dense warm start (400 steps, then 4 rounds), base-model routing",
               ["warm_start.steps=400", "run.rounds=4", "routing.featurizer=base-model"]),
    "warm75": ("75% dense warm start (600 steps, then 2 rounds), base-model routing",
               ["warm_start.steps=600", "run.rounds=2", "routing.featurizer=base-model"]),
    "warm25-paper-outer": ("25% warm start, base-model routing, the paper's outer step", [*WARM25, *PAPER_OUTER]),
    "warm25-paper-outer-all": ("25% warm start, base-model routing, the paper's outer step normalised over all paths",
                               [*WARM25, *PAPER_OUTER, "outer.normalize=all"]),
    "warm25-diloco-outer": ("25% warm start, base-model routing, DiLoCo's outer step", [*WARM25, *DILOCO_OUTER]),
    "private-emb": ("path-private embeddings / head / final norm", ["topology.private_embeddings=true"]),
    "private-last-block": ("the last block private to each path", ["topology.private_blocks=[3]"]),
    "top2": ("every training document on its 2 best paths (routing.train_top_k 2)", ["routing.train_top_k=2"]),
    "balance": ("balanced routing (largest / smallest path <= 1.1)", ["routing.balance=1.1"]),
    "grid-2x4": ("2x4 grid (8 paths), 4 rounds", ["topology.levels=[2,4]", "run.rounds=4"]),
    "grid-4x4": ("4x4 grid (16 paths), 4 rounds of H 12 (768 steps: 4% less compute)",
                 ["topology.levels=[4,4]", "run.rounds=4", "inner.steps=12"]),
    "warm25-private-emb": ("25% warm start, base-model routing, private embeddings",
                           [*WARM25, "topology.private_embeddings=true"]),
    "warm25-top2": ("25% warm start, base-model routing, train_top_k 2", [*WARM25, "routing.train_top_k=2"]),
    # Round 2: one lever at a time on top of round 1's best, warm25-diloco-outer (WARM25 + DILOCO_OUTER).
    # inner.lr is also the warm start's lr (dipaco pretrain trains with the inner recipe).
    "wdo-lr6e-3": ("warm25-diloco-outer with inner lr 6e-3 (warm start's too)", [*WARM25, *DILOCO_OUTER, "inner.lr=0.006"]),
    "wdo-lr1.5e-3": ("warm25-diloco-outer with inner lr 1.5e-3 (warm start's too)",
                     [*WARM25, *DILOCO_OUTER, "inner.lr=0.0015"]),
    "wdo-outer-lr1.0": ("warm25-diloco-outer with outer lr 1.0 (momentum 0.9)", [*WARM25, *DILOCO_OUTER, "outer.lr=1.0"]),
    "wdo-outer-lr0.5": ("warm25-diloco-outer with outer lr 0.5 (momentum 0.9)", [*WARM25, *DILOCO_OUTER, "outer.lr=0.5"]),
    "warm50-diloco-outer": ("50% warm start (400 steps, then 4 rounds), base-model routing, DiLoCo's outer step",
                            [*WARM50, *DILOCO_OUTER]),
    "wdo-private-emb": ("warm25-diloco-outer with path-private embeddings / head / final norm",
                        [*WARM25, *DILOCO_OUTER, "topology.private_embeddings=true"]),
    "wdo-private-last-block": ("warm25-diloco-outer with the last block private to each path",
                               [*WARM25, *DILOCO_OUTER, "topology.private_blocks=[3]"]),
    "wdo-H10": ("warm25-diloco-outer with H = 10, 15 rounds", [*WARM25, *DILOCO_OUTER, "inner.steps=10", "run.rounds=15"]),
    "wdo-top2": ("warm25-diloco-outer with train_top_k 2", [*WARM25, *DILOCO_OUTER, "routing.train_top_k=2"]),
    "wdo-balance": ("warm25-diloco-outer with balanced routing (largest / smallest path <= 1.1)",
                    [*WARM25, *DILOCO_OUTER, "routing.balance=1.1"]),
    # Round 3: round 2's winners (50% warm start, H = 10, outer lr 1.0) combined, and a 75% warm start.
    "w50-H10": ("50% warm start, DiLoCo's outer step, H = 10 (10 rounds)", [*WARM50, *DILOCO_OUTER, *H10_AFTER_WARM50]),
    "w50-olr1.0": ("50% warm start, DiLoCo's outer step with outer lr 1.0", [*WARM50, *DILOCO_OUTER, "outer.lr=1.0"]),
    "w50-H10-olr1.0": ("50% warm start, H = 10 (10 rounds), outer lr 1.0",
                       [*WARM50, *DILOCO_OUTER, *H10_AFTER_WARM50, "outer.lr=1.0"]),
    "warm75-diloco-outer": ("75% warm start (600 steps, then 2 rounds), base-model routing, DiLoCo's outer step",
                            ["warm_start.steps=600", "run.rounds=2", "routing.featurizer=base-model", *DILOCO_OUTER]),
    "w75-H10": ("75% warm start (600 steps), DiLoCo's outer step, H = 10 (5 rounds)",
                ["warm_start.steps=600", "run.rounds=5", "routing.featurizer=base-model", *DILOCO_OUTER,
                 "inner.steps=10"]),
    "w50-H5": ("50% warm start, DiLoCo's outer step, H = 5 (20 rounds)",
               [*WARM50, *DILOCO_OUTER, "inner.steps=5", "run.rounds=20"]),
    # The seed's share of the differences: the control and round 3's best again with another seed.
    "warm25-diloco-outer-seed1": ("warm25-diloco-outer with run.seed 1 (init and data order)",
                                  [*WARM25, *DILOCO_OUTER, "run.seed=1"]),
    "w50-H10-seed1": ("w50-H10 with run.seed 1 (init and data order)",
                      [*WARM50, *DILOCO_OUTER, *H10_AFTER_WARM50, "run.seed=1"]),
    # Round 4: on top of w50-H10, one warmup-stable-decay schedule across the warm start and what continues
    # it (no second warmup, one decay at the end), and the path-private modules of the paper's best row.
    "w50-H10-wsd": ("w50-H10 with inner.schedule wsd (warm start at the constant lr, paths decay over the last 20%)",
                    [*W50_H10, "inner.schedule=wsd"]),
    "w50-H10-wsd-adam": ("w50-H10-wsd, the paths continuing the warm start's AdamW state (warm_start.continue_optimizer)",
                         [*W50_H10, *WSD_ADAM]),
    "w25-H10-wsd-adam": ("w50-H10-wsd-adam with a 25% warm start (200 steps, then 15 rounds of H = 10)",
                         [*WARM25, *DILOCO_OUTER, "inner.steps=10", "run.rounds=15", *WSD_ADAM]),
    "w50-H25-wsd-adam": ("w50-H10-wsd-adam with H = 25 (4 rounds: 2.5x fewer outer steps)",
                         [*WARM50, *DILOCO_OUTER, *WSD_ADAM]),
    "w50-H10-wsd-adam-private-emb": ("w50-H10-wsd-adam with path-private embeddings / head / final norm",
                                     [*W50_H10, *WSD_ADAM, "topology.private_embeddings=true"]),
    "w50-H10-private-emb": ("w50-H10 with path-private embeddings / head / final norm",
                            [*W50_H10, "topology.private_embeddings=true"]),
    "w50-H10-private-last-block": ("w50-H10 with the last block private to each path",
                                   [*W50_H10, "topology.private_blocks=[3]"]),
    # Round 5: the outer step under the wsd schedule. Nesterov's momentum (0.9: about ten rounds of memory)
    # keeps moving the modules by the stable phase's steps while the inner lr anneals; plain averaging
    # throughout, and Nesterov until the decay then plain averaging (outer.decay: average).
    "w50-H10-wsd-adam-avg": ("w50-H10-wsd-adam with plain averaging (outer lr 1, momentum 0)",
                             [*W50_H10, *WSD_ADAM, "outer.lr=1.0", "outer.momentum=0.0"]),
    "w25-H10-wsd-adam-avg": ("w25-H10-wsd-adam with plain averaging (outer lr 1, momentum 0)",
                             [*WARM25, *DILOCO_OUTER, "inner.steps=10", "run.rounds=15", *WSD_ADAM,
                              "outer.lr=1.0", "outer.momentum=0.0"]),
    "w25-H10-wsd-adam-decay-avg": ("w25-H10-wsd-adam, plain averaging from the round that reaches the inner decay "
                                   "(outer.decay: average; Nesterov before)",
                                   [*WARM25, *DILOCO_OUTER, "inner.steps=10", "run.rounds=15", *WSD_ADAM,
                                    "outer.decay=average"]),
    "w50-H25-wsd-adam-decay-avg": ("w50-H25-wsd-adam with outer.decay: average (every round in the decay: averaging)",
                                   [*WARM50, *DILOCO_OUTER, *WSD_ADAM, "outer.decay=average"]),
    "w50-H10-wsd-adam-decay-avg-private-emb": ("the demo's recipe (w50-H10-wsd-adam, outer.decay: average) with "
                                               "path-private embeddings / head / final norm",
                                               [*W50_H10, *WSD_ADAM, "outer.decay=average",
                                                "topology.private_embeddings=true"]),
    # Round 6: what else the paths can own on top of round 5's best (path-private embeddings), and whether a
    # longer path phase (a 25% warm start) or more, shorter paths (2x4 at the same compute) use them better.
    "w25-H10-decay-avg-private-emb": ("w25-H10-wsd-adam-decay-avg with path-private embeddings / head / final norm",
                                      [*WARM25, *DILOCO_OUTER, "inner.steps=10", "run.rounds=15", *WSD_ADAM,
                                       "outer.decay=average", "topology.private_embeddings=true"]),
    "w50-H10-decay-avg-private-emb-last-block": ("w50-H10-wsd-adam-decay-avg-private-emb with the last block "
                                                 "private to each path too",
                                                 [*W50_H10, *WSD_ADAM, "outer.decay=average",
                                                  "topology.private_embeddings=true", "topology.private_blocks=[3]"]),
    "w50-H10-decay-avg-private-emb-2x4": ("w50-H10-wsd-adam-decay-avg-private-emb on a 2x4 grid (8 paths, 5 rounds: "
                                          "the same compute)",
                                          [*W50_H10, *WSD_ADAM, "outer.decay=average",
                                           "topology.private_embeddings=true", "topology.levels=[2,4]", "run.rounds=5"]),
}
ROUND1 = list(VARIANTS)[:list(VARIANTS).index("wdo-lr6e-3")]  # defined in round 1 (results kept: see collect)
ROUND3 = list(VARIANTS)[list(VARIANTS).index("w50-H10"):list(VARIANTS).index("w50-H10-wsd")]
ROUND4 = list(VARIANTS)[list(VARIANTS).index("w50-H10-wsd"):list(VARIANTS).index("w50-H10-wsd-adam-avg")]
ROUND5 = list(VARIANTS)[list(VARIANTS).index("w50-H10-wsd-adam-avg"):list(VARIANTS).index("w25-H10-decay-avg-private-emb")]
ROUND6 = list(VARIANTS)[list(VARIANTS).index("w25-H10-decay-avg-private-emb"):]
MODES = ["prefix"]  # every:64 and oracle score every document with every path: 4x the eval time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--only", default="", help="comma-separated variants to run (default: all not yet run)")
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "recipe-search"), help="where the runs go")
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs first")
    parser.add_argument("--skip-base", action="store_true",
                        help="do not run `base` first (another invocation runs it into the same --runs)")
    args = parser.parse_args()
    if args.list:
        for name, (what, overrides) in VARIANTS.items():
            print(f"{name:22s} {what}\n{'':22s} {' '.join(overrides) or '(none)'}")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    only = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(only) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; --list shows them")
    runner = Runner(Path(args.runs), keep=not args.fresh)
    config_file = ROOT / "configs" / "demo.yaml"
    first = [] if args.skip_base else ["base"]
    for name in [*first, *[n for n in only if n != "base"]]:  # base first: its tokenizer and baselines
        _, overrides = VARIANTS[name]
        started = time.perf_counter()
        run = runner.pipeline(name, config_file, warm_start_steps_as_fraction(config_file, [*REDUCED, *overrides]),
                              baselines=name == "base", modes=MODES)
        timing = run / "bench-seconds.txt"
        if not timing.exists():
            timing.write_text(f"{time.perf_counter() - started:.1f}\n")
    if not (Path(args.runs) / "base" / "eval.json").exists():
        log.info("base has not finished: run the collecting call once it has")
        return
    results = collect(Path(args.runs), config_file)
    path = write_results("recipe-search", results, markdown(results), results_dir=EXPERIMENT_RESULTS)
    print(path.with_suffix(".md").read_text())


def collect(runs: Path, config_file: Path) -> dict:
    base = read_json(runs / "base" / "eval.json")
    dense = {m["model"]: m["perplexity"] for m in base["models"][1:]}
    reference = dense["dense-equal-compute"]
    rows = []
    for name, (what, overrides) in VARIANTS.items():
        ev = read_json(runs / name / "eval.json")
        if not ev:
            continue
        config = load_config(config_file, warm_start_steps_as_fraction(config_file, [*REDUCED, *overrides]))
        routed = ev["models"][0]
        pre = pretrain_summary(runs / name)
        steps = routed["steps_per_path"] * routed["paths"] + pre.get("steps", 0)
        prefix = mode_perplexity(ev, "prefix") or routed["perplexity"]
        oracle = mode_perplexity(ev, "oracle")
        seconds = (runs / name / "bench-seconds.txt")
        rows.append({
            "variant": name, "what": what, "overrides": overrides, "paths": routed["paths"],
            "path_model_steps": steps, "pretrain_steps": pre.get("steps", 0),
            "params_per_path": routed["params_per_path"], "params_total": routed["params_total"],
            "perplexity": prefix, "every64": mode_perplexity(ev, "every:64"), "oracle": oracle,
            "oracle_gap": prefix / oracle - 1 if oracle else None,
            "ratio_dense_equal_compute": prefix / reference,
            "gain_vs_base": None, "routing_agreement": ev.get("routing_agrees_with_shards"),
            "outer": {k: getattr(config.outer, k)
                      for k in ("lr", "momentum", "rescale_by_paths", "weighting", "normalize", "decay")},
            "seconds": float(seconds.read_text()) if seconds.exists() else None,
        })
    for r in rows:
        r["round"] = (1 if r["variant"] in ROUND1 else 3 if r["variant"] in ROUND3 else
                      4 if r["variant"] in ROUND4 else 5 if r["variant"] in ROUND5 else
                      6 if r["variant"] in ROUND6 else 2)
        r["measured_here"] = True
    rows += earlier_rows(EXPERIMENT_RESULTS / "recipe-search.json", measured={r["variant"] for r in rows})
    rows.sort(key=lambda r: list(VARIANTS).index(r["variant"]))
    base_ppl = next(r["perplexity"] for r in rows if r["variant"] == "base")
    for r in rows:
        if r["measured_here"]:  # a kept row keeps its gain over the base measured with it
            r["gain_vs_base"] = 1 - r["perplexity"] / base_ppl
    return {"reduced": REDUCED, "dense": dense, "scored_tokens": base["scored_tokens"],
            "test_documents": base["test_documents"], "rows": rows}


def earlier_rows(path: Path, *, measured: set[str]) -> list[dict]:
    """The rows of the results file `path` written before (an earlier session's runs, whose run folders
    are gone) for the variants not in `measured`: kept as they were, `measured_here` false, `source` the
    file's source line, their ratio against the dense reference of the session that measured them (the
    `base` of the same REDUCED config)."""
    earlier = read_json(path)
    kept = []
    for r in earlier.get("rows", []):
        if r["variant"] in VARIANTS and r["variant"] not in measured:
            kept.append({**r, "round": r.get("round", 1), "measured_here": False,
                         "source": r.get("source", earlier.get("source"))})
    return kept


def markdown(results: dict) -> str:
    dense = results["dense"]
    lines = [
        "# DiPaCo recipe search (reduced budget, equal compute)\n",
        f"configs/demo.yaml with `{' '.join(results['reduced'])}`; every variant spends 800 path-model steps "
        f"(paths x rounds x H + pretrain steps) and is scored on the same {results['scored_tokens']:,} held-out "
        f"tokens ({results['test_documents']} documents). Dense path-size baselines: equal steps (200) "
        f"{dense['dense-equal-steps']:.2f}, equal compute (800) {dense['dense-equal-compute']:.2f}, both trained "
        "from scratch in the `base` run; every variant's ratio is to that dense-equal-compute model.\n",
    ]
    earlier = sorted({r["source"] for r in results["rows"] if not r.get("measured_here", True)})
    if earlier:
        lines.append("Rows marked * were not re-run here: they are kept from the results file written before "
                     f"(their source: {'; '.join(earlier)}), with ratios to that session's `base` reference.\n")
    lines += ["| round | variant | what | routed ppl | ÷ base − 1 | ÷ dense equal compute | every:64 | oracle "
              "| routed ÷ oracle − 1 | params total | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        oracle = f"{r['oracle']:.2f}" if r["oracle"] else "-"
        gap = f"{100 * r['oracle_gap']:+.1f}%" if r["oracle_gap"] is not None else "-"
        every = f"{r['every64']:.2f}" if r["every64"] else "-"
        secs = f"{r['seconds']:.0f}" if r["seconds"] else "-"
        mark = "" if r.get("measured_here", True) else "*"
        lines.append(f"| {r.get('round', 1)} | {r['variant']}{mark} | {r['what']} | {r['perplexity']:.2f} | {-100 * r['gain_vs_base']:+.1f}% | "
                     f"{r['ratio_dense_equal_compute']:.2f} | {every} | {oracle} | {gap} | {r['params_total']:,} | "
                     f"{secs} |")
    lines.append("\nOverrides of each variant: `python experiments/recipe_search.py --list`.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
