"""Scoring held-out documents: padding and batching never change a document's score."""

import numpy as np
import torch

from dipaco.config import ModelConfig
from dipaco.eval.scoring import perplexity, score_documents
from dipaco.model.path_model import build_path_model

CPU = torch.device("cpu")


def reference_nll(model, doc: np.ndarray, skip: int) -> float:
    """Cross-entropy of tokens skip.. of one unpadded document, computed directly."""
    ids = torch.as_tensor(doc, dtype=torch.long).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    return float(nll[skip - 1 :].sum())


def test_batched_padded_scores_equal_one_by_one_reference():
    model = build_path_model(ModelConfig(hidden_size=16, n_layers=2, n_heads=2), vocab_size=50, seq_len=32, seed=0)
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=n) for n in (12, 30, 7, 19, 25)]
    skip = 4
    nll, counts = score_documents(model, docs, skip=skip, batch_size=3, device=CPU, precision="fp32")
    assert list(counts) == [len(d) - skip for d in docs]
    for doc, got in zip(docs, nll):
        assert abs(got - reference_nll(model, doc, skip)) < 1e-3


def test_a_document_no_longer_than_the_prefix_scores_nothing():
    model = build_path_model(ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=20, seq_len=16, seed=0)
    nll, counts = score_documents(model, [np.arange(3)], skip=4, batch_size=2, device=CPU, precision="fp32")
    assert counts[0] == 0 and nll[0] == 0


def test_perplexity_of_uniform_guess_is_vocabulary_size():
    assert abs(perplexity(100 * np.log(50), 100) - 50) < 1e-9
