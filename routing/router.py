"""The router artifact (featurizer + centroids) and the document -> path assignments.

`Router.fit` featurizes document prefixes (TF-IDF -> SVD -> L2) and clusters them:
- method "product": one k-means per level on a contiguous slice of the features (ks = levels);
  a path is (c_0, ..., c_{L-1}), its flat id `np.ravel_multi_index(path, levels)`;
- method "flat": one k-means with prod(levels) clusters; cluster i is flat path id i, i.e. the
  path `np.unravel_index(i, levels)` (which modules a cluster gets is arbitrary, as in c-BTM).
A 1-level "product" router is the same as "flat".

Optional parts, each stored with the router:
- `penalties` (prod(levels),): with `routing.balance` > 0, a per-path penalty added to the path's
  distance (`routing.balance`), so that path sizes stay within the configured ratio; the distance of
  a product path is the sum of its per-level squared distances;
- `linear` (W (paths, dim), b (paths,)): a discriminative router (`routing.discriminative`, made by
  `dipaco reroute`); when present, a document goes to argmax(W x + b) instead.
`assign_topk` gives each document's k best paths (training overlap, `routing.train_top_k`).

On disk (no pickle): `router.safetensors` (featurizer arrays "featurizer.*", centroids
"centroids.<level>") and `router.json` (format_version, levels, method, config, seed, vocabulary,
fingerprint). `Assignments` (flat path id + split code per doc_id) are saved as
`assignments.safetensors` + `assignments.json` (counts per path per split, sha256 of the tensors).
Every file is written to a temporary name and renamed; the JSON goes last. Loaders refuse an
unknown format_version or a checksum mismatch with an error naming the file. Usage:

    router, stats = Router.fit(prefixes, levels=[2, 2], config=RoutingConfig(featurizer="tfidf"))
    router.save("runs/x/router"); Router.load("runs/x/router").route(prefixes)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save

from .balance import capacity_assign, fit_penalties
from .routing_config import RoutingConfig
from .corpus import SPLIT_NAMES, TRAIN
from .embed import TfidfSvdFeaturizer
from .kmeans import assign_nearest, feature_slices, kmeans, product_assign, product_kmeans

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROUTER_JSON, ROUTER_TENSORS = "router.json", "router.safetensors"
ASSIGN_JSON, ASSIGN_TENSORS = "assignments.json", "assignments.safetensors"


def _check_levels(levels: list[int]) -> list[int]:
    levels = [int(k) for k in levels]
    if not levels or any(k < 1 for k in levels):
        raise ValueError(f"levels must be a non-empty list of positive module counts, got {levels}")
    return levels


def _atomic_write(path: Path, write) -> None:
    """Call write(tmp_path), then rename tmp_path to path (same directory, so the rename is atomic)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1) + "\n"))


def _write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    contiguous = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    data = save(contiguous)  # bytes; written by us so the file mode follows the umask like the JSON
    _atomic_write(path, lambda tmp: tmp.write_bytes(data))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {meta.get('format_version')!r}; this code reads {FORMAT_VERSION}"
        )
    return meta


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from e


def _fingerprint(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    h = hashlib.sha256()
    _hash_tensors(tensors, h)
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


def _hash_tensors(tensors: dict[str, np.ndarray], h: Any) -> None:
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())


def make_featurizer(prefixes: list[str], config: RoutingConfig) -> tuple[Any, dict[str, Any]]:
    """The configured featurizer, fitted on `prefixes` when it has anything to fit."""
    if config.featurizer == "tfidf":
        return TfidfSvdFeaturizer.fit(prefixes, dim=config.svd_dim, max_features=config.max_features,
                                      seed=config.seed)
    from .embed_hf import HFFeaturizer

    if not config.hf_model:
        raise ValueError(f"routing.featurizer {config.featurizer!r} needs routing.hf_model (a model directory)")
    featurizer = HFFeaturizer(model_dir=config.hf_model, max_tokens=config.prefix_tokens,
                              batch_size=config.hf_batch_size, name=config.featurizer)
    return featurizer, {"name": config.featurizer, "model_dir": config.hf_model, "dim": featurizer.dim}


