"""routing.loss_regression: the ridge head against scikit-learn's Ridge and a brute-force leave-one-out, and
a Router with it routes each document to the path of lowest predicted loss.

python -m pytest tests/test_loss_regression.py -q
"""

import numpy as np
import pytest
from sklearn.linear_model import Ridge
from sklearn.preprocessing import StandardScaler

from routing.loss_regression import _loo_errors, fit_loss_regression


def _data(n=120, d=5, p=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * rng.uniform(0.5, 3, d) + rng.normal(size=d)
    losses = x @ rng.normal(size=(d, p)) + rng.normal(0, 0.5, (n, p)) + 5.0
    return x, losses


def test_predictions_equal_sklearn_ridge_at_the_chosen_alpha():
    x, losses = _data()
    (w, b), stats = fit_loss_regression(x, losses)
    scaler = StandardScaler().fit(x)
    reference = Ridge(alpha=stats["alpha"]).fit(scaler.transform(x), losses).predict(scaler.transform(x))
    np.testing.assert_allclose(-(x @ w.T + b), reference, rtol=1e-4, atol=1e-4)
    assert stats["alpha"] == min(stats["loo_mse"], key=stats["loo_mse"].get)
    assert stats["accuracy"] == np.mean(np.argmin(reference, axis=1) == np.argmin(losses, axis=1))


def test_leave_one_out_error_equals_refitting_without_each_document():
    x, losses = _data(n=30, d=3, p=2, seed=1)
    z = StandardScaler().fit_transform(x)  # the fit standardizes once, on every document
    u, s, _ = np.linalg.svd(z - z.mean(axis=0), full_matrices=False)
    got = _loo_errors(u, s, losses - losses.mean(axis=0), (0.5, 5.0))
    for alpha, value in zip((0.5, 5.0), got):
        errors = []
        for i in range(len(x)):
            keep = np.arange(len(x)) != i
            model = Ridge(alpha=alpha).fit(z[keep], losses[keep])
            errors.append((model.predict(z[i : i + 1])[0] - losses[i]) ** 2)
        assert value == pytest.approx(np.mean(errors), rel=1e-9)


def test_routes_to_the_path_of_lowest_loss_and_refuses_missing_losses():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, 3))
    losses = np.stack([x[:, 0], -x[:, 0], x[:, 1] + 3], axis=1)  # path 2 never best
    (w, b), stats = fit_loss_regression(x, losses)
    routed = np.argmax(x @ w.T + b, axis=1)
    assert np.mean(routed == np.argmin(losses, axis=1)) > 0.97 and stats["predicted_sizes"][2] == 0
    losses[0, 1] = np.inf
    with pytest.raises(ValueError, match="every path's loss"):
        fit_loss_regression(x, losses)


def test_reroute_head_regression_routes_each_prefix_to_its_lowest_predicted_loss():
    """`reroute.head=regression`: `dipaco reroute`'s fit gives a Router whose route is the argmin of the
    ridge predictions (numpy here), and refuses losses scored on only some candidate paths."""
    from cli_helpers import TINY

    from dipaco.config import load_config
    from dipaco.stages.reroute import _fit_learned
    from routing import Router, RoutingConfig
    from routing.assignments import Assignments

    docs = [f"alpha beta {i % 7} gamma" if i % 2 else f"delta epsilon {i % 5} zeta" for i in range(80)]
    router, _ = Router.fit(docs, levels=[2], config=RoutingConfig(featurizer="tfidf", svd_dim=4, max_features=100,
                                                                 method="flat"))
    x = router.features(docs)
    nll = np.stack([x[:, 0] + 0.1 * x[:, 1], -x[:, 0]], axis=1) + 4.0  # (D, 2)
    old = Assignments(path=router.route(docs), split=np.zeros(80, dtype=np.int8), levels=[2],
                      router_fingerprint=router.fingerprint())
    config = load_config(TINY, ["reroute.head=regression"])
    learned, stats = _fit_learned(router, x, nll.argmin(axis=1), old, config, nll=nll)
    z = (x - x.mean(axis=0)) / np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
    predicted = Ridge(alpha=stats["alpha"]).fit(z, nll).predict(z)
    np.testing.assert_array_equal(learned.route(docs), predicted.argmin(axis=1))
    assert learned.kind == "learned" and stats["head"] == "regression"
    nll[3, 1] = np.inf
    with pytest.raises(ValueError, match="reroute.candidates 0"):
        _fit_learned(router, x, nll.argmin(axis=1), old, config, nll=nll)
