"""Does the learned router want more labels, richer features or another head? Measured at 8x8 without a
forward pass of the paths beyond experiments/router_windows.py's.

Every head is fitted on the router split only and scored on the held-out documents' losses that `dipaco eval`
kept (eval-documents.json): the logistic head on each example's best path (the pipeline's), the ridge head on
every path's loss, and a nearest-neighbour head (a prefix's loss under path p is the mean loss of p on its K
nearest examples in feature space, standardized over the paths and added to lambda x the k-means router's
standardized cost; K and lambda picked by leave-one-document-out on the router split: the loss the pick would
incur on each document's first window). Examples: the router documents' first windows (what `dipaco reroute`
scores) or every window router_windows.py scored (runs/<run>/router-windows.npz). Features: the k-means
router's (the mean last hidden state), or richer poolings of the same forward pass (experiments/router_pooling.py).

    python experiments/router_labels.py --run runs/learned-router-8x8-seed0 --name router-labels-8x8-seed0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import EXPERIMENT_RESULTS, run_code, write_results  # noqa: E402
from dipaco.config import load_config  # noqa: E402
from dipaco.eval.document_losses import routed_perplexity  # noqa: E402
from dipaco.pipeline.context import PathFactory  # noqa: E402
from dipaco.pipeline.documents import load_run_corpus, run_splits  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from experiments.router_pooling import VARIANTS, pooled  # noqa: E402
from experiments.router_windows import windows  # noqa: E402
from routing.corpus import ROUTER, TEST  # noqa: E402
from routing.discriminative import fit_discriminative  # noqa: E402
from routing.loss_regression import fit_loss_regression  # noqa: E402
from routing.router import Router  # noqa: E402
from sharding.tokenizer import decode_prefix, encode_batch  # noqa: E402

KS = (5, 10, 20, 40, 80, 160)
LAMBDAS = (0.0, 0.1, 0.3, 1.0, 3.0)


def sq_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum((a**2).sum(1)[:, None] - 2 * a @ b.T + (b**2).sum(1)[None, :], 0.0)


def knn_estimates(dist: np.ndarray, ref_nll: np.ndarray, k: int) -> np.ndarray:
    """(N, P): the mean of each path's loss over each row's k nearest references (`dist` (N, R))."""
    near = np.argpartition(dist, k - 1, axis=1)[:, :k]
    return ref_nll[near].mean(axis=1)


def standardized(cost: np.ndarray) -> np.ndarray:
    """Per row: zero mean, unit spread over the paths (so that losses and k-means costs add)."""
    return (cost - cost.mean(1, keepdims=True)) / np.maximum(cost.std(1, keepdims=True), 1e-12)


def pick(est: np.ndarray, prior: np.ndarray, lam: float) -> np.ndarray:
    return np.argmin(standardized(est) + lam * prior, axis=1)


def leave_one_out(x, nll, document, prior, first) -> dict[tuple[int, float], float]:
    """{(K, lambda): mean loss the pick incurs on each document's first window (`first`), with every window of
    that document left out of its neighbours}."""
    rows = np.flatnonzero(first)
    dist = sq_distances(x[rows], x)
    dist[document[rows][:, None] == document[None, :]] = np.inf
    out = {}
    for k in KS:
        est = knn_estimates(dist, nll, k)
        for lam in LAMBDAS:
            out[(k, lam)] = float(nll[rows, pick(est, prior[rows], lam)].mean())
    return out


def knn_head(x, nll, doc, first, prior, test_x, test_prior) -> tuple[np.ndarray, dict]:
    """The nearest-neighbour head's routing of the test documents, K and lambda by leave-one-document-out on
    standardized features; with the k-means router's own loss on the same documents for comparison."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    z, test_z = (x - mean) / std, (test_x - mean) / std
    loo = leave_one_out(z, nll, doc, prior, first)
    k, lam = min(loo, key=loo.get)
    choice = pick(knn_estimates(sq_distances(test_z, z), nll, k), test_prior, lam)
    return choice, {"k": k, "lambda": lam, "loo_nll": loo[(k, lam)], "loo_nll_kmeans": float(
        nll[np.flatnonzero(first), prior[first].argmin(1)].mean())}


def heads(x, nll, doc, first, prior, test_x, test_prior) -> dict[str, tuple[np.ndarray, dict]]:
    """{head: (test routing, fit facts)} for the logistic, ridge and nearest-neighbour heads."""
    (w, b), logistic = fit_discriminative(x, nll.argmin(1), n_paths=nll.shape[1], target=None)
    (rw, rb), ridge = fit_loss_regression(x, nll)
    return {"logistic": (np.argmax(test_x @ w.T + b, axis=1), {"accuracy": logistic["accuracy"]}),
            "regression": (np.argmax(test_x @ rw.T + rb, axis=1), {"alpha": ridge["alpha"]}),
            "nearest neighbours + k-means": knn_head(x, nll, doc, first, prior, test_x, test_prior)}


