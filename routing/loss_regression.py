"""The loss-regression head of the learned router: a ridge regression from prefix features to every path's
loss on the document, routing each document to the path of lowest predicted loss.

`fit_loss_regression(features, losses, alphas=...)` standardizes the features, fits one ridge regression
per path (all paths share the L2 strength, picked from `alphas` by exact leave-one-out error, from one SVD)
and returns the linear router (W, b) whose argmax(W x + b) is the argmin of the predicted losses, so
`Router(..., linear=(W, b))` routes by it unchanged, at the logistic head's cost. Where the logistic
head learns from each document's one best path (with 64 paths and 700 router documents, about 11
labels per path), the regression learns from every path's loss on every document: each document
informs every path's row. CPU check:

    python -c "import numpy as np; from routing.loss_regression import fit_loss_regression; \
x = np.random.default_rng(0).normal(size=(300, 4)); l = np.stack([x[:, 0], -x[:, 0]], 1); \
print(fit_loss_regression(x, l)[1])"
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ALPHAS = tuple(10.0 ** k for k in range(-3, 5))  # L2 strengths tried, on standardized features


def _loo_errors(u: np.ndarray, s: np.ndarray, y: np.ndarray, alphas: tuple[float, ...]) -> np.ndarray:
    """Mean squared leave-one-out error (one per alpha) of the ridge regressions of centred `y` (N, P) on
    the centred, standardized features with thin SVD `u` (N, r), `s` (r,): residual / (1 - leverage)."""
    uty = u.T @ y  # (r, P)
    out = []
    for alpha in alphas:
        shrink = s**2 / (s**2 + alpha)  # (r,)
        fitted = u @ (shrink[:, None] * uty)  # (N, P)
        leverage = (u**2) @ shrink + 1.0 / len(y)  # (N,): the intercept's share too
        residual = (y - fitted) / (1.0 - leverage)[:, None]
        out.append(float(np.mean(residual**2)))
    return np.asarray(out)


def fit_loss_regression(features: np.ndarray, losses: np.ndarray, *,
                        alphas: tuple[float, ...] = ALPHAS) -> tuple[tuple[np.ndarray, np.ndarray], dict[str, Any]]:
    """((W (P, D), b (P,)) float32, stats): the router argmax(W x + b) = argmin of the ridge-predicted losses.

    `features` (N, D), `losses` (N, P): each document's loss under every path (finite). stats: "alpha" (the
    chosen L2 strength), "loo_mse" (per alpha), "accuracy" (the predicted best path = the lowest-loss path,
    on the fitting documents), "label_sizes" / "predicted_sizes" (per path), "documents", "seconds"."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 2 or len(x) != len(y) or len(x) < 3:
        raise ValueError(f"features (N, D) and losses (N, P) must match with N >= 3, got {x.shape}, {y.shape}")
    if not np.isfinite(y).all():
        raise ValueError("losses must be finite: the regression needs every path's loss on every document "
                         "(reroute.candidates 0)")
    if not alphas or min(alphas) <= 0:
        raise ValueError(f"alphas must be positive L2 strengths, got {alphas}")
    t0 = time.perf_counter()
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    z = (x - mean) / scale
    y_mean = y.mean(axis=0)
    u, s, vt = np.linalg.svd(z, full_matrices=False)
    errors = _loo_errors(u, s, y - y_mean, alphas)
    alpha = alphas[int(np.argmin(errors))]
    coef = vt.T @ ((s / (s**2 + alpha))[:, None] * (u.T @ (y - y_mean)))  # (D, P) on standardized features
    w = coef.T / scale  # (P, D) on the raw features
    b = y_mean - w @ mean
    predicted = np.argmin(x @ w.T + b, axis=1)
    labels = np.argmin(y, axis=1)
    stats = {"head": "regression", "documents": int(len(y)), "alpha": float(alpha),
             "loo_mse": dict(zip(map(float, alphas), errors.tolist())),
             "accuracy": float(np.mean(predicted == labels)),
             "label_sizes": np.bincount(labels, minlength=y.shape[1]).tolist(),
             "predicted_sizes": np.bincount(predicted, minlength=y.shape[1]).tolist(),
             "seconds": time.perf_counter() - t0}
    logger.info("loss regression: alpha %g, best path predicted for %.1f%% of %d documents", alpha,
                100 * stats["accuracy"], len(y))
    return ((-w).astype(np.float32), (-b).astype(np.float32)), stats
