"""The router artifact: a featurizer (`featurizers`) and k-means centroids that map document prefixes to paths.

    router, stats = Router.fit(prefixes, levels=[2, 2], config=RoutingConfig(featurizer="tfidf"))
    router.save("runs/x/router"); Router.load("runs/x/router").route(prefixes)

Method "product": one k-means per level on a contiguous slice of the features, a path is (c_0, ...,
c_{L-1}) with flat id `np.ravel_multi_index(path, levels)`; method "flat": one k-means with prod(levels)
clusters, cluster i is path i (as in c-BTM). Optional, saved with the router: per-path `penalties`
(`routing.balance`, added to the path's distance) and a discriminative `linear` router (W x + b,
`routing.discriminative`, made by `dipaco reroute`). `assign_topk` gives each document's k best paths.

On disk (`artifacts`, no pickle): `router.safetensors` (featurizer arrays, centroids) and `router.json`
(format_version, levels, method, config, fingerprint); loading checks both against the fingerprint.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from routing.artifacts import (
    FORMAT_VERSION,
    fingerprint_of,
    read_json,
    read_tensors,
    write_json,
    write_tensors,
)
from routing.assignments import check_levels
from routing.balance import capacity_assign, fit_penalties
from routing.featurizers import featurizer_from_state, make_featurizer
from routing.kmeans import assign_nearest, feature_slices, kmeans, product_assign, product_kmeans
from routing.routing_config import RoutingConfig

logger = logging.getLogger(__name__)

ROUTER_JSON, ROUTER_TENSORS = "router.json", "router.safetensors"


class Router:
    """Maps document prefixes to flat path ids in [0, prod(levels))."""

    def __init__(
        self,
        *,
        levels: list[int],
        method: str,
        featurizer: Any,
        centroids: list[np.ndarray],
        config: RoutingConfig,
        penalties: np.ndarray | None = None,
        linear: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.levels = check_levels(levels)
        self.method = method
        self.featurizer = featurizer
        self.centroids = [np.ascontiguousarray(c, dtype=np.float32) for c in centroids]
        self.config = config
        self.seed = config.seed
        self.slices = feature_slices(featurizer.dim, len(self.centroids))
        _check_centroids(self.centroids, self.slices, levels=self.levels, method=method, config=config)
        self.penalties = None if penalties is None else np.ascontiguousarray(penalties, dtype=np.float32)
        if self.penalties is not None and self.penalties.shape != (self.n_paths,):
            raise ValueError(f"penalties must have shape ({self.n_paths},), got {self.penalties.shape}")
        self.linear = None
        if linear is not None:
            w, b = (np.ascontiguousarray(a, dtype=np.float32) for a in linear)
            if w.shape != (self.n_paths, featurizer.dim) or b.shape != (self.n_paths,):
                raise ValueError(f"linear router needs W ({self.n_paths}, {featurizer.dim}) and b "
                                 f"({self.n_paths},), got {w.shape} and {b.shape}")
            self.linear = (w, b)

    @property
    def n_paths(self) -> int:
        return math.prod(self.levels)

    @property
    def kind(self) -> str:
        """"learned" when a discriminative linear head routes (`routing.discriminative`), else "kmeans"."""
        return "kmeans" if self.linear is None else "learned"

    @classmethod
    def fit(cls, prefixes: list[str], *, levels: list[int], config: RoutingConfig) -> tuple[Router, dict[str, Any]]:
        """Fit featurizer and k-means on `prefixes`; stats hold both stages and the path sizes (`fit_router`)."""
        return fit_router(prefixes, levels=levels, config=config)

    @classmethod
    def fit_on_features(cls, featurizer: Any, features: np.ndarray, *, levels: list[int], config: RoutingConfig,
                        featurizer_stats: dict[str, Any] | None = None) -> tuple[Router, dict[str, Any]]:
        """Fit the k-means (and penalties) on `features` an already fitted `featurizer` computed: a caller
        that featurizes every document anyway fits on its training rows without computing them twice."""
        return fit_on_features(featurizer, features, levels=levels, config=config, featurizer_stats=featurizer_stats)

    def features(self, prefixes: list[str]) -> np.ndarray:
        """Prefixes -> features (N, dim) float32."""
        return self.featurizer.transform(prefixes)

    def path_costs(self, features: np.ndarray) -> np.ndarray:
        """(N, paths) float32, lower = better: squared distance to the path's centroid(s) plus its
        penalty, or -(W x + b) for a discriminative router."""
        self._check_features(features)
        x = np.ascontiguousarray(features, dtype=np.float32)
        if self.linear is not None:
            w, b = self.linear
            return -(x @ w.T + b)
        cost = _path_distances(x, self.centroids, self.slices)
        return cost + self.penalties if self.penalties is not None else cost

    def assign_topk(self, features: np.ndarray, k: int, *, batch_size: int = 8192) -> np.ndarray:
        """Each document's k best paths (N, k) int64, best first (ties to the lower path id)."""
        if not 1 <= k <= self.n_paths:
            raise ValueError(f"top-k needs 1 <= k <= {self.n_paths} paths, got {k}")
        out = np.empty((len(features), k), dtype=np.int64)
        for start in range(0, len(features), batch_size):
            cost = self.path_costs(features[start : start + batch_size])
            out[start : start + len(cost)] = np.argsort(cost, axis=1, kind="stable")[:, :k]
        return out

    def assign_train(self, features: np.ndarray, *, k: int = 1) -> np.ndarray:
        """Training documents' paths (N, k), best first. With `balance`, the first choice comes from
        the exact capacity assignment (sizes within the ratio on this batch; `routing.balance`),
        the others are the next-best paths by cost; without it, `assign_topk`."""
        if not self.config.balance or self.linear is not None:
            return self.assign_topk(features, k)
        cost = self.path_costs(features)
        first, _ = capacity_assign(cost, max_ratio=self.config.balance)
        cost[np.arange(len(cost)), first] = -np.inf
        return np.argsort(cost, axis=1, kind="stable")[:, :k]

    def _check_features(self, features: np.ndarray) -> None:
        if features.ndim != 2 or features.shape[1] != self.featurizer.dim:
            raise ValueError(f"features must have shape (N, {self.featurizer.dim}), got {features.shape}")

    def assign(self, features: np.ndarray) -> np.ndarray:
        """Features (N, dim) -> flat path ids (N,) int64."""
        self._check_features(features)
        if len(features) == 0:
            return np.zeros(0, dtype=np.int64)
        if self.penalties is not None or self.linear is not None:
            return self.assign_topk(features, 1)[:, 0]
        if len(self.centroids) == 1:
            ids, _ = assign_nearest(features, self.centroids[0])
            return ids
        paths, _ = product_assign(features, self.centroids, self.slices)
        return paths

    def route(self, prefixes: list[str]) -> np.ndarray:
        """Prefixes -> flat path ids (N,) int64."""
        return self.assign(self.features(prefixes))

    def fingerprint(self) -> str:
        """sha256 hex of the saved tensors and metadata (stable across save / load)."""
        return fingerprint_of(*_router_state(self))

    def save(self, directory: str | Path) -> Path:
        """Write router.safetensors then router.json into `directory` (created); returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors, meta = _router_state(self)
        write_tensors(directory / ROUTER_TENSORS, tensors)
        write_json(directory / ROUTER_JSON, {**meta, "fingerprint": fingerprint_of(tensors, meta)})
        logger.info("router (%s, levels %s) saved to %s", self.method, self.levels, directory)
        return directory

    @classmethod
    def load(cls, directory: str | Path, *, featurizer_model: str | Path | None = None) -> Router:
        """Read a router saved by `save`; checks version, tensor names and fingerprint. `featurizer_model`:
        where the featurizer's model directory is now, when it moved since the fit (an exported mixture's
        copy; `routing.embed_hf.HFFeaturizer.from_state` checks it is the same model)."""
        directory = Path(directory)
        tensors, meta, stored, names = _read_router_files(directory)
        feat_tensors = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("featurizer.")}
        linear = (tensors["linear.weight"], tensors["linear.bias"]) if "linear.weight" in tensors else None
        router = cls(
            levels=meta["levels"],
            method=meta["method"],
            featurizer=featurizer_from_state(feat_tensors, meta["featurizer"], model_dir=featurizer_model),
            centroids=[tensors[n] for n in names if n.startswith("centroids.")],
            config=_routing_config(meta["config"], directory / ROUTER_JSON),
            penalties=tensors.get("penalties"),
            linear=linear,
        )
        if router.fingerprint() != stored:
            raise ValueError(
                f"router rebuilt from {directory} has another fingerprint than the one it was saved with"
            )
        return router


def fit_router(prefixes: list[str], *, levels: list[int], config: RoutingConfig) -> tuple[Router, dict[str, Any]]:
    """Fit the featurizer and the k-means on `prefixes`, then (`routing.balance`) the path penalties."""
    _check_enough(len(prefixes), levels)
    t0 = time.perf_counter()
    featurizer, feat_stats = make_featurizer(prefixes, config)
    router, stats = fit_on_features(featurizer, featurizer.transform(prefixes), levels=levels, config=config,
                                    featurizer_stats=feat_stats)
    stats["seconds"] = time.perf_counter() - t0
    return router, stats


def _check_enough(n: int, levels: list[int]) -> None:
    n_paths = math.prod(check_levels(levels))
    if n < n_paths:
        raise ValueError(f"levels {levels} give {n_paths} paths, but only {n} prefixes to fit on")


def fit_on_features(featurizer: Any, x: np.ndarray, *, levels: list[int], config: RoutingConfig,
                    featurizer_stats: dict[str, Any] | None = None) -> tuple[Router, dict[str, Any]]:
    """The k-means on the (N, dim) features `x` of a fitted `featurizer`, then (`routing.balance`) the
    path penalties; stats as `fit_router`'s (`featurizer_stats` as its featurizer entry)."""
    levels = check_levels(levels)
    _check_enough(len(x), levels)
    n_paths = math.prod(levels)
    t0 = time.perf_counter()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != featurizer.dim:
        raise ValueError(f"features must have shape (N, {featurizer.dim}), got {x.shape}")
    centroids, km_stats = _cluster(x, levels, config)
    router = Router(
        levels=levels, method=config.method, featurizer=featurizer, centroids=centroids, config=config
    )
    balance_stats = None
    if config.balance:
        costs = router.path_costs(x)
        unbalanced = np.bincount(costs.argmin(axis=1), minlength=n_paths)
        router.penalties, balance_stats = fit_penalties(costs, max_ratio=config.balance)
        balance_stats["unbalanced_sizes"] = unbalanced.tolist()
    sizes = np.bincount(router.assign(x), minlength=n_paths)
    stats = {
        "featurizer": featurizer_stats,
        "kmeans": km_stats,
        "balance": balance_stats,
        "sizes": sizes.tolist(),
        "empty_paths": int((sizes == 0).sum()),
        "seconds": time.perf_counter() - t0,
    }
    if stats["empty_paths"]:
        logger.warning("router: %d of %d paths got no fitting prefix", stats["empty_paths"], n_paths)
    return router, stats