def featurizer_from_state(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Any:
    if meta["name"] == "tfidf":
        return TfidfSvdFeaturizer.from_state(tensors, meta)
    from .embed_hf import HFFeaturizer

    return HFFeaturizer.from_state(tensors, meta)


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
        self.levels = _check_levels(levels)
        self.method = method
        self.featurizer = featurizer
        self.centroids = [np.ascontiguousarray(c, dtype=np.float32) for c in centroids]
        self.config = config
        self.seed = config.seed
        self.slices = feature_slices(featurizer.dim, len(self.centroids))
        ks = [c.shape[0] for c in self.centroids]
        expected = [self.n_paths] if method == "flat" or len(self.levels) == 1 else self.levels
        if method != config.method:
            raise ValueError(f"method {method!r} differs from config.method {config.method!r}")
        if ks != expected:
            raise ValueError(
                f"method {method!r} with levels {self.levels} needs centroid counts {expected}, got {ks}"
            )
        for c, (lo, hi) in zip(self.centroids, self.slices, strict=True):
            if c.shape[1] != hi - lo:
                raise ValueError(f"centroids of shape {c.shape} do not match feature slice [{lo}, {hi})")
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

    @classmethod
    def fit(
        cls, prefixes: list[str], *, levels: list[int], config: RoutingConfig
    ) -> tuple[Router, dict[str, Any]]:
        """Fit featurizer and k-means on `prefixes`; stats hold both stages and the path sizes."""
        levels = _check_levels(levels)
        n_paths = math.prod(levels)
        if len(prefixes) < n_paths:
            raise ValueError(
                f"levels {levels} give {n_paths} paths, but only {len(prefixes)} prefixes to fit on"
            )
        t0 = time.perf_counter()
        featurizer, feat_stats = make_featurizer(prefixes, config)
        x = featurizer.transform(prefixes)  # (N, dim)
        kw = {
            "seed": config.seed,
            "niter": config.kmeans_iters,
            "max_points_per_centroid": config.max_points_per_centroid,
        }
        if config.method == "flat":
            centroids, km_stats = kmeans(x, n_paths, **kw)
            centroids = [centroids]
        else:
            if featurizer.dim < len(levels):
                raise ValueError(
                    f"product k-means over {len(levels)} levels needs >= {len(levels)} feature dims, "
                    f"but the featurizer has {featurizer.dim}"
                )
            centroids, km_stats = product_kmeans(x, levels, **kw)
        router = cls(
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
            "featurizer": feat_stats,
            "kmeans": km_stats,
            "balance": balance_stats,
            "sizes": sizes.tolist(),
            "empty_paths": int((sizes == 0).sum()),
            "seconds": time.perf_counter() - t0,
        }
        if stats["empty_paths"]:
            logger.warning("router: %d of %d paths got no fitting prefix", stats["empty_paths"], n_paths)
        return router, stats

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
        per_level = []
        for c, (lo, hi) in zip(self.centroids, self.slices, strict=True):
            xs = x[:, lo:hi]
            per_level.append(np.maximum((xs**2).sum(1, keepdims=True) - 2 * xs @ c.T + (c**2).sum(1), 0))
        ks = [c.shape[0] for c in self.centroids]
        cost = np.zeros((len(x),) + tuple(ks), dtype=np.float32)
        for level, d in enumerate(per_level):
            shape = [len(x)] + [1] * len(ks)
            shape[level + 1] = ks[level]
            cost = cost + d.reshape(shape)
        cost = cost.reshape(len(x), -1)  # C order = ravel_multi_index order of the flat path ids
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

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
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
            "config": asdict(self.config),
            "seed": self.seed,
            "featurizer": feat_meta,
        }
        return tensors, meta

    def fingerprint(self) -> str:
        """sha256 hex of the saved tensors and metadata (stable across save / load)."""
        return _fingerprint(*self._state())

    def save(self, directory: str | Path) -> Path:
        """Write router.safetensors then router.json into `directory` (created); returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors, meta = self._state()
        _write_tensors(directory / ROUTER_TENSORS, tensors)
        _write_json(directory / ROUTER_JSON, {**meta, "fingerprint": _fingerprint(tensors, meta)})
        logger.info("router (%s, levels %s) saved to %s", self.method, self.levels, directory)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Router:
        """Read a router saved by `save`; checks version, tensor names and fingerprint."""
        directory = Path(directory)
        meta = _read_json(directory / ROUTER_JSON)
        tensors = _read_tensors(directory / ROUTER_TENSORS)
        stored = meta.pop("fingerprint", None)
        if _fingerprint(tensors, meta) != stored:
            raise ValueError(
                f"{directory / ROUTER_TENSORS} and {directory / ROUTER_JSON} do not match the fingerprint "
                f"stored in the latter (files from different saves, edited, or corrupted)"
            )
        feat_tensors = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("featurizer.")}
        n_levels = 1 if meta["method"] == "flat" else len(meta["levels"])
        names = [f"centroids.{i}" for i in range(n_levels)]
        if meta["featurizer"]["name"] == "tfidf":
            names += ["featurizer.idf", "featurizer.components"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{directory / ROUTER_TENSORS} lacks tensors {missing}")
        linear = (tensors["linear.weight"], tensors["linear.bias"]) if "linear.weight" in tensors else None
        router = cls(
            levels=meta["levels"],
            method=meta["method"],
            featurizer=featurizer_from_state(feat_tensors, meta["featurizer"]),
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


@dataclass
class Assignments:
    """Flat path id and split code per document (index = doc_id)."""

    path: np.ndarray  # (N,) int64 flat path id in [0, prod(levels))
    split: np.ndarray  # (N,) int8 split code (routing.corpus.TRAIN / TEST)
    levels: list[int]  # modules per level, as in the router
    router_fingerprint: str  # Router.fingerprint() of the router that made `path`
    topk: np.ndarray | None = None  # (N, k) int64: a training doc's k paths (first = `path`); -1 rows elsewhere

    def __post_init__(self) -> None:
        self.levels = _check_levels(self.levels)
        self.path = np.asarray(self.path, dtype=np.int64)
        self.split = np.asarray(self.split, dtype=np.int8)
        if self.path.ndim != 1 or self.path.shape != self.split.shape:
            raise ValueError(
                f"path {self.path.shape} and split {self.split.shape} must be equal-length 1-D arrays"
            )
        if len(self.path) and (self.path.min() < 0 or self.path.max() >= self.n_paths):
            raise ValueError(
                f"path ids span [{self.path.min()}, {self.path.max()}], outside [0, {self.n_paths}) for levels {self.levels}"
            )
        unknown = sorted(set(np.unique(self.split).tolist()) - set(SPLIT_NAMES))
        if unknown:
            raise ValueError(f"unknown split codes {unknown}; known: {SPLIT_NAMES}")
        if self.topk is not None:
            self.topk = np.asarray(self.topk, dtype=np.int64)
            train = self.split == TRAIN
            if self.topk.ndim != 2 or len(self.topk) != len(self.path):
                raise ValueError(f"topk must have shape (N={len(self.path)}, k), got {self.topk.shape}")
            if (self.topk[train, 0] != self.path[train]).any() or (self.topk[~train] != -1).any():
                raise ValueError("topk rows must start with the doc's path (train docs) and be -1 elsewhere")
            top = self.topk[train]
            if top.size and (top.min() < 0 or top.max() >= self.n_paths or
                             (top.shape[1] > 1 and (np.sort(top, axis=1)[:, 1:] == np.sort(top, axis=1)[:, :-1]).any())):
                raise ValueError(f"topk of training docs must be distinct path ids in [0, {self.n_paths})")

    @property
    def n_paths(self) -> int:
        return math.prod(self.levels)

    def __len__(self) -> int:
        return len(self.path)

    def sizes(self, split: int = TRAIN) -> np.ndarray:
        """Documents per path (n_paths,) int64 in the given split."""
        if split not in SPLIT_NAMES:
            raise ValueError(f"unknown split code {split}; known: {SPLIT_NAMES}")
        return np.bincount(self.path[self.split == split], minlength=self.n_paths).astype(np.int64)

    def _tensors(self) -> dict[str, np.ndarray]:
        tensors = {"path": self.path, "split": self.split}
        if self.topk is not None:
            tensors["topk"] = self.topk
        return tensors

    def train_paths(self) -> np.ndarray:
        """(N, k) paths each document is trained on: top-k for training docs, -1 elsewhere (k = 1
        without overlap)."""
        if self.topk is not None:
            return self.topk
        return np.where(self.split == TRAIN, self.path, -1)[:, None]

    def save(self, directory: str | Path) -> Path:
        """Write assignments.safetensors then assignments.json into `directory` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = self._tensors()
        _write_tensors(directory / ASSIGN_TENSORS, tensors)
        h = hashlib.sha256()
        _hash_tensors(tensors, h)
        meta = {
            "format_version": FORMAT_VERSION,
            "n_documents": len(self),
            "levels": self.levels,
            "n_paths": self.n_paths,
            "router_fingerprint": self.router_fingerprint,
            "counts": {name: self.sizes(code).tolist() for code, name in SPLIT_NAMES.items()},
            "tensors_sha256": h.hexdigest(),
        }
        _write_json(directory / ASSIGN_JSON, meta)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Assignments:
        """Read assignments saved by `save`; checks version, lengths and checksum."""
        directory = Path(directory)
        meta = _read_json(directory / ASSIGN_JSON)
        tensor_file = directory / ASSIGN_TENSORS
        tensors = _read_tensors(tensor_file)
        if set(tensors) - {"topk"} != {"path", "split"}:
            raise ValueError(f"{tensor_file} holds tensors {sorted(tensors)}, expected ['path', 'split'] (+ 'topk')")
        n = meta["n_documents"]
        if len(tensors["path"]) != n or len(tensors["split"]) != n:
            raise ValueError(
                f"{tensor_file} has {len(tensors['path'])} paths and {len(tensors['split'])} splits, "
                f"but {directory / ASSIGN_JSON} says {n} documents"
            )
        h = hashlib.sha256()
        _hash_tensors(tensors, h)
        if h.hexdigest() != meta["tensors_sha256"]:
            raise ValueError(f"{tensor_file} does not match the checksum in {directory / ASSIGN_JSON}")
        return cls(
            path=tensors["path"],
            split=tensors["split"],
            levels=meta["levels"],
            router_fingerprint=meta["router_fingerprint"],
            topk=tensors.get("topk"),
        )


def _routing_config(saved: dict[str, Any], file: Path) -> RoutingConfig:
    """The routing config a router was fitted with; one saved by an older version of its fields is refused."""
    known = {f.name for f in fields(RoutingConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ValueError(f"{file} was fitted with routing keys this version does not have ({', '.join(unknown)}); "
                         f"fit the router again (`dipaco route`)")
    return RoutingConfig(**saved)

