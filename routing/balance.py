"""Balanced assignment: per-path additive penalties so that path sizes stay within a ratio.

Plain nearest-centroid routing can starve paths (product k-means on TF-IDF/SVD features left 207 of
256 paths empty on synthetic data: SVD slices are correlated). Here every path j gets a penalty p_j
added to its distance, and a document goes to argmin_j (d_ij + p_j). `fit_penalties` finds the
penalties on a set of documents by dual ascent on the entropic balanced-transport problem (log-domain
Sinkhorn with annealed temperature), keeping the penalties whose hard assignment is most balanced. The penalties are
stored with the router, so a single new document (a test document, a streamed batch) is routed by
the same rule; nothing depends on the batch it arrives in.

The target: sizes in [lo, hi] with hi = floor(N / (k - 1 + 1/ratio)) (at least ceil(N/k)) and
lo = ceil(hi / ratio): any assignment with every size <= hi has min >= N - (k - 1) hi >= hi / ratio.
`capacity_assign` is the exact fallback: a greedy capacity assignment (vectorised rounds in which
every unplaced document proposes to its best path with room and each path keeps its cheapest
proposals), then paths below lo are topped up by the cheapest moves, which guarantees sizes in
[lo, hi] on the batch it sees. faiss has no balanced k-means; `faiss.contrib.clustering.balanced_assignment_with_penalties`
only softens imbalance (REFERENCES.md), hence this module.

For product k-means the distance of a path is the sum of its per-level distances, so the penalties
are per *path*, not per level: per-level balance does not make the joint path sizes balanced when
the feature slices are correlated, and the path sizes are what training sees. CPU check:

    python -c "import numpy as np; from routing.balance import fit_penalties; \
d = np.random.default_rng(0).random((1000, 4)).astype('float32'); d[:, 0] -= 0.5; \
print(fit_penalties(d, max_ratio=1.1)[1])"
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def size_bounds(n: int, k: int, max_ratio: float) -> tuple[int, int]:
    """(lo, hi): sizes within [lo, hi] have max / min <= max_ratio (when n >= k)."""
    if k < 1 or n < 0:
        raise ValueError(f"need k >= 1 and n >= 0, got k={k}, n={n}")
    if max_ratio < 1:
        raise ValueError(f"max_ratio must be >= 1, got {max_ratio}")
    if k == 1:
        return n, n
    hi = max(math.ceil(n / k), math.floor(n / (k - 1 + 1 / max_ratio)))
    lo = max(math.ceil(hi / max_ratio), n - (k - 1) * hi, 0)
    return lo, hi


def _check(d: np.ndarray) -> np.ndarray:
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 2 or d.shape[1] < 1:
        raise ValueError(f"distances must be a 2-D array (N, k), got shape {d.shape}")
    if not np.isfinite(d).all():
        raise ValueError("distances hold non-finite values")
    return d


def fit_penalties(
    d: np.ndarray, *, max_ratio: float, iters: int = 60, anneal: int = 6
) -> tuple[np.ndarray, dict[str, Any]]:
    """Penalties p (k,) float32 such that argmin(d + p) has sizes within max_ratio (best effort).

    d: (N, k) distances (lower = better). Dual ascent of the entropic balanced transport problem
    (Sinkhorn in the log domain): with temperature tau, p_j += tau * log(soft_size_j / (N / k)),
    `iters` times, then tau is halved (`anneal` times), starting from a tenth of the median gap
    between a document's best and second-best path. The penalties whose *hard* assignment has the
    smallest max / min ratio are kept; the search stops as soon as the ratio is met. Penalties
    cannot split documents with identical distances, so a tie group larger than N / k can make the
    ratio unreachable; `capacity_assign` is exact. If the ratio is not met, exact one-path moves (an
auction: the worst path raises its penalty until its size is hi, or lowers it until lo) continue
from the best penalties. Deterministic. stats: "sizes", "ratio",
    "iterations", "converged", "lo", "hi", "seconds".
    """
    d = _check(d).astype(np.float32)  # the router adds float32 penalties to float32 costs: same rounding
    n, k = d.shape
    t0 = time.perf_counter()
    lo, hi = size_bounds(n, k, max_ratio)
    best_p = np.zeros(k, dtype=np.float32)
    best_ratio, best_sizes = _hard_ratio(d, best_p)
    steps = 0
    if k > 1 and best_ratio > max_ratio:
        best_ratio, best_sizes, best_p, steps = _sinkhorn(d, (best_ratio, best_sizes, best_p), max_ratio=max_ratio,
                                                          iters=iters, anneal=anneal)
    if best_ratio > max_ratio:
        p, moves = _auction(d, best_p, lo=lo, hi=hi, max_ratio=max_ratio, max_moves=20 * k)
        steps += moves
        ratio, sizes = _hard_ratio(d, p)
        if ratio < best_ratio:
            best_ratio, best_sizes, best_p = ratio, sizes, p
    converged = bool(best_ratio <= max_ratio)
    stats = {"sizes": best_sizes.tolist(), "ratio": best_ratio, "iterations": steps, "converged": converged,
             "lo": lo, "hi": hi, "seconds": time.perf_counter() - t0}
    if not converged:
        logger.warning("balance: penalties reach a largest / smallest path ratio of %.3g (target %.3g); "
                       "training documents are placed exactly by capacity", best_ratio, max_ratio)
    return best_p, stats


def _hard_ratio(d: np.ndarray, p: np.ndarray) -> tuple[float, np.ndarray]:
    """(largest / smallest path size, sizes (k,)) of the hard assignment argmin(d + p) (inf: an empty path)."""
    sizes = np.bincount((d + p).argmin(axis=1), minlength=d.shape[1])
    return (float(sizes.max() / sizes.min()) if sizes.min() else float("inf")), sizes


def _sinkhorn(
    d: np.ndarray, best: tuple[float, np.ndarray, np.ndarray], *, max_ratio: float, iters: int, anneal: int
) -> tuple[float, np.ndarray, np.ndarray, int]:
    """The annealed log-domain Sinkhorn search of `fit_penalties` on distances d (N, k) float32: returns the
    (ratio, sizes, penalties) of the best hard assignment seen, `best` included, and the steps taken; it
    stops as soon as the ratio is within `max_ratio`."""
    n, k = d.shape
    best_ratio, best_sizes, best_p = best
    steps = 0
    two = np.partition(d, 1, axis=1)[:, :2]
    tau = 0.1 * max(float(np.median(two[:, 1] - two[:, 0])), 1e-6)
    logp = np.zeros(k, dtype=np.float64)
    for _ in range(anneal):
        for _ in range(iters):
            z = -(d + logp.astype(np.float32)) / tau
            z -= z.max(axis=1, keepdims=True)
            w = np.exp(z)
            soft = (w / w.sum(axis=1, keepdims=True)).sum(axis=0)
            logp += tau * np.log(np.maximum(soft, 1e-12) / (n / k))
            steps += 1
            ratio, sizes = _hard_ratio(d, logp.astype(np.float32))
            if ratio < best_ratio:
                best_ratio, best_sizes, best_p = ratio, sizes, logp.astype(np.float32)
            if best_ratio <= max_ratio:
                return best_ratio, best_sizes, best_p, steps
        tau /= 2
    return best_ratio, best_sizes, best_p, steps


def _auction(d: np.ndarray, p: np.ndarray, *, lo: int, hi: int, max_ratio: float,
             max_moves: int) -> tuple[np.ndarray, int]:
    """Exact moves, one path at a time, from penalties p: the worst path raises its penalty until
    its size is hi (excess documents go to their next-best path), or lowers it until its size is lo.
    Returns the most balanced penalties seen and the number of moves. A move changes one path's penalty,
    so only the documents it can move are looked at again: the path's own when it rises, its column when
    it falls (the assignment stays argmin(d + p), ties to the lower path, as if recomputed)."""
    k = d.shape[1]
    p = p.astype(np.float32).copy()
    eps = np.float32(1e-5 * max(1.0, float(np.abs(d).max())))
    best, best_ratio = p.copy(), float("inf")
    a = (d + p).argmin(axis=1)
    sizes = np.bincount(a, minlength=k)
    for move in range(max_moves + 1):
        ratio = float(sizes.max() / sizes.min()) if sizes.min() else float("inf")
        if ratio < best_ratio:
            best, best_ratio = p.copy(), ratio
        if ratio <= max_ratio or move == max_moves:
            return best, move
        over, under = sizes - hi, lo - sizes
        j = int(np.argmax(np.maximum(over, under)))
        if over[j] >= under[j] and over[j] > 0:
            members = np.flatnonzero(a == j)  # only these can leave j, for their best other path
            cost = d[members] + p
            cost[:, j] = np.inf
            second = cost.argmin(axis=1)
            alt = cost[np.arange(len(members)), second]
            p[j] += np.partition(alt - (d[members, j] + p[j]), over[j] - 1)[over[j] - 1] + eps
            own = d[members, j] + p[j]
            a[members] = np.where((own < alt) | ((own == alt) & (j < second)), j, second)
        else:
            need = max(int(under[j]), 1)
            others = np.flatnonzero(a != j)
            current = d[others, a[others]] + p[a[others]]
            gain = (d[others, j] + p[j]) - current
            p[j] -= np.partition(gain, need - 1)[need - 1] + eps
            column = d[others, j] + p[j]  # only a document's own path and j can be its best now
            a[others[(column < current) | ((column == current) & (j < a[others]))]] = j
        sizes = np.bincount(a, minlength=k)
    return best, max_moves


def capacity_assign(d: np.ndarray, *, max_ratio: float) -> tuple[np.ndarray, dict[str, Any]]:
    """Greedy capacity assignment: ids (N,) with sizes in [lo, hi] (see `size_bounds`).

    Vectorised rounds: every unplaced document proposes to its best path that still has room; a
    path keeps the cheapest proposals up to its room (ties to the lower document index) and is
    full afterwards if it had more. At most k rounds. Then paths below lo take the cheapest moves
    from paths above lo. Deterministic. Memory: the (N, k) costs, float64.
    """
    d = _check(d)
    n, k = d.shape
    lo, hi = size_bounds(n, k, max_ratio)
    ids = np.full(n, -1, dtype=np.int64)
    room = np.full(k, hi, dtype=np.int64)
    rounds = 0
    while (ids < 0).any():
        rounds += 1
        todo = np.flatnonzero(ids < 0)
        masked = np.where(room[None, :] > 0, d[todo], np.inf)
        choice = masked.argmin(axis=1)
        cost = masked[np.arange(len(todo)), choice]
        order = np.lexsort((todo, cost, choice))  # by path, then cost, then document
        choice_sorted = choice[order]
        starts = np.searchsorted(choice_sorted, np.arange(k))
        rank = np.arange(len(order)) - starts[choice_sorted]  # position within the path's proposals
        accept = rank < room[choice_sorted]
        ids[todo[order[accept]]] = choice_sorted[accept]
        room -= np.bincount(choice_sorted[accept], minlength=k)
    sizes = np.bincount(ids, minlength=k)
    moved = 0
    rows = np.arange(n)
    for j in np.argsort(sizes, kind="stable"):
        if sizes[j] >= lo:
            continue
        extra = d[:, j] - d[rows, ids]
        for i in np.argsort(np.where(ids == j, np.inf, extra), kind="stable"):
            if sizes[j] >= lo:
                break
            if ids[i] != j and sizes[ids[i]] > lo:
                sizes[ids[i]] -= 1
                ids[i] = j
                sizes[j] += 1
                moved += 1
    return ids, {"sizes": sizes.tolist(), "ratio": float(sizes.max() / max(sizes.min(), 1)),
                 "rounds": rounds, "topped_up": moved, "lo": lo, "hi": hi}
