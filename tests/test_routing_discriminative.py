"""Tests of routing.discriminative: it recovers separable classes, and its bias moves the predicted
path-size distribution toward the target; a Router with the linear head routes by it and round-trips.

python -m pytest tests/test_routing_discriminative.py -q
"""

import numpy as np

from routing import Router, RoutingConfig
from routing.discriminative import fit_discriminative


def _separable(n=600, k=4, d=8, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 4, (k, d))
    y = rng.integers(0, k, n)
    return centers[y] + rng.normal(0, 0.5, (n, d)), y


def test_recovers_true_classes_on_separable_features():
    x, y = _separable()
    (w, b), stats = fit_discriminative(x, y, n_paths=4, target=None)
    assert np.mean(np.argmax(x @ w.T + b, axis=1) == y) == 1.0
    assert stats["accuracy"] == 1.0


def test_bias_moves_predicted_distribution_toward_target():
    # overlapping classes with skewed labels: path 3 is rare and loses almost everything
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2000, 3))
    y = np.where(x[:, 0] > 1.5, 3, np.where(x[:, 1] > 0, 0, np.where(x[:, 2] > 0, 1, 2)))
    target = np.full(4, 0.25)
    (w0, b0), s0 = fit_discriminative(x, y, n_paths=4, target=None)
    (w1, b1), s1 = fit_discriminative(x, y, n_paths=4, target=target)
    np.testing.assert_allclose(w0, w1)  # only the bias changes
    before = np.array(s0["predicted_sizes"]) / len(x)
    after = np.array(s1["predicted_sizes"]) / len(x)
    assert np.abs(after - target).sum() < 0.5 * np.abs(before - target).sum()
    assert after[3] > before[3]


def test_unseen_path_gets_documents_through_the_bias():
    x, y = _separable(k=3)
    (w, b), stats = fit_discriminative(x, y, n_paths=4, target=np.full(4, 0.25))
    assert stats["label_sizes"][3] == 0 and stats["predicted_sizes"][3] > 0


def test_collapsed_labels_are_spread_to_the_target_sizes():
    # every document prefers one of two paths (as after a short training); the bias must still give
    # each of the four paths about a quarter of the documents
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, 5))
    y = np.where(x[:, 0] > 0.5, 3, 0)
    (w, b), stats = fit_discriminative(x, y, n_paths=4, target=np.full(4, 0.25))
    sizes = np.array(stats["predicted_sizes"])
    assert stats["label_sizes"][1] == stats["label_sizes"][2] == 0
    assert np.abs(sizes - 100).max() <= 10, sizes


def test_router_with_linear_head_routes_by_argmax_and_round_trips(tmp_path):
    docs = [f"alpha beta {i % 7} gamma" if i % 2 else f"delta epsilon {i % 5} zeta" for i in range(80)]
    router, _ = Router.fit(docs, levels=[2], config=RoutingConfig(featurizer="tfidf", svd_dim=4, max_features=100, method="flat"))
    x = router.features(docs)
    y = (np.arange(80) % 2).astype(np.int64)
    (w, b), _ = fit_discriminative(x, y, n_paths=2, target=None)
    disc = Router(levels=[2], method="flat", featurizer=router.featurizer, centroids=router.centroids,
                  config=router.config, linear=(w, b))
    np.testing.assert_array_equal(disc.route(docs), np.argmax(x @ w.T + b, axis=1))
    disc.save(tmp_path)
    loaded = Router.load(tmp_path)
    np.testing.assert_array_equal(loaded.route(docs), disc.route(docs))
    assert loaded.fingerprint() != router.fingerprint()
