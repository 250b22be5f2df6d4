"""routing — route documents to DiPaCo paths by their prefix (imports neither dipaco nor sharding).

corpus.py  load a corpus through HF datasets; draw the train / test split
embed.py   TF-IDF -> TruncatedSVD -> L2 featurizer, saved as arrays + JSON (no pickle)
embed_hf.py  mean-pooled last hidden states of a local HF model (featurizers "hf" and "base-model")
kmeans.py  faiss k-means, nearest-centroid assignment, product k-means
balance.py per-path penalties and exact capacity assignment (routing.balance)
discriminative.py  logistic-regression router with a size-matching bias (dipaco reroute)
router_cost.py  a router's ms per routed prefix and its load balance (documents per path, entropy)
routing_report.py  routing report: sizes, balance, churn, purity / NMI, PNG histogram
router.py  the Router artifact (featurizers.py: which featurizer; artifacts.py: its files)
assignments.py  every document's path, split and top-k paths
routing_config.py  CorpusConfig, RoutingConfig, RerouteConfig

Standalone CLI (CPU, seconds on a small corpus):

    python -m routing --corpus docs.jsonl.zst --levels 2 2 --out runs/route
"""

import importlib

# Submodules are imported on first use, so `import routing.routing_config` (as every island does) does not
# pay for faiss, scikit-learn and datasets. The k-means function is `routing.kmeans.kmeans`: the
# name `routing.kmeans` is its module.
_EXPORTS = {
    "CorpusConfig": "routing_config",
    "RoutingConfig": "routing_config",
    "load_corpus": "corpus",
    "assign_splits": "corpus",
    "TRAIN": "corpus",
    "TEST": "corpus",
    "ROUTER": "corpus",
    "fit_penalties": "balance",
    "capacity_assign": "balance",
    "fit_discriminative": "discriminative",
    "routing_report": "routing_report",
    "Router": "router",
    "Assignments": "assignments",
    "product_kmeans": "kmeans",
    "product_assign": "kmeans",
    "assign_nearest": "kmeans",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'routing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"routing.{_EXPORTS[name]}"), name)
