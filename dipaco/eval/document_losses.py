"""The held-out documents' losses per path, kept so that a router can be scored after evaluation: each
test document's routed path, its scored tokens and, where every path scored every document (the `oracle`,
`oracle-split` and `likelihood` modes fill the table), every path's total loss on its scored tokens (those
after the routing prefix) and on its prefix. `dipaco eval` writes them to `eval-documents.json`.

    record = document_losses(table, routed=paths, rounds={p: 10 for p in range(4)}, prefix=32, router="kmeans")
    routed_perplexity(record, paths)   # == the `prefix` mode's perplexity for the same paths

A router that picks one path per document from its prefix scores exactly `sum_d scored_nll[d][path_d]` over
`sum_d scored_tokens[d]` tokens (the `prefix` mode), so another router's perplexity, its agreement with
the oracle path and its documents per path come from this record without a forward pass; a router on the
same featurizer (the learned router's head on the k-means router's features) routes from "features".
"""

from __future__ import annotations

import numpy as np

from dipaco.eval.modes import LossTable
from dipaco.eval.scoring import perplexity

FORMAT_VERSION = 1


def document_losses(table: LossTable, *, routed: np.ndarray, features: np.ndarray | None, rounds: dict[int, int],
                    prefix: int, router: str) -> dict:
    """The record (JSON-able): "routed" (D,) path of each document, "features" (D, dim) the router's prefix
    features (None when not given), "scored_tokens" (D,), "paths" (the evaluated paths, sorted), and when `table` holds every path in `rounds` on every document,
    "scored_nll" and "prefix_nll" (D, paths): each path's total loss on the document's tokens from `prefix`
    on and on its first `prefix` (None otherwise: the `prefix` mode scores only the routed path)."""
    paths = sorted(rounds)
    n_docs = len(table.docs)
    if len(routed) != n_docs or (features is not None and len(features) != n_docs):
        raise ValueError(f"routed has {len(routed)} paths and features {None if features is None else len(features)} "
                         f"rows for {n_docs} documents")
    complete = all(table.has(p, rounds[p], d) for p in paths for d in range(n_docs))
    record = {"format_version": FORMAT_VERSION, "router": router, "prefix_tokens": prefix, "paths": paths,
              "rounds": [rounds[p] for p in paths], "routed": [int(p) for p in routed],
              "features": None if features is None else np.asarray(features, dtype=np.float64).tolist(),
              "scored_tokens": [max(0, len(doc) - prefix) for doc in table.docs],
              "scored_nll": None, "prefix_nll": None}
    if complete:
        losses = [[table.get(p, rounds[p], d) for p in paths] for d in range(n_docs)]
        record["scored_nll"] = [[float(x[prefix:].sum()) for x in row] for row in losses]
        record["prefix_nll"] = [[float(x[:prefix].sum()) for x in row] for row in losses]
    return record


def routed_perplexity(record: dict, choice: np.ndarray) -> float:
    """Perplexity of the scored tokens when document d is scored by path `choice[d]` (a path id in
    `record["paths"]`), from the record's "scored_nll" (refused when the record has none)."""
    if record.get("scored_nll") is None:
        raise ValueError("this eval-documents record has no per-path losses: evaluate with an oracle or "
                         "likelihood mode (every path scores every document)")
    nll = np.asarray(record["scored_nll"], dtype=np.float64)  # (D, P)
    column = {p: i for i, p in enumerate(record["paths"])}
    choice = np.asarray(choice)
    if choice.shape != (len(nll),) or any(int(p) not in column for p in choice):
        raise ValueError(f"choice must be one of the paths {record['paths'][:4]}... for each of {len(nll)} documents")
    picked = nll[np.arange(len(nll)), [column[int(p)] for p in choice]]
    return perplexity(float(picked.sum()), int(np.sum(record["scored_tokens"])))
