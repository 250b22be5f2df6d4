"""The featurizers a router turns document prefixes with: TF-IDF -> SVD -> L2 (`embed`), or the mean-pooled
hidden states of a local Hugging Face model (`embed_hf`: featurizers "hf" and "base-model").

    featurizer, stats = make_featurizer(prefixes, RoutingConfig(featurizer="tfidf"))
    featurizer = featurizer_from_state(tensors, meta)     # as saved with a router
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from routing.embed import TfidfSvdFeaturizer
from routing.routing_config import RoutingConfig


def make_featurizer(prefixes: list[str], config: RoutingConfig) -> tuple[Any, dict[str, Any]]:
    """The configured featurizer, fitted on `prefixes` when it has anything to fit."""
    if config.featurizer == "tfidf":
        return TfidfSvdFeaturizer.fit(prefixes, dim=config.svd_dim, max_features=config.max_features,
                                      seed=config.seed)
    from routing.embed_hf import HFFeaturizer

    if not config.hf_model:
        raise ValueError(f"routing.featurizer {config.featurizer!r} needs routing.hf_model (a model directory)")
    featurizer = HFFeaturizer(model_dir=config.hf_model, max_tokens=config.prefix_tokens,
                              batch_size=config.hf_batch_size, name=config.featurizer)
    return featurizer, {"name": config.featurizer, "model_dir": config.hf_model, "dim": featurizer.dim}


def featurizer_from_state(tensors: dict[str, np.ndarray], meta: dict[str, Any], *,
                          model_dir: str | Path | None = None) -> Any:
    """The featurizer saved as `tensors` and `meta`; `model_dir`: where a model featurizer's model is now,
    when it moved since the fit (a TF-IDF featurizer has no model)."""
    if meta["name"] == "tfidf":
        if model_dir is not None:
            raise ValueError(f"a TF-IDF featurizer has no model, but a model directory {model_dir} was given")
        return TfidfSvdFeaturizer.from_state(tensors, meta)
    from routing.embed_hf import HFFeaturizer

    return HFFeaturizer.from_state(tensors, meta, model_dir=model_dir)