def study(run: Path) -> dict:
    config = load_config(run / "config.yaml")
    factory = PathFactory(config, RunDir(run))
    kmeans = Router.load(run / "routing" / "phase-0")
    record = json.loads((run / "eval-documents.json").read_text())
    prefix = factory.prefix_tokens
    texts = load_run_corpus(config.corpus)["text"]
    split = run_splits(config.corpus, len(texts))
    test_docs = encode_batch(factory.tokenizer, [texts[int(i)] for i in np.flatnonzero(split == TEST)])
    test = pooled(kmeans.featurizer, [decode_prefix(factory.tokenizer, d, prefix) for d in test_docs])
    if test[VARIANTS[0]].shape != np.shape(record["features"]) or not np.allclose(
            test[VARIANTS[0]], np.asarray(record["features"]), atol=1e-5):
        raise SystemExit(f"{run}: the test split's prefix features differ from eval-documents.json's")
    router_docs = np.flatnonzero(split == ROUTER)
    found = windows(encode_batch(factory.tokenizer, [texts[int(i)] for i in router_docs]),
                    seq_len=config.sharding.seq_len, prefix=prefix, most=4)
    data = np.load(run / "router-windows.npz")
    if len(found) != len(data["nll"]):
        raise SystemExit(f"{run / 'router-windows.npz'} has {len(data['nll'])} windows, expected {len(found)}")
    train = pooled(kmeans.featurizer, [decode_prefix(factory.tokenizer, p, prefix) for _, _, p in found])
    nll, doc, first = data["nll"], data["document"], data["window"] == 0
    prior, test_prior = (standardized(kmeans.path_costs(f[VARIANTS[0]])) for f in (train, test))
    ppl = {"k-means": routed_perplexity(record, kmeans.path_costs(test[VARIANTS[0]]).argmin(1)),
           "likelihood": routed_perplexity(record, np.argmin(record["prefix_nll"], axis=1))}
    rows = []
    for examples, keep in (("first windows", first), ("every window", np.ones_like(first))):
        for variant in VARIANTS if examples == "every window" else VARIANTS[:1]:
            fitted = heads(train[variant][keep], nll[keep], doc[keep], first[keep], prior[keep],
                           test[variant], test_prior)
            for head, (choice, facts) in fitted.items():
                p = routed_perplexity(record, choice)
                rows.append({"examples": examples, "n_examples": int(keep.sum()), "features": variant,
                             "dim": int(train[variant].shape[1]), "head": head, "perplexity": p,
                             "gap_closed": (ppl["k-means"] - p) / (ppl["k-means"] - ppl["likelihood"]),
                             "paths_with_no_test_document": int(nll.shape[1] - len(np.unique(choice))), **facts})
    return {"run": str(run.relative_to(ROOT) if run.is_relative_to(ROOT) else run), "router_documents": int(first.sum()),
            "windows": int(len(found)), "perplexity": ppl, "rows": rows}


def markdown(r: dict) -> str:
    p = r["perplexity"]
    lines = [f"# The learned router's heads on more labels and richer features ({r['run']})", "",
             f"k-means router {p['k-means']:.2f}, likelihood routing {p['likelihood']:.2f}; {r['router_documents']} "
             f"router documents, {r['windows']} windows of up to 128 tokens (at most 4 per document). Gap closed: of "
             "the gap between the two.", "",
             "| examples | features (dim) | head | perplexity | gap closed | fit |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        fit = (f"K={row['k']}, lambda={row['lambda']:g} (leave-one-out NLL {row['loo_nll']:.4f}, k-means "
               f"{row['loo_nll_kmeans']:.4f})" if "k" in row else
               f"alpha {row['alpha']:g}" if "alpha" in row else f"fit accuracy {row['accuracy']:.1%}")
        lines.append(f"| {row['examples']} ({row['n_examples']}) | {row['features']} ({row['dim']}) | {row['head']} "
                     f"| {row['perplexity']:.2f} | {row['gap_closed']:+.0%} | {fit} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    result = study(args.run.resolve())
    write_results(args.name, result, markdown(result), results_dir=EXPERIMENT_RESULTS, trained_at=run_code(args.run))
    print(markdown(result))


if __name__ == "__main__":
    main()
