"""Typed configs of the routing stage: which corpus to read and how to fit the router.

`CorpusConfig` says where the documents come from and how the held-out test split is drawn;
`RoutingConfig` says how a document prefix becomes a feature vector and how the features are
clustered into paths. Both are plain `kw_only` dataclasses checked in `__post_init__`; the lead's
`dipaco` config loader fills them from YAML. Nothing to run here:

    python -c "from routing import RoutingConfig; print(RoutingConfig(method='flat'))"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

FEATURIZERS = ("tfidf", "hf", "base-model")
METHODS = ("product", "flat")


@dataclass(kw_only=True)
class CorpusConfig:
    path: str = "demo"  # "demo" = the bundled corpus (resolved by dipaco), a local .txt/.json/.jsonl(.zst/.gz)/.parquet file, dir or glob, or a HF dataset name
    text_field: str = "text"  # column holding the document text
    split: str = "train"  # dataset split to read (hub datasets only; local files are one split)
    max_documents: int = 0  # 0 = all; else keep the first N (non-empty) documents
    test_fraction: float = 0.05  # whole documents held out for routed evaluation (0 < f < 0.5)
    seed: int = 0  # seed of the train/test split
    router_fraction: float = 0.0  # whole documents held out as the router split (never trained on; `dipaco reroute` scores them)

    def __post_init__(self) -> None:
        _check_finite(self, "corpus")
        if self.seed < 0:
            raise ValueError(f"corpus.seed must be >= 0, got {self.seed}")
        if not self.path:
            raise ValueError(f"corpus.path must be non-empty, got {self.path!r}")
        if not self.text_field:
            raise ValueError(f"corpus.text_field must be non-empty, got {self.text_field!r}")
        if self.max_documents < 0:
            raise ValueError(f"corpus.max_documents must be >= 0 (0 = all), got {self.max_documents}")
        if not 0.0 < self.test_fraction < 0.5:
            raise ValueError(f"corpus.test_fraction must be in (0, 0.5), got {self.test_fraction}")
        if not 0.0 <= self.router_fraction < 0.5 or self.test_fraction + self.router_fraction >= 0.9:
            raise ValueError(f"corpus.router_fraction must be in [0, 0.5) and leave training documents, "
                             f"got {self.router_fraction} (test_fraction {self.test_fraction})")


@dataclass(kw_only=True)
class RoutingConfig:
    featurizer: str = "tfidf"  # "tfidf": TF-IDF -> SVD -> L2 (c-BTM); "hf": mean last hidden state of routing.hf_model; "base-model": same with the `dipaco pretrain` dense model
    hf_model: str = ""  # local model directory for featurizer "hf" ("" with "base-model" = <run>/pretrain/hf)
    hf_batch_size: int = 32  # texts per forward pass of the hf / base-model featurizer
    prefix_tokens: int = 32  # route on each document's first N tokens (the paper uses 32)
    method: str = "product"  # "product": one k-means per level on a slice of the features; "flat": one k-means with prod(levels) clusters
    svd_dim: int = 64  # feature dimension after TruncatedSVD
    max_features: int = 50000  # TF-IDF vocabulary size cap
    kmeans_iters: int = 25  # k-means iterations
    max_points_per_centroid: int = 256  # faiss samples at most this many training points per centroid
    seed: int = 0  # seed of the SVD and of k-means
    fit_sample: int = 0  # fit featurizer, k-means and balance penalties on this many sampled training prefixes (0 = all)
    balance: float = 0.0  # 0 = nearest centroid; else per-path penalties keep largest / smallest path <= this ratio (e.g. 1.1)
    train_top_k: int = 1  # each training document goes to its k best paths (the paper's 16x16 run: 2); eval docs to 1
    reroute_candidates: int = 0  # `dipaco reroute` scores each router doc with its top-C paths by router cost; 0 = all
    reroute_c: float = 1.0  # inverse L2 strength of the discriminative router's logistic regression
    reroute_target: str = "current"  # path-size distribution the router's bias matches: "current" (train sizes), "uniform", or "labels" (no matching: the scored documents' own best paths)

    def __post_init__(self) -> None:
        _check_finite(self, "routing")
        if self.seed < 0:
            raise ValueError(f"routing.seed must be >= 0, got {self.seed}")
        if self.featurizer not in FEATURIZERS:
            raise ValueError(f"routing.featurizer must be one of {FEATURIZERS}, got {self.featurizer!r}")
        if self.method not in METHODS:
            raise ValueError(f"routing.method must be one of {METHODS}, got {self.method!r}")
        if self.balance != 0 and self.balance < 1:
            raise ValueError(f"routing.balance must be 0 (off) or a ratio >= 1, got {self.balance}")
        if self.reroute_target not in ("current", "uniform", "labels"):
            raise ValueError(f"routing.reroute_target must be 'current', 'uniform' or 'labels', "
                             f"got {self.reroute_target!r}")
        if self.fit_sample < 0:
            raise ValueError(f"routing.fit_sample must be >= 0 (0 = all), got {self.fit_sample}")
        if self.reroute_candidates < 0 or self.reroute_c <= 0:
            raise ValueError(f"routing.reroute_candidates must be >= 0 and reroute_c > 0, "
                             f"got {self.reroute_candidates}, {self.reroute_c}")
        for name in ("prefix_tokens", "svd_dim", "max_features", "kmeans_iters", "max_points_per_centroid",
                     "hf_batch_size", "train_top_k"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"routing.{name} must be >= 1, got {value}")


def _check_finite(section: object, name: str) -> None:
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value}")
