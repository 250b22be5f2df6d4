"""Tests of routing.balance and the balanced / top-k / product routing in routing.router.

python -m pytest tests/test_routing_balance.py -q
"""

import numpy as np
import pytest

from routing import RoutingConfig
from routing.balance import capacity_assign, fit_penalties, size_bounds
from routing.embed import TfidfSvdFeaturizer
from routing.kmeans import assign_nearest, feature_slices, product_kmeans
from routing.router import Router


def _skewed(n=3000, d=6, seed=0):
    """90% of the points in one blob, the rest spread: plain nearest-centroid is very unbalanced."""
    rng = np.random.default_rng(seed)
    big = rng.normal(0, 0.3, (int(0.9 * n), d))
    rest = rng.normal(0, 3.0, (n - len(big), d))
    return np.concatenate([big, rest]).astype(np.float32)


def _sq_dists(x, c):
    return ((x[:, None, :] - c[None]) ** 2).sum(-1)


@pytest.mark.parametrize("ratio", [1.05, 1.5])
def test_penalties_keep_sizes_within_ratio_on_skewed_data(ratio):
    x = _skewed()
    c = np.random.default_rng(1).normal(0, 3.0, (12, x.shape[1])).astype(np.float32)
    d = _sq_dists(x, c)
    plain = np.bincount(d.argmin(1), minlength=12)
    assert plain.max() > 5 * max(plain.min(), 1)  # the data really is skewed
    p, stats = fit_penalties(d, max_ratio=ratio)
    sizes = np.bincount((d + p).argmin(1), minlength=12)
    assert stats["converged"] and sizes.min() > 0 and sizes.max() <= ratio * sizes.min()
    assert sizes.tolist() == stats["sizes"]


def test_capacity_assign_guarantees_bounds():
    x = _skewed(n=1001)
    c = np.random.default_rng(2).normal(0, 3.0, (16, x.shape[1])).astype(np.float32)
    ids, stats = capacity_assign(_sq_dists(x, c), max_ratio=1.1)
    lo, hi = size_bounds(1001, 16, 1.1)
    sizes = np.bincount(ids, minlength=16)
    assert sizes.sum() == 1001 and sizes.min() >= lo and sizes.max() <= hi and hi <= 1.1 * lo


def test_balanced_assignment_is_deterministic():
    x = _skewed(seed=3)
    c = np.random.default_rng(3).normal(0, 3.0, (8, x.shape[1])).astype(np.float32)
    d = _sq_dists(x, c)
    p1, _ = fit_penalties(d, max_ratio=1.1)
    p2, _ = fit_penalties(d.copy(), max_ratio=1.1)
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(capacity_assign(d, max_ratio=1.1)[0], capacity_assign(d, max_ratio=1.1)[0])


def test_product_paths_are_the_tuple_of_per_slice_nearest_centroids():
    x = np.random.default_rng(4).normal(size=(500, 7)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ks = [3, 4]
    centroids, _ = product_kmeans(x, ks, seed=0, niter=5)
    cfg = RoutingConfig(featurizer="tfidf", method="product", svd_dim=7)
    feat = TfidfSvdFeaturizer.__new__(TfidfSvdFeaturizer)  # only .dim is used by assign
    feat.components = np.zeros((7, 1))
    router = Router(levels=ks, method="product", featurizer=feat, centroids=centroids, config=cfg)
    expected = [assign_nearest(x[:, lo:hi], c)[0] for c, (lo, hi) in zip(centroids, feature_slices(7, 2))]
    np.testing.assert_array_equal(router.assign(x), expected[0] * 4 + expected[1])
    # the all-paths cost table gives the same paths (zero penalties), and top-1 equals assign
    router.penalties = np.zeros(12, dtype=np.float32)
    np.testing.assert_array_equal(router.assign(x), expected[0] * 4 + expected[1])
    top2 = router.assign_topk(x, 2)
    assert (top2[:, 0] != top2[:, 1]).all()


def test_router_fit_with_balance_balances_product_paths():
    rng = np.random.default_rng(5)
    words = [f"w{i}" for i in range(60)]
    # a Zipf-like mix of topics: product k-means alone leaves small paths
    docs = [" ".join(rng.choice(words[(t % 6) * 10:(t % 6) * 10 + 10], 10))
            for t in rng.zipf(1.6, size=900)]
    cfg = RoutingConfig(featurizer="tfidf", svd_dim=8, max_features=500, kmeans_iters=10, balance=1.2, method="product")
    router, stats = Router.fit(docs, levels=[2, 3], config=cfg)
    unbalanced = np.array(stats["balance"]["unbalanced_sizes"])
    assert unbalanced.max() > 2 * unbalanced.min()  # plain product k-means is unbalanced here
    # the penalties alone (used for new documents) improve the ratio; ties keep it above 1.2
    routed = np.bincount(router.route(docs), minlength=6)
    assert routed.max() / routed.min() < unbalanced.max() / max(unbalanced.min(), 1)
    # the training documents are placed exactly within the ratio
    top = router.assign_train(router.features(docs), k=2)
    sizes = np.bincount(top[:, 0], minlength=6)
    assert sizes.min() > 0 and sizes.max() <= 1.2 * sizes.min()
    assert (top[:, 0] != top[:, 1]).all()
