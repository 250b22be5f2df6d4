"""The discriminative router (DiPaCo §2.4.2, approximate hard EM): a multinomial logistic regression
from prefix features to the path that scored a document best, with a bias that matches a target
distribution of path sizes.

`fit_discriminative(features, labels, n_paths=..., target=...)` fits scikit-learn's
`LogisticRegression` (multinomial, L2, `c` = inverse strength) on (features, label) pairs, expands
it to all `n_paths` rows (a path no document chose gets a small seeded random weight row), then shifts the bias:
b_j += log(target_j) - log(mean_i softmax_j(W x_i + b)), repeated until the predicted (soft) share
of each path matches the target, then refines it with exact moves until the *hard* (argmax) path
sizes on the fitting documents approach the target — without it, small paths empty out (the
paper's observation; on the demo after 2 rounds, 300 router documents all preferred 2 of 4 paths).
Returns (W (n_paths, D) float32, b (n_paths,) float32) and stats; `Router(..., linear=(W, b))`
routes by argmax(W x + b). CPU check:

    python -c "import numpy as np; from routing.discriminative import fit_discriminative; \
x = np.random.default_rng(0).normal(size=(300, 4)); y = (x[:, 0] > 0).astype(int); \
print(fit_discriminative(x, y, n_paths=2, target=np.array([.5, .5]))[1])"
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _match_hard(logits: np.ndarray, b: np.ndarray, counts: np.ndarray, *, moves: int) -> np.ndarray:
    """Refine the bias so that the *hard* argmax sizes approach `counts`: the most oversized path
    lowers its bias until exactly its excess prefers another path (exact moves; the bias with the
    smallest L1 size error is kept). Soft matching alone can leave a path with a flat logit row
    (no document chose it) winning every near-tie, or none."""
    n, k = logits.shape
    b = b.astype(np.float64).copy()
    eps = 1e-6 * max(1.0, float(np.abs(logits).max()))
    best, best_err = b.copy(), np.inf
    for _ in range(moves + 1):
        s = logits + b
        a = s.argmax(axis=1)
        sizes = np.bincount(a, minlength=k)
        err = int(np.abs(sizes - counts).sum())
        if err < best_err:
            best, best_err = b.copy(), err
        over = sizes - counts
        j = int(np.argmax(over))
        if over[j] <= 1:
            break
        members = np.flatnonzero(a == j)
        margin = s[members, j] - np.delete(s[members], j, axis=1).max(axis=1)  # >= 0
        b[j] -= np.partition(margin, over[j] - 1)[over[j] - 1] + eps
    return best


def fit_discriminative(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    n_paths: int,
    target: np.ndarray | None,
    c: float = 1.0,
    bias_iters: int = 200,
    seed: int = 0,
) -> tuple[tuple[np.ndarray, np.ndarray], dict[str, Any]]:
    """((W, b), stats): stats hold "accuracy" (on the fitting pairs, before the bias shift),
    "label_sizes", "predicted_sizes_before" / "predicted_sizes" (hard argmax counts on `features`),
    "target", "seconds". target=None keeps the logistic regression's own bias."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if x.ndim != 2 or len(x) != len(y) or len(x) == 0:
        raise ValueError(f"features (N, D) and labels (N,) must match and be non-empty, got {x.shape}, {y.shape}")
    if y.min() < 0 or y.max() >= n_paths:
        raise ValueError(f"labels must be path ids in [0, {n_paths}), got [{y.min()}, {y.max()}]")
    t0 = time.perf_counter()
    w, b = _logistic_rows(x, y, n_paths=n_paths, c=c, seed=seed)
    accuracy = float(np.mean(np.argmax(x @ w.T + b, axis=1) == y))
    before = np.bincount(np.argmax(x @ w.T + b, axis=1), minlength=n_paths)
    if target is not None:
        target, b = _shift_bias(x, w, b, target, n_paths=n_paths, bias_iters=bias_iters)
    after = np.bincount(np.argmax(x @ w.T + b, axis=1), minlength=n_paths)
    stats = {
        "documents": int(len(y)),
        "accuracy": accuracy,
        "label_sizes": np.bincount(y, minlength=n_paths).tolist(),
        "predicted_sizes_before": before.tolist(),
        "predicted_sizes": after.tolist(),
        "target": None if target is None else target.tolist(),
        "seconds": time.perf_counter() - t0,
    }
    logger.info("discriminative router: accuracy %.3f on %d docs, sizes %s -> %s", accuracy, len(y),
                before.tolist(), after.tolist())
    return (w.astype(np.float32), b.astype(np.float32)), stats


def _logistic_rows(
    x: np.ndarray, y: np.ndarray, *, n_paths: int, c: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(W (n_paths, D), b (n_paths,)) float64 of a logistic regression of labels y (N,) on x (N, D).

    One label: that path's bias 0, every other -10. A path no label names gets a distinct small random
    row and a bias 10 below the lowest fitted one, so that the bias shift can still give it documents.
    """
    from sklearn.linear_model import LogisticRegression

    classes = np.unique(y)
    w = np.zeros((n_paths, x.shape[1]))
    b = np.zeros(n_paths)
    if len(classes) == 1:
        b[:] = -10.0
        b[classes[0]] = 0.0
        return w, b
    lr = LogisticRegression(C=c, max_iter=1000, random_state=seed)
    lr.fit(x, y)
    coef, inter = lr.coef_, lr.intercept_
    if len(classes) == 2:  # binary: sklearn keeps one row for the positive class
        coef = np.stack([-coef[0] / 2, coef[0] / 2])
        inter = np.array([-inter[0] / 2, inter[0] / 2])
    w[classes], b[classes] = coef, inter
    unseen = np.setdiff1d(np.arange(n_paths), classes)
    # distinct small random rows, so the bias can give unseen paths documents (identical zero
    # rows would tie, and the lowest path id would take them all)
    scale = 0.1 * float(np.linalg.norm(coef, axis=1).mean()) / np.sqrt(x.shape[1])
    w[unseen] = np.random.default_rng(seed).normal(0.0, scale, (len(unseen), x.shape[1]))
    b[unseen] = inter.min() - 10.0
    return w, b


def _shift_bias(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, target: np.ndarray, *, n_paths: int, bias_iters: int
) -> tuple[np.ndarray, np.ndarray]:
    """(target shares normalised, b shifted): `bias_iters` steps moving the mean soft assignment of x (N, D)
    to the target shares, then single moves matching the hard argmax counts to them (`_match_hard`)."""
    target = np.asarray(target, dtype=np.float64)
    if target.shape != (n_paths,) or (target <= 0).any():
        raise ValueError(f"target must be {n_paths} positive shares, got {target}")
    target = target / target.sum()
    logits = x @ w.T
    b = b.copy()
    for _ in range(bias_iters):
        q = _softmax(logits + b).mean(axis=0)
        b += np.log(target) - np.log(np.maximum(q, 1e-12))
    return target, _match_hard(logits, b, np.round(target * len(x)).astype(np.int64), moves=20 * n_paths)
