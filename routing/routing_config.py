"""Typed configs of the routing stage: which corpus to read, how to fit the router, how to re-fit it.

`CorpusConfig` says where the documents come from and how the held-out splits are drawn;
`RoutingConfig` says how a document prefix becomes a feature vector and how the features are
clustered into paths; `RerouteConfig` says how `dipaco reroute` fits the discriminative router.
Each field's type says what it allows (`routing.fields`); the `dipaco` config loader fills them from
YAML. Nothing to run here:

    python -c "from routing.routing_config import RoutingConfig; print(RoutingConfig(featurizer='tfidf'))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from routing.fields import Count, PositiveInt, Range, Section, Seed

FEATURIZERS = ("tfidf", "hf", "base-model")
METHODS = ("product", "flat")


@dataclass(kw_only=True)
class CorpusConfig(Section):
    """Where the documents come from and which are held out."""

    section = "corpus"
    path: str = "demo"  # "demo" = the bundled corpus (resolved by dipaco), a local .txt/.json/.jsonl(.zst/.gz)/.parquet file, dir or glob, or a HF dataset name
    text_field: str = "text"  # column holding the document text
    split: str = "train"  # dataset split to read (hub datasets only; local files are one split)
    max_documents: Count = 0  # 0 = all; else keep the first N (non-empty) documents
    test_fraction: Annotated[float, Range(above=0, below=0.5)] = 0.05  # whole documents held out for routed evaluation
    router_fraction: Annotated[float, Range(min=0, below=0.5)] = 0.0  # whole documents held out as the router split (never trained on; `dipaco reroute` scores them)
    seed: Seed = 0  # seed of the test and router splits

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("path", "text_field"):
            if not getattr(self, name):
                raise ValueError(f"corpus.{name} must be non-empty, got {getattr(self, name)!r}")
        if self.test_fraction + self.router_fraction >= 0.9:
            raise ValueError(f"corpus.test_fraction {self.test_fraction} and corpus.router_fraction "
                             f"{self.router_fraction} leave too few training documents (their sum must be < 0.9)")


@dataclass(kw_only=True)
class RoutingConfig(Section):
    """How each document's prefix becomes a feature vector, and how the features are clustered into paths."""

    section = "routing"
    featurizer: Literal["tfidf", "hf", "base-model"] = "base-model"  # base-model: mean last hidden state of the prefix under the dense warm start (needs warm_start.fraction > 0) | tfidf: TF-IDF -> SVD -> L2 (c-BTM) | hf: the same as base-model with routing.hf_model
    hf_model: str = ""  # local model directory for featurizer "hf" ("" with "base-model" = <run>/pretrain/hf)
    hf_batch_size: PositiveInt = 32  # texts per forward pass of the hf / base-model featurizer
    prefix_tokens: PositiveInt = 32  # route on each document's first N tokens and score the rest (the paper's 32)
    method: Literal["flat", "product"] = "flat"  # flat: one k-means with prod(levels) clusters | product: one k-means per level on a slice of the features
    svd_dim: PositiveInt = 16  # tfidf: feature dimension after TruncatedSVD
    max_features: PositiveInt = 50000  # tfidf: vocabulary size cap
    kmeans_iters: PositiveInt = 25  # k-means iterations
    max_points_per_centroid: PositiveInt = 256  # faiss samples at most this many training points per centroid
    fit_sample: Count = 0  # fit featurizer, k-means and balance penalties on this many sampled training prefixes (0 = all)
    balance: Annotated[float, Range(min=1, off=0)] = 0.0  # 0 = nearest centroid; else per-path penalties keep largest / smallest path <= this ratio (e.g. 1.1)
    train_top_k: PositiveInt = 1  # each training document goes to its k best paths (the paper's 16x16 run: 2); test documents to 1
    seed: Seed = 0  # seed of the SVD and of k-means
    router: Literal["kmeans", "learned"] = "kmeans"  # the router evaluation and the exported mixture use: kmeans (fitted by `dipaco route`) | learned (`dipaco run` then fits it on the paths' losses over the router split: reroute.*; needs corpus.router_fraction > 0)


@dataclass(kw_only=True)
class RerouteConfig(Section):
    """`dipaco reroute`: the discriminative router fitted on the paths' losses over the router split."""

    section = "reroute"
    candidates: Count = 0  # score each router document with its top-C paths by the current router's cost; 0 = all
    c: Annotated[float, Range(above=0)] = 1.0  # inverse L2 strength of the logistic regression (scikit-learn's C)
    head: Literal["logistic", "regression"] = "logistic"  # the router's linear head: logistic (a multinomial logistic regression on each document's best path) | regression (a ridge regression on every path's loss, routing to the lowest predicted; needs candidates 0; no bias matching: target is ignored)
    phases: PositiveInt = 1  # with routing.router learned: `dipaco run`'s discriminative phases, the first phases - 1 at even rounds during training (re-sharded, training goes on), the last after it
    target: Literal["current", "uniform", "labels"] = "current"  # path-size distribution the router's bias matches: the current training sizes, uniform, or labels (no matching: the scored documents' own best paths)
