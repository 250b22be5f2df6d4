"""k-means with faiss: flat k-means, nearest-centroid assignment and product k-means.

Product k-means (DiPaCo's generative router for many paths): the D feature dimensions are cut
into L contiguous slices (`np.array_split(range(D), L)`), and level l runs its own k-means with
ks[l] clusters on slice l. A document's path is the tuple (c_0, ..., c_{L-1}) of its nearest
centroid on each slice; its flat path id is `np.ravel_multi_index((c_0, ..., c_{L-1}), ks)`
(level 0 most significant, so with ks = [2, 3] the path (1, 2) has id 1*3 + 2 = 5).

Centroids are seeded with k-means++ (scikit-learn's `kmeans_plusplus`) and refined by faiss's
Lloyd iterations; faiss's own random init got stuck 1.5-3x above sklearn's objective on separated
blobs. Determinism: faiss seeds its sampling and initialisation from `seed`, and its centroid update
sums points in a fixed order, so the same input, seed and thread count give bitwise-identical
centroids and assignments (checked by the tests). Distances go through BLAS; a different BLAS or
OpenMP thread count (`faiss.omp_set_num_threads`) may change the last bits and thus break ties
differently. We leave the thread count to the caller. CPU check:

    python -c "import numpy as np; from routing.kmeans import kmeans; \
print(kmeans(np.random.rand(1000, 8).astype('float32'), 4, seed=0)[1])"
"""

from __future__ import annotations

import logging
import time
from typing import Any

# faiss's loader logs every instruction-set build it tries at INFO ("Could not load library with AVX512
# support due to: ModuleNotFoundError(...)"), which reads like an error in `dipaco route`'s log. Below
# WARNING only, so its warnings and errors still show; a level someone set on purpose is kept.
if logging.getLogger("faiss.loader").level == logging.NOTSET:
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)

import faiss  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.cluster import kmeans_plusplus  # noqa: E402

logger = logging.getLogger(__name__)


def _as_points(x: np.ndarray, name: str = "x") -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array (N, D), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} holds {int((~np.isfinite(x)).sum())} non-finite values")
    return x


def kmeans(
    x: np.ndarray,
    k: int,
    *,
    seed: int,
    niter: int = 25,
    max_points_per_centroid: int = 256,
    init: str = "k-means++",
) -> tuple[np.ndarray, dict[str, Any]]:
    """Lloyd k-means of points x (N, D) into k clusters -> centroids (k, D) float32, stats.

    init "k-means++" seeds the centroids with scikit-learn's `kmeans_plusplus` on a seeded sample
    of at most k * max_points_per_centroid points; "random" is faiss's own init (k random points),
    which on well-separated clusters often ends 1.5-3x above the sklearn objective.

    stats: "objective" (sum of squared distances of ALL N points to their nearest centroid; faiss
    may train on a sample of k * max_points_per_centroid points), "iterations", "seconds",
    "sizes" (points per cluster, over all N points).
    """
    x = _as_points(x)
    n, d = x.shape
    _check_settings(k, n=n, init=init, niter=niter, max_points_per_centroid=max_points_per_centroid)
    t0 = time.perf_counter()
    km = faiss.Kmeans(
        d,
        k,
        niter=niter,
        seed=seed,
        spherical=False,
        verbose=False,
        max_points_per_centroid=max_points_per_centroid,
        min_points_per_centroid=1,  # we validate k <= N ourselves; silences faiss's stderr warning
    )
    init_centroids = (
        _kmeans_pp(x, k, seed=seed, max_points=k * max_points_per_centroid) if init != "random" else None
    )
    km.train(x, init_centroids=init_centroids)
    centroids = np.ascontiguousarray(km.centroids, dtype=np.float32).reshape(k, d)
    ids, sq = assign_nearest(x, centroids)
    sizes = np.bincount(ids, minlength=k)
    stats = {
        "objective": float(sq.astype(np.float64).sum()),
        "iterations": len(km.iteration_stats),
        "seconds": time.perf_counter() - t0,
        "sizes": sizes.tolist(),
        "n_train_points": min(n, k * max_points_per_centroid),
    }
    empty = int((sizes == 0).sum())
    if empty:
        logger.warning("k-means: %d of %d clusters are empty (N=%d)", empty, k, n)
    logger.info(
        "k-means k=%d N=%d D=%d: objective %.4g in %.2fs", k, n, d, stats["objective"], stats["seconds"]
    )
    return centroids, stats