def _check_centroids(centroids: list[np.ndarray], slices: list[tuple[int, int]], *, levels: list[int], method: str,
                     config: RoutingConfig) -> None:
    """A flat router has one k-means of prod(levels) centroids, a product router one per level, each over
    its feature slice."""
    ks = [c.shape[0] for c in centroids]
    expected = [math.prod(levels)] if method == "flat" or len(levels) == 1 else levels
    if method != config.method:
        raise ValueError(f"method {method!r} differs from config.method {config.method!r}")
    if ks != expected:
        raise ValueError(
            f"method {method!r} with levels {levels} needs centroid counts {expected}, got {ks}"
        )
    for c, (lo, hi) in zip(centroids, slices, strict=True):
        if c.shape[1] != hi - lo:
            raise ValueError(f"centroids of shape {c.shape} do not match feature slice [{lo}, {hi})")


def _cluster(x: np.ndarray, levels: list[int], config: RoutingConfig) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The centroids of a flat (one k-means) or product (one per level) router fitted on features `x` (N, dim)."""
    kw = {"seed": config.seed, "niter": config.kmeans_iters, "max_points_per_centroid": config.max_points_per_centroid}
    if config.method == "flat":
        centroids, stats = kmeans(x, math.prod(levels), **kw)
        return [centroids], stats
    if x.shape[1] < len(levels):
        raise ValueError(
            f"product k-means over {len(levels)} levels needs >= {len(levels)} feature dims, "
            f"but the featurizer has {x.shape[1]}"
        )
    return product_kmeans(x, levels, **kw)


def _path_distances(x: np.ndarray, centroids: list[np.ndarray], slices: list[tuple[int, int]]) -> np.ndarray:
    """(N, paths) float32: the sum over levels of the squared distance of each level's feature slice to
    the path's centroid in that level (flat path ids in `ravel_multi_index` order)."""
    per_level = []
    for c, (lo, hi) in zip(centroids, slices, strict=True):
        xs = x[:, lo:hi]
        per_level.append(np.maximum((xs**2).sum(1, keepdims=True) - 2 * xs @ c.T + (c**2).sum(1), 0))
    ks = [c.shape[0] for c in centroids]
    cost = np.zeros((len(x),) + tuple(ks), dtype=np.float32)
    for level, d in enumerate(per_level):
        shape = [len(x)] + [1] * len(ks)
        shape[level + 1] = ks[level]
        cost = cost + d.reshape(shape)
    return cost.reshape(len(x), -1)  # C order = ravel_multi_index order of the flat path ids


