"""What a router costs and how it spreads documents: milliseconds per routed prefix, and the load balance.

    cost = routing_cost({"kmeans": kmeans_router, "learned": learned_router}, prefixes)
    cost["learned"]["ms_per_document"], cost["learned"]["assign_ms_per_document"]
    load_balance(paths, n_paths=16)   # {"min", "median", "max", "entropy_bits", "max_entropy_bits", ...}

Routing a prefix is featurizing its text (the routers here share one featurizer) and picking a path
from the features (nearest centroid for k-means, argmax of W x + b for the learned router). Both parts
are timed on the same prefixes, each the best of `repeats` passes (`time.perf_counter`), so the figures
compare on one machine. CPU check:

    python -c "import numpy as np; from routing.router_cost import load_balance; \
print(load_balance(np.array([0, 0, 1, 3]), n_paths=4))"
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def routing_cost(routers: dict[str, Any], prefixes: list[str], *, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Per router name: "featurize_ms_per_document" (prefix text -> features), "assign_ms_per_document"
    (features -> path) and "ms_per_document" (their sum), over `prefixes`; the featurizer is timed per
    router (each may have its own)."""
    if not prefixes:
        raise ValueError("routing cost needs at least one prefix")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = {}
    for name, router in routers.items():
        features = router.features(prefixes)
        featurize = _best_seconds(lambda r=router: r.features(prefixes), repeats)
        assign = _best_seconds(lambda r=router, x=features: r.assign(x), repeats)
        ms = 1000.0 / len(prefixes)
        out[name] = {"featurize_ms_per_document": featurize * ms, "assign_ms_per_document": assign * ms,
                     "ms_per_document": (featurize + assign) * ms, "documents": len(prefixes)}
    return out


def load_balance(paths: np.ndarray, *, n_paths: int) -> dict[str, Any]:
    """Documents per path of the routed `paths` (N,): "min", "median", "max", "empty_paths", "sizes" and the
    entropy of the path distribution in bits ("entropy_bits"; log2(n_paths) = "max_entropy_bits" when even)."""
    paths = np.asarray(paths, dtype=np.int64)
    if len(paths) and (paths.min() < 0 or paths.max() >= n_paths):
        raise ValueError(f"paths must be in [0, {n_paths}), got [{paths.min()}, {paths.max()}]")
    sizes = np.bincount(paths, minlength=n_paths)
    share = sizes[sizes > 0] / max(len(paths), 1)
    return {
        "documents": int(len(paths)),
        "min": int(sizes.min()),
        "median": float(np.median(sizes)),
        "max": int(sizes.max()),
        "empty_paths": int((sizes == 0).sum()),
        "entropy_bits": float(-(share * np.log2(share)).sum()) if len(paths) else 0.0,
        "max_entropy_bits": float(np.log2(n_paths)),
        "sizes": sizes.tolist(),
    }
