"""Tests of routing.balance and the balanced / top-k / product routing in routing.router.

python -m pytest tests/test_routing_balance.py -q
"""

import numpy as np
import pytest

from routing import RoutingConfig
from routing.balance import _auction, capacity_assign, fit_penalties, size_bounds
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


def _auction_recomputed(d, p, *, lo, hi, max_ratio, max_moves):
    """The auction as `fit_penalties` documents it, the whole assignment argmin(d + p) recomputed at every move."""
    n, k = d.shape
    p = p.astype(np.float32).copy()
    eps = np.float32(1e-5 * max(1.0, float(np.abs(d).max())))
    best, best_ratio = p.copy(), float("inf")
    for move in range(max_moves + 1):
        cost = d + p
        a = cost.argmin(axis=1)
        sizes = np.bincount(a, minlength=k)
        ratio = float(sizes.max() / sizes.min()) if sizes.min() else float("inf")
        if ratio < best_ratio:
            best, best_ratio = p.copy(), ratio
        if ratio <= max_ratio or move == max_moves:
            return best, move
        over, under = sizes - hi, lo - sizes
        j = int(np.argmax(np.maximum(over, under)))
        row = cost[a == j] if over[j] >= under[j] and over[j] > 0 else None
        if row is not None:
            margin = np.sort(np.delete(row, j, axis=1).min(axis=1) - row[:, j])
            p[j] += margin[over[j] - 1] + eps
        else:
            gain = np.sort(cost[a != j, j] - cost[a != j].min(axis=1))
            p[j] -= gain[max(int(under[j]), 1) - 1] + eps
    return best, max_moves


@pytest.mark.parametrize("seed,k,ties", [(0, 12, False), (1, 40, False), (2, 16, True), (3, 7, True)])
def test_the_auctions_moves_equal_recomputing_the_whole_assignment_at_every_move(seed, k, ties):
    x = _skewed(n=2000, seed=seed)
    c = np.random.default_rng(seed + 10).normal(0, 3.0, (k, x.shape[1])).astype(np.float32)
    d = _sq_dists(x, c)
    if ties:  # whole numbers: many documents tie between paths, and ties go to the lower path
        d = np.round(d / 4).astype(np.float32)
    lo, hi = size_bounds(len(d), k, 1.05)
    start = np.zeros(k, dtype=np.float32)
    fast, moves = _auction(d, start, lo=lo, hi=hi, max_ratio=1.05, max_moves=20 * k)
    slow, slow_moves = _auction_recomputed(d, start, lo=lo, hi=hi, max_ratio=1.05, max_moves=20 * k)
    assert moves == slow_moves and moves > k  # many moves of both kinds, not the first one alone
    np.testing.assert_array_equal(fast, slow)


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