def _router_state(self: Router) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What a router saves: its tensors and metadata (the fingerprint is taken over both)."""
    feat_tensors, feat_meta = self.featurizer.state_dict()
    tensors = {f"featurizer.{k}": v for k, v in feat_tensors.items()}
    tensors.update({f"centroids.{i}": c for i, c in enumerate(self.centroids)})
    if self.penalties is not None:
        tensors["penalties"] = self.penalties
    if self.linear is not None:
        tensors["linear.weight"], tensors["linear.bias"] = self.linear
    meta = {
        "format_version": FORMAT_VERSION,
        "levels": self.levels,
        "method": self.method,
        "n_paths": self.n_paths,
        "slices": [list(s) for s in self.slices],
        "config": _fitted_config(self.config),
        "seed": self.seed,
        "featurizer": feat_meta,
    }
    return tensors, meta


def _fitted_config(config: RoutingConfig) -> dict[str, Any]:
    """The routing config saved with a router: what it was fitted with. `routing.router` (which router a run
    uses) is not a property of a fitted router (a learned one holds its `linear` tensors), so it is left
    out, and routers saved before the switch existed keep their fingerprint."""
    saved = asdict(config)
    saved.pop("router")
    return saved


def _read_router_files(directory: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], str | None, list[str]]:
    """A saved router's tensors, its metadata, the fingerprint stored with it and its centroid and featurizer
    tensor names; refused when the two files do not match or a tensor is missing."""
    meta = read_json(directory / ROUTER_JSON)
    tensors = read_tensors(directory / ROUTER_TENSORS)
    stored = meta.pop("fingerprint", None)
    if fingerprint_of(tensors, meta) != stored:
        raise ValueError(
            f"{directory / ROUTER_TENSORS} and {directory / ROUTER_JSON} do not match the fingerprint "
            f"stored in the latter (files from different saves, edited, or corrupted)"
        )
    n_levels = 1 if meta["method"] == "flat" else len(meta["levels"])
    names = [f"centroids.{i}" for i in range(n_levels)]
    if meta["featurizer"]["name"] == "tfidf":
        names += ["featurizer.idf", "featurizer.components"]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{directory / ROUTER_TENSORS} lacks tensors {missing}")
    return tensors, meta, stored, names


def _routing_config(saved: dict[str, Any], file: Path) -> RoutingConfig:
    """The routing config a router was fitted with; one saved by an older version of its fields is refused."""
    known = {f.name for f in fields(RoutingConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ValueError(f"{file} was fitted with routing keys this version does not have ({', '.join(unknown)}); "
                         f"fit the router again (`dipaco route`)")
    return RoutingConfig(**saved)
