"""routing — route documents to DiPaCo paths by their prefix (imports neither dipaco nor sharding).

corpus.py  load a corpus through HF datasets; draw the train / test split
embed.py   TF-IDF -> TruncatedSVD -> L2 featurizer, saved as arrays + JSON (no pickle)
kmeans.py  faiss k-means, nearest-centroid assignment, product k-means
router.py  the Router artifact and the per-document Assignments
config.py  CorpusConfig, RoutingConfig

Standalone CLI (CPU, seconds on a small corpus):

    python -m routing --corpus docs.jsonl.zst --levels 2 2 --out runs/route
"""

from .config import CorpusConfig, RoutingConfig
from .corpus import TEST, TRAIN, assign_splits, load_corpus
from .kmeans import assign_nearest, kmeans, product_assign, product_kmeans
from .router import Assignments, Router

__all__ = [
    "CorpusConfig",
    "RoutingConfig",
    "load_corpus",
    "assign_splits",
    "TRAIN",
    "TEST",
    "Router",
    "Assignments",
    "kmeans",
    "product_kmeans",
    "product_assign",
    "assign_nearest",
]
