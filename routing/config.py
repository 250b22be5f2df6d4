"""Typed configs of the routing stage: which corpus to read and how to fit the router.

`CorpusConfig` says where the documents come from and how the held-out test split is drawn;
`RoutingConfig` says how a document prefix becomes a feature vector and how the features are
clustered into paths. Both are plain `kw_only` dataclasses checked in `__post_init__`; the lead's
`dipaco` config loader fills them from YAML. Nothing to run here:

    python -c "from routing import RoutingConfig; print(RoutingConfig(method='flat'))"
"""

from __future__ import annotations

from dataclasses import dataclass

FEATURIZERS = ("tfidf",)
METHODS = ("product", "flat")


@dataclass(kw_only=True)
class CorpusConfig:
    path: str = "demo"  # "demo" = the bundled corpus (resolved by dipaco), a local .txt/.json/.jsonl(.zst/.gz)/.parquet file, dir or glob, or a HF dataset name
    text_field: str = "text"  # column holding the document text
    split: str = "train"  # dataset split to read (hub datasets only; local files are one split)
    max_documents: int = 0  # 0 = all; else keep the first N (non-empty) documents
    test_fraction: float = 0.05  # whole documents held out for routed evaluation (0 < f < 0.5)
    seed: int = 0  # seed of the train/test split

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(f"corpus.path must be non-empty, got {self.path!r}")
        if not self.text_field:
            raise ValueError(f"corpus.text_field must be non-empty, got {self.text_field!r}")
        if self.max_documents < 0:
            raise ValueError(f"corpus.max_documents must be >= 0 (0 = all), got {self.max_documents}")
        if not 0.0 < self.test_fraction < 0.5:
            raise ValueError(f"corpus.test_fraction must be in (0, 0.5), got {self.test_fraction}")


@dataclass(kw_only=True)
class RoutingConfig:
    featurizer: str = "tfidf"  # only "tfidf": TF-IDF -> TruncatedSVD -> L2 normalise (the c-BTM recipe)
    prefix_tokens: int = 32  # route on each document's first N tokens (the paper uses 32)
    method: str = "product"  # "product": one k-means per level on a slice of the features; "flat": one k-means with prod(levels) clusters
    svd_dim: int = 64  # feature dimension after TruncatedSVD
    max_features: int = 50000  # TF-IDF vocabulary size cap
    kmeans_iters: int = 25  # k-means iterations
    max_points_per_centroid: int = 256  # faiss samples at most this many training points per centroid
    seed: int = 0  # seed of the SVD and of k-means

    def __post_init__(self) -> None:
        if self.featurizer not in FEATURIZERS:
            raise ValueError(f"routing.featurizer must be one of {FEATURIZERS}, got {self.featurizer!r}")
        if self.method not in METHODS:
            raise ValueError(f"routing.method must be one of {METHODS}, got {self.method!r}")
        for name in ("prefix_tokens", "svd_dim", "max_features", "kmeans_iters", "max_points_per_centroid"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"routing.{name} must be >= 1, got {value}")
