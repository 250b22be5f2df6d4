"""Discriminative routing labels: each document's path is the one whose model gives it the lowest loss.

    nll = candidate_losses(table, candidates, round=8, n_paths=4, skip=32)   # (D, paths), inf off-candidate
    labels = best_paths(nll)                                                  # (D,) argmin, ties to the lower path
    prefix_nll = candidate_prefix_losses(table, candidates, round=8, n_paths=4, prefix=32)  # likelihood routing's

The loss is the mean token NLL of the document's tokens after its routing prefix (the first `skip`
tokens: the tokens evaluation scores), at one module version, from the eval's `LossTable` (one model
in memory at a time). `dipaco reroute` labels the router split with them and fits the learned router
(`routing.discriminative`) on the documents' prefix features: the router learns what the paths' own
likelihood knows, and routes from the prefix alone.
"""

from __future__ import annotations

import numpy as np

from dipaco.eval.modes import LossTable


def candidate_losses(table: LossTable, candidates: np.ndarray, *, round: int, n_paths: int, skip: int) -> np.ndarray:
    """Mean token NLL (D, paths) of each document of `table` under each of its `candidates` (D, c)
    paths at module version `round`, on its tokens after the first `skip` (inf where not a candidate)."""
    if candidates.ndim != 2 or len(candidates) != len(table.docs):
        raise ValueError(f"candidates must be (documents {len(table.docs)}, c), got {candidates.shape}")
    if len(candidates) and (candidates.min() < 0 or candidates.max() >= n_paths):
        raise ValueError(f"candidate paths must be in [0, {n_paths}), got [{candidates.min()}, {candidates.max()}]")
    nll = np.full((len(table.docs), n_paths), np.inf)
    table.ensure({(p, round): set(np.flatnonzero((candidates == p).any(axis=1)).tolist()) for p in range(n_paths)})
    for path in range(n_paths):
        for d in np.flatnonzero((candidates == path).any(axis=1)):
            nll[d, path] = table.get(path, round, d)[skip:].sum() / max(len(table.docs[d]) - skip, 1)
    return nll


def candidate_prefix_losses(table: LossTable, candidates: np.ndarray, *, round: int, n_paths: int,
                            prefix: int) -> np.ndarray:
    """Total NLL (D, paths) of each document's first `prefix` tokens (what likelihood routing reads) under
    each of its `candidates` paths at module version `round`, from the losses `candidate_losses` computed
    (inf where not a candidate)."""
    nll = np.full((len(table.docs), n_paths), np.inf)
    for path in range(n_paths):
        for d in np.flatnonzero((candidates == path).any(axis=1)):
            nll[d, path] = table.get(path, round, d)[:prefix].sum()
    return nll


def losses_record(nll: np.ndarray, prefix_nll: np.ndarray, *, documents: np.ndarray, round: int, prefix: int) -> dict:
    """The router split's losses as `dipaco reroute` keeps them (routing/phase-<n>-losses.json), JSON-able:
    corpus "documents" (D,), module "round", "prefix_tokens", "nll" (D, paths) mean token NLL after the
    prefix (the labels' loss) and "prefix_nll" (D, paths) total NLL of the prefix; null off-candidate."""
    def rows(a: np.ndarray) -> list[list[float | None]]:
        return [[float(x) if np.isfinite(x) else None for x in row] for row in a]

    return {"documents": [int(d) for d in documents], "round": int(round), "prefix_tokens": int(prefix),
            "nll": rows(nll), "prefix_nll": rows(prefix_nll)}


def best_paths(nll: np.ndarray) -> np.ndarray:
    """Each document's label (D,) int64: its lowest-loss path in `nll` (D, paths) (ties to the lower path)."""
    if nll.ndim != 2 or nll.shape[1] == 0:
        raise ValueError(f"losses must be (documents, paths), got {nll.shape}")
    if len(nll) and not np.isfinite(nll).any(axis=1).all():
        raise ValueError("a document has no finite loss under any candidate path")
    return np.argmin(nll, axis=1).astype(np.int64)