def _check_settings(k: int, *, n: int, init: str, niter: int, max_points_per_centroid: int) -> None:
    """Refuse k outside [1, n] (n points), an unknown init, and niter or max_points_per_centroid below 1."""
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= N, got k={k} clusters for N={n} points")
    if init not in ("k-means++", "random"):
        raise ValueError(f"init must be 'k-means++' or 'random', got {init!r}")
    if niter < 1 or max_points_per_centroid < 1:
        raise ValueError(
            f"niter and max_points_per_centroid must be >= 1, got {niter}, {max_points_per_centroid}"
        )


def _kmeans_pp(x: np.ndarray, k: int, *, seed: int, max_points: int) -> np.ndarray | None:
    """k-means++ seeds (k, D) float32 from a seeded sample of x; None when faiss skips training (k == N)."""
    if k == len(x):
        return None
    if len(x) > max_points:
        x = x[np.sort(np.random.default_rng(seed).choice(len(x), max_points, replace=False))]
    centers, _ = kmeans_plusplus(x, k, random_state=seed)
    return np.ascontiguousarray(centers, dtype=np.float32)


def assign_nearest(
    x: np.ndarray, centroids: np.ndarray, *, batch_size: int = 65536
) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid of each point: ids (N,) int64 and squared L2 distances (N,) float32."""
    x = _as_points(x)
    centroids = _as_points(centroids, "centroids")
    if x.shape[1] != centroids.shape[1]:
        raise ValueError(f"points have dimension {x.shape[1]} but centroids have {centroids.shape[1]}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    index = faiss.IndexFlatL2(centroids.shape[1])
    index.add(centroids)
    ids = np.empty(x.shape[0], dtype=np.int64)
    sq = np.empty(x.shape[0], dtype=np.float32)
    for start in range(0, x.shape[0], batch_size):
        d, i = index.search(x[start : start + batch_size], 1)  # (B, 1) each
        ids[start : start + batch_size] = i[:, 0]
        sq[start : start + batch_size] = d[:, 0]
    return ids, sq


def feature_slices(dim: int, n_levels: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of `np.array_split(range(dim), n_levels)`; every slice non-empty."""
    if not 1 <= n_levels <= dim:
        raise ValueError(f"cannot split {dim} feature dims into {n_levels} non-empty slices")
    return [(int(s[0]), int(s[-1]) + 1) for s in np.array_split(np.arange(dim), n_levels)]


def product_kmeans(
    x: np.ndarray,
    ks: list[int],
    *,
    seed: int,
    niter: int = 25,
    max_points_per_centroid: int = 256,
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """One k-means per level on a slice of x (N, D) -> [centroids_l (ks[l], D_l)], stats.

    Level l uses seed + l. stats: "slices" ([lo, hi) per level), "levels" (each level's kmeans
    stats), "objective" (sum over levels), "seconds".
    """
    x = _as_points(x)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be a non-empty list of positive cluster counts, got {ks}")
    t0 = time.perf_counter()
    slices = feature_slices(x.shape[1], len(ks))
    centroids, level_stats = [], []
    for level, (k, (lo, hi)) in enumerate(zip(ks, slices, strict=True)):
        c, s = kmeans(
            x[:, lo:hi], k, seed=seed + level, niter=niter, max_points_per_centroid=max_points_per_centroid
        )
        centroids.append(c)
        level_stats.append(s)
    stats = {
        "slices": [list(s) for s in slices],
        "levels": level_stats,
        "objective": float(sum(s["objective"] for s in level_stats)),
        "seconds": time.perf_counter() - t0,
    }
    return centroids, stats


def product_assign(
    x: np.ndarray, centroids: list[np.ndarray], slices: list[tuple[int, int]]
) -> tuple[np.ndarray, dict[str, Any]]:
    """Flat path ids (N,) int64 = ravel_multi_index of the nearest centroid on each slice.

    stats: "level_ids" (list of (N,) int64 per level), "sq_dists" ((N,) float32, summed over
    levels), "objective".
    """
    x = _as_points(x)
    if len(centroids) != len(slices) or not centroids:
        raise ValueError(f"got {len(centroids)} centroid arrays for {len(slices)} slices")
    if slices[-1][1] != x.shape[1]:
        raise ValueError(f"slices {slices} do not cover the {x.shape[1]} feature dims")
    ks = [int(c.shape[0]) for c in centroids]
    level_ids, total = [], np.zeros(x.shape[0], dtype=np.float32)
    for c, (lo, hi) in zip(centroids, slices, strict=True):
        ids, sq = assign_nearest(x[:, lo:hi], c)
        level_ids.append(ids)
        total += sq
    paths = np.ravel_multi_index(tuple(level_ids), ks).astype(np.int64)
    return paths, {
        "level_ids": level_ids,
        "sq_dists": total,
        "objective": float(total.astype(np.float64).sum()),
    }
