"""Heads of the learned router fitted again after a run, without a forward pass: on the router split's losses
that `dipaco reroute` kept (routing/phase-1-losses.json) and its prefix features (routing/features.npy),
scored on the held-out documents' losses and features that `dipaco eval` kept (eval-documents.json).

    heads = compare_heads(Path("runs/learned-router-8x8-seed0"))   # {name: {perplexity, agreement, ...}}

Heads: the logistic regression on each document's best path (the pipeline's, at several L2 strengths), the
ridge regression on every path's loss (`routing.loss_regression`), each also on a quarter and a half of the
router documents (does the head want more labels?) and on the prefix's losses (imitating likelihood
routing), and a two-stage router: a head's top k paths, of which
the one with the lowest loss on the prefix (likelihood routing among k: k prefix forward passes more). Used by
experiments/learned_router.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dipaco.eval.document_losses import routed_perplexity
from routing.assignments import Assignments
from routing.corpus import TRAIN
from routing.discriminative import fit_discriminative
from routing.loss_regression import fit_loss_regression
from routing.router import Router
from routing.router_cost import load_balance

C_VALUES = (0.1, 1.0, 10.0)  # logistic heads' inverse L2 strengths (the pipeline's reroute.c is 1)
FRACTIONS = (0.25, 0.5)  # shares of the router documents the subsampled heads see
TOP_K = (2, 4)  # candidate paths of the two-stage router


def router_split(run: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features (D, dim), mean NLL after the prefix (D, paths), total NLL of the prefix (D, paths)) of the
    router documents the last reroute phase scored (inf off-candidate)."""
    phases = json.loads((run / "routing" / "phases.json").read_text())
    record = json.loads((run / "routing" / f"phase-{phases[-1]['phase']}-losses.json").read_text())
    nll, prefix_nll = (np.array([[np.inf if v is None else v for v in row] for row in record[key]])
                       for key in ("nll", "prefix_nll"))
    features = np.load(run / "routing" / "features.npy", mmap_mode="r")
    return np.asarray(features[record["documents"]], dtype=np.float32), nll, prefix_nll


def factored_logistic(x: np.ndarray, labels: np.ndarray, levels: list[int], *, seed: int = 0) -> tuple:
    """A logistic regression per grid level on the label's module at that level (about levels[l] times more
    labels per class than per path), summed into one linear head over the paths: W[(i, j)] = W1[i] + W2[j],
    so argmax over the paths is the pair of the levels' argmaxes (`Router(linear=...)` routes by it as is)."""
    coords = np.unravel_index(labels, levels)
    rows = [fit_discriminative(x, c, n_paths=n, target=None, seed=seed)[0] for c, n in zip(coords, levels)]
    (w1, b1), (w2, b2) = rows
    w = (w1[:, None, :] + w2[None, :, :]).reshape(-1, x.shape[1])
    b = (b1[:, None] + b2[None, :]).reshape(-1)
    return w, b


def linear_heads(x: np.ndarray, nll: np.ndarray, prefix_nll: np.ndarray, *, levels: list[int] | None = None,
                 seed: int = 0) -> dict[str, tuple]:
    """{name: (W, b)}: logistic heads at `C_VALUES` on each document's best path (the labels of `dipaco
    reroute`), the ridge head on every path's loss, both on `FRACTIONS` of the documents (a seeded draw), and
    both again on the prefix's losses (the path likelihood routing would pick: a function of the prefix)."""
    n_paths = nll.shape[1]
    labels = np.argmin(nll, axis=1)
    heads = {f"logistic C={c:g}": fit_discriminative(x, labels, n_paths=n_paths, target=None, c=c, seed=seed)[0]
             for c in C_VALUES}
    heads["regression"] = fit_loss_regression(x, nll)[0]
    order = np.random.default_rng(seed).permutation(len(x))
    for fraction in FRACTIONS:
        keep = np.sort(order[: max(n_paths, int(fraction * len(x)))])
        heads[f"logistic C=1, {fraction:.0%} of the router documents"] = fit_discriminative(
            x[keep], labels[keep], n_paths=n_paths, target=None, seed=seed)[0]
        heads[f"regression, {fraction:.0%} of the router documents"] = fit_loss_regression(x[keep], nll[keep])[0]
    if levels is not None and len(levels) == 2:
        heads["factored logistic (one per grid level)"] = factored_logistic(x, labels, levels, seed=seed)
    heads["logistic C=1 on the prefix's best path"] = fit_discriminative(
        x, np.argmin(prefix_nll, axis=1), n_paths=n_paths, target=None, seed=seed)[0]
    heads["regression on the prefix's losses"] = fit_loss_regression(x, prefix_nll)[0]
    return heads


