"""Tests of routing.kmeans against scikit-learn and against values derived directly in the test.

python -m pytest tests/test_routing_kmeans.py -q
"""

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.datasets import make_blobs

from routing.kmeans import assign_nearest, kmeans, product_assign, product_kmeans


def _blobs(n=2000, d=16, k=8, seed=0) -> np.ndarray:
    x, _ = make_blobs(n_samples=n, n_features=d, centers=k, cluster_std=2.0, random_state=seed)
    return x.astype(np.float32)


def _objective(x: np.ndarray, centroids: np.ndarray) -> float:
    """Sum over points of the squared distance to the nearest centroid, in float64 numpy."""
    x, c = x.astype(np.float64), centroids.astype(np.float64)
    d2 = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)  # (N, k)
    return float(d2.min(axis=1).sum())


def test_objective_within_10_percent_of_sklearn():
    x = _blobs()
    ours, stats = kmeans(x, 8, seed=0, niter=25)
    assert ours.shape == (8, 16) and ours.dtype == np.float32
    ref = KMeans(n_clusters=8, n_init=3, random_state=0).fit(x).cluster_centers_
    ours_obj, ref_obj = _objective(x, ours), _objective(x, ref)
    assert ours_obj <= 1.10 * ref_obj, (ours_obj, ref_obj)
    assert stats["objective"] == pytest.approx(ours_obj, rel=1e-4)
    assert sum(stats["sizes"]) == len(x) and 1 <= stats["iterations"] <= 25


def test_objective_counts_all_points_when_faiss_subsamples():
    x = _blobs(n=3000, k=4)
    centroids, stats = kmeans(x, 4, seed=0, max_points_per_centroid=50)  # trains on 200 points
    assert stats["objective"] == pytest.approx(_objective(x, centroids), rel=1e-4)
    assert sum(stats["sizes"]) == 3000


def test_assign_nearest_matches_brute_force_across_batches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1000, 8)).astype(np.float32)
    c = rng.normal(size=(5, 8)).astype(np.float32)
    ids, sq = assign_nearest(x, c, batch_size=64)
    d2 = ((x[:, None, :].astype(np.float64) - c[None].astype(np.float64)) ** 2).sum(-1)
    assert ids.dtype == np.int64 and sq.dtype == np.float32
    np.testing.assert_array_equal(ids, d2.argmin(1))
    np.testing.assert_allclose(sq, d2.min(1), rtol=1e-4, atol=1e-4)


def test_k_validation_names_both_numbers():
    x = np.zeros((5, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"k=6.*N=5"):
        kmeans(x, 6, seed=0)
    with pytest.raises(ValueError, match="dimension 3"):
        assign_nearest(x, np.zeros((2, 4), dtype=np.float32))


def test_same_seed_gives_identical_centroids_and_assignments():
    x = _blobs(n=3000, d=12, k=6, seed=2)
    c1, _ = kmeans(x, 6, seed=7, max_points_per_centroid=100)
    c2, _ = kmeans(x, 6, seed=7, max_points_per_centroid=100)
    assert c1.tobytes() == c2.tobytes()
    np.testing.assert_array_equal(assign_nearest(x, c1)[0], assign_nearest(x, c2)[0])
    p1, s1 = product_kmeans(x, [2, 3], seed=7)
    p2, s2 = product_kmeans(x, [2, 3], seed=7)
    slices = [tuple(s) for s in s1["slices"]]
    np.testing.assert_array_equal(product_assign(x, p1, slices)[0], product_assign(x, p2, slices)[0])
    c3, _ = kmeans(x, 6, seed=8, max_points_per_centroid=100)
    assert c1.tobytes() != c3.tobytes()


def test_product_kmeans_paths_are_ravelled_per_slice_nearest_centroids():
    ks = [3, 4]
    rng = np.random.default_rng(0)
    # Independent blob structure on each half of the features, so all 3 x 4 paths are populated.
    left = _blobs(n=2400, d=6, k=3, seed=1)
    right = _blobs(n=2400, d=5, k=4, seed=2)[rng.permutation(2400)]
    x = np.concatenate([left, right], axis=1)  # (N, 11)
    centroids, stats = product_kmeans(x, ks, seed=0)
    bounds = [(int(s[0]), int(s[-1]) + 1) for s in np.array_split(np.arange(x.shape[1]), len(ks))]
    assert [tuple(s) for s in stats["slices"]] == bounds == [(0, 6), (6, 11)]
    assert [c.shape for c in centroids] == [(3, 6), (4, 5)]
    assert len(stats["levels"]) == 2

    paths, pstats = product_assign(x, centroids, bounds)
    per_level = []
    for c, (lo, hi) in zip(centroids, bounds, strict=True):
        d2 = ((x[:, None, lo:hi].astype(np.float64) - c[None].astype(np.float64)) ** 2).sum(-1)
        per_level.append(d2.argmin(1))
    expected = np.ravel_multi_index(tuple(per_level), ks)
    np.testing.assert_array_equal(paths, expected)
    assert paths.dtype == np.int64
    assert set(np.unique(paths).tolist()) == set(range(int(np.prod(ks))))
    for level, ids in enumerate(pstats["level_ids"]):
        np.testing.assert_array_equal(ids, per_level[level])


def test_product_kmeans_rejects_too_many_levels():
    with pytest.raises(ValueError, match="3 feature dims into 4"):
        product_kmeans(np.zeros((10, 3), dtype=np.float32), [2, 2, 2, 2], seed=0)


def test_dipaco_route_logs_no_faiss_loader_chatter_and_keeps_its_warnings():
    """faiss's loader logs each build it fails to load at INFO ("Could not load library with AVX512 support
    due to: ModuleNotFoundError(...)") when faiss is first imported, which a new user of `dipaco route`
    (logging at INFO) reads as an error: a fresh process that logs at INFO and imports routing.kmeans, as
    `dipaco route` does, shows none of it, and the loader's warnings and errors still show."""
    import logging
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s: %(message)s'); "
            "import routing.kmeans; logging.getLogger('routing.kmeans').info('imported')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "routing.kmeans INFO: imported" in result.stderr  # the process did log at INFO
    assert "Could not load library" not in result.stderr and "faiss.loader" not in result.stderr, result.stderr[:2000]
    loader = logging.getLogger("faiss.loader")  # routing.kmeans is imported here too: warnings and errors still show
    assert loader.isEnabledFor(logging.WARNING) and not loader.isEnabledFor(logging.INFO)
