"""Featurize document prefixes: TF-IDF -> TruncatedSVD -> L2-normalised rows (the c-BTM recipe).

`TfidfSvdFeaturizer.fit` fits scikit-learn's `TfidfVectorizer(stop_words="english",
sublinear_tf=True)` and `TruncatedSVD` on a list of texts; `transform` maps texts to float32
features (N, dim) with unit-norm rows (rows of texts with no known term stay zero).

Nothing is pickled: `state_dict()` returns plain arrays (idf (V,), SVD components (dim, V)) and a
JSON-able dict (the vocabulary as a list of terms in column order, the vectorizer settings), and
`from_state` rebuilds a featurizer whose `transform` gives the same output as the fitted one: a
`TfidfVectorizer` with a fixed `vocabulary=` and the stored `idf_`, then the SVD projection as a
matrix product. CPU check:

    python -c "from routing.embed import TfidfSvdFeaturizer as F; \
f, s = F.fit(['red apples', 'green pears', 'red pears'], dim=2, max_features=100, seed=0); print(s)"
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

logger = logging.getLogger(__name__)

# Vectorizer settings that change the output; stored in the meta and reused by `from_state`.
_VECTORIZER_KW: dict[str, Any] = {"stop_words": "english", "sublinear_tf": True, "lowercase": True}


class TfidfSvdFeaturizer:
    """TF-IDF (fixed vocabulary, idf) -> projection on SVD components -> L2 normalise."""

    name = "tfidf"

    def __init__(self, vectorizer: TfidfVectorizer, components: np.ndarray, *, max_features: int, seed: int):
        self.vectorizer = vectorizer
        self.components = np.ascontiguousarray(components, dtype=np.float64)  # (dim, V)
        self.max_features = max_features
        self.seed = seed

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])

    @classmethod
    def fit(
        cls, texts: list[str], *, dim: int, max_features: int, seed: int
    ) -> tuple[TfidfSvdFeaturizer, dict[str, Any]]:
        """Fit on `texts`; `dim` is clamped below min(#terms, #texts) with a warning."""
        if dim < 1 or max_features < 1:
            raise ValueError(f"dim and max_features must be >= 1, got dim={dim}, max_features={max_features}")
        if len(texts) < 2:
            raise ValueError(f"need at least 2 texts to fit the featurizer, got {len(texts)}")
        t0 = time.perf_counter()
        vectorizer = TfidfVectorizer(max_features=max_features, dtype=np.float64, **_VECTORIZER_KW)
        x = vectorizer.fit_transform(texts)  # (N, V) sparse
        n_terms = x.shape[1]
        limit = min(n_terms, len(texts)) - 1
        if dim > limit:
            if limit < 1:
                raise ValueError(
                    f"TF-IDF found {n_terms} term(s) in {len(texts)} texts; too few to fit an SVD"
                )
            logger.warning(
                "svd_dim %d clamped to %d (TF-IDF has %d terms, %d texts)", dim, limit, n_terms, len(texts)
            )
            dim = limit
        svd = TruncatedSVD(n_components=dim, random_state=seed)
        svd.fit(x)
        featurizer = cls(vectorizer, svd.components_, max_features=max_features, seed=seed)
        feats = featurizer._project(x)
        zero_rows = int((np.linalg.norm(feats, axis=1) == 0).sum())
        if zero_rows:
            logger.warning(
                "%d of %d texts have no known term; their features are zero", zero_rows, len(texts)
            )
        stats = {
            "n_texts": len(texts),
            "n_terms": int(n_terms),
            "dim": dim,
            "explained_variance_ratio": float(svd.explained_variance_ratio_.sum()),
            "zero_rows": zero_rows,
            "seconds": time.perf_counter() - t0,
        }
        logger.info("featurizer: %s", stats)
        return featurizer, stats

    def _project(self, x) -> np.ndarray:
        """Sparse TF-IDF (N, V) -> float32 (N, dim), rows L2-normalised (zero rows stay zero)."""
        z = np.asarray(x @ self.components.T, dtype=np.float64)  # (N, dim)
        norms = np.linalg.norm(z, axis=1, keepdims=True)
        z = z / np.where(norms > 0, norms, 1.0)
        return z.astype(np.float32)

    def transform(self, texts: list[str]) -> np.ndarray:
        """Texts -> features (N, dim) float32 with unit-norm rows."""
        return self._project(self.vectorizer.transform(texts))

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(tensors {"idf": (V,) float64, "components": (dim, V) float64}, JSON-able meta)."""
        vocabulary = self.vectorizer.vocabulary_
        terms = [""] * len(vocabulary)
        for term, index in vocabulary.items():
            terms[index] = term
        tensors = {
            "idf": np.ascontiguousarray(self.vectorizer.idf_, dtype=np.float64),
            "components": self.components,
        }
        meta = {
            "name": self.name,
            "dim": self.dim,
            "max_features": self.max_features,
            "seed": self.seed,
            "vectorizer": dict(_VECTORIZER_KW),
            "vocabulary": terms,
        }
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> TfidfSvdFeaturizer:
        """Rebuild from `state_dict()` output; raises ValueError on inconsistent shapes."""
        terms = meta["vocabulary"]
        idf, components = tensors["idf"], tensors["components"]
        if idf.shape != (len(terms),) or components.shape != (meta["dim"], len(terms)):
            raise ValueError(
                f"featurizer state is inconsistent: {len(terms)} terms, idf {idf.shape}, "
                f"components {components.shape}, dim {meta['dim']}"
            )
        if len(set(terms)) != len(terms):
            raise ValueError(f"featurizer vocabulary has duplicate terms ({len(terms)} listed)")
        vectorizer = TfidfVectorizer(
            vocabulary={t: i for i, t in enumerate(terms)}, dtype=np.float64, **meta["vectorizer"]
        )
        vectorizer.idf_ = np.asarray(idf, dtype=np.float64)
        return cls(vectorizer, components, max_features=meta["max_features"], seed=meta["seed"])