def score(record: dict, choice: np.ndarray, oracle: np.ndarray, train_choice: np.ndarray | None) -> dict:
    counts = np.bincount(choice, minlength=len(record["paths"]))
    out = {"perplexity": routed_perplexity(record, choice), "agrees_with_oracle": float(np.mean(choice == oracle)),
           "test_documents_per_path": {"min": int(counts.min()), "median": float(np.median(counts)),
                                       "max": int(counts.max()), "paths_with_none": int((counts == 0).sum())}}
    if train_choice is not None:
        out["train_balance"] = {k: v for k, v in load_balance(train_choice, n_paths=len(counts)).items() if k != "sizes"}
    return out


def compare_heads(run: Path) -> dict[str, dict]:
    """Every head's routing of the held-out documents (perplexity, agreement with the oracle path, documents
    per path; the training documents per path for the one-stage heads), and the two-stage routers."""
    record = json.loads((run / "eval-documents.json").read_text())
    if record["paths"] != list(range(len(record["paths"]))):
        raise SystemExit(f"{run / 'eval-documents.json'}: not every path was evaluated (replicas?): {record['paths'][:8]}")
    test_x = np.asarray(record["features"], dtype=np.float32)
    prefix_nll = np.asarray(record["prefix_nll"])
    oracle = np.argmin(record["scored_nll"], axis=1)
    features = np.load(run / "routing" / "features.npy", mmap_mode="r")
    split = Assignments.load(run / "routing").split
    train_x = np.asarray(features[np.flatnonzero(split == TRAIN)], dtype=np.float32)
    heads = linear_heads(*router_split(run), levels=list(Router.load(run / "routing" / "phase-0").levels))
    costs = {name: -(test_x @ w.T + b) for name, (w, b) in heads.items()}
    costs["k-means"] = Router.load(run / "routing" / "phase-0").path_costs(test_x)
    out = {}
    for name, cost in costs.items():
        train = (Assignments.load(run / "routing" / "phase-0").path[split == TRAIN] if name == "k-means"
                 else np.argmax(train_x @ heads[name][0].T + heads[name][1], axis=1))
        out[name] = score(record, np.argmin(cost, axis=1), oracle, train)
    for name in ("k-means", "logistic C=1", "regression"):
        for k in TOP_K:
            top = np.argsort(costs[name], axis=1, kind="stable")[:, :k]  # (D, k)
            choice = top[np.arange(len(top)), np.argmin(np.take_along_axis(prefix_nll, top, axis=1), axis=1)]
            out[f"{name} top {k}, then likelihood"] = score(record, choice, oracle, None)
    return out


def two_stage_cost(run: Path, *, k_values: tuple[int, ...] = (1, *TOP_K), documents: int = 256,
                   repeats: int = 3) -> dict:
    """What the two-stage router costs per prefix against the k-means router, timed back to back on the same
    router-split prefixes: featurizing the prefix text and picking the k-means path (the k-means router), and one
    path model's forward pass on the prefix tokens (path 0 at the last version; every path is the same model
    size), k of which the two-stage router adds. Each timing is the best of `repeats`."""
    import torch

    from dipaco.config import load_config
    from dipaco.eval.scoring import token_losses
    from dipaco.pipeline.context import PathFactory
    from dipaco.pipeline.documents import load_run_corpus
    from dipaco.run_dir import RunDir
    from routing.router_cost import _best_seconds
    from sharding.tokenizer import decode_prefix, encode_batch

    config = load_config(run / "config.yaml")
    factory = PathFactory(config, RunDir(run))
    ids = json.loads((run / "routing" / "phase-1-losses.json").read_text())["documents"][:documents]
    texts = load_run_corpus(config.corpus).select(ids)["text"]
    prefix = factory.prefix_tokens
    tokens = [t[:prefix] for t in encode_batch(factory.tokenizer, texts)]
    prefixes = [decode_prefix(factory.tokenizer, t, prefix) for t in tokens]
    kmeans = Router.load(run / "routing" / "phase-0")
    model = factory.load_path(path=0, round=factory.store.current_round())
    featurize = _best_seconds(lambda: kmeans.features(prefixes), repeats)
    features = kmeans.features(prefixes)
    assign = _best_seconds(lambda: kmeans.assign(features), repeats)
    path_pass = _best_seconds(lambda: token_losses(model, tokens, batch_size=config.eval.batch_size,
                                                   device=torch.device("cpu"), precision=config.hardware.precision),
                              repeats)
    ms = 1000.0 / len(prefixes)
    base = (featurize + assign) * ms
    return {"documents": len(prefixes), "kmeans_featurize_ms": featurize * ms, "kmeans_assign_ms": assign * ms,
            "path_prefix_pass_ms": path_pass * ms,
            "cost_over_kmeans": {str(k): (base + k * path_pass * ms) / base for k in k_values}}
