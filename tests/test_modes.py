"""Eval modes against direct references: re-routing, oracle, all-paths, on small real path models."""

import numpy as np
import pytest
import torch

from dipaco.config import ModelConfig
from dipaco.eval.modes import (
    LossTable,
    all_paths_table,
    chunk_spans,
    oracle_scores,
    parse_mode,
    route_chunks,
    routed_scores,
)
from dipaco.eval.scoring import token_losses
from dipaco.model.path_model import build_path_model

CPU = torch.device("cpu")
N_PATHS, VOCAB, PREFIX = 3, 40, 5


@pytest.fixture(scope="module")
def setup():
    models = [build_path_model(ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=VOCAB, seq_len=64,
                               seed=s) for s in range(N_PATHS)]
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, VOCAB, size=n) for n in (40, 17, 64, 9, 33, 5, 50)]
    table = LossTable(docs=docs, load=lambda p, r: models[p],
                      score=lambda m, batch: token_losses(m, batch, batch_size=3, device=CPU, precision="fp32"))
    return models, docs, table


def route(batch, n_tokens):
    """A deterministic stand-in for the router: the path depends on the tokens it is shown."""
    return np.array([int(d[:n].sum()) % N_PATHS for d, n in zip(batch, n_tokens)])


def reference_span_nll(model, doc, start, end) -> float:
    """Loss of tokens start..end-1 when the model reads only the text up to the span's end."""
    ids = torch.as_tensor(doc[:end], dtype=torch.long).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    return float(nll[start - 1 : end - 1].sum())


ROUNDS = {p: 0 for p in range(N_PATHS)}


def test_chunks_cover_the_scored_tokens_once():
    assert chunk_spans(20, prefix=5, window=6) == [(5, 11), (11, 17), (17, 20)]
    assert chunk_spans(20, prefix=5, window=100) == [(5, 20)]
    assert chunk_spans(5, prefix=5, window=4) == []
    assert parse_mode("every:64") == ("every", 64)
    for bad in ("every:0", "every:x", "nope"):
        with pytest.raises(ValueError, match="mode"):
            parse_mode(bad)


def test_every_window_at_least_the_sequence_equals_prefix(setup):
    _, docs, table = setup
    longest = max(len(d) for d in docs)
    prefix = routed_scores(table, route_chunks(route, docs, prefix=PREFIX, window=longest), ROUNDS, N_PATHS)
    for window in (longest, longest + 1, 10 * longest):
        every = routed_scores(table, route_chunks(route, docs, prefix=PREFIX, window=window), ROUNDS, N_PATHS)
        for key in prefix:
            np.testing.assert_array_equal(every[key], prefix[key])


def test_rerouting_scores_each_chunk_with_the_path_chosen_before_it(setup):
    models, docs, table = setup
    routes = route_chunks(route, docs, prefix=PREFIX, window=8)
    scores = routed_scores(table, routes, ROUNDS, N_PATHS)
    for d, doc in enumerate(docs):
        expected = 0.0
        for start, end, path in routes[d]:
            assert path == route([doc], [start])[0]
            expected += reference_span_nll(models[path], doc, start, end)
        assert scores["nll"][d] == pytest.approx(expected, rel=1e-4, abs=1e-4)
        assert scores["tokens"][d] == max(0, len(doc) - PREFIX)
    assert len({p for spans in routes for _, _, p in spans}) > 1, "the test should exercise re-routing"


def test_oracle_is_the_best_path_and_never_worse_than_prefix(setup):
    models, docs, table = setup
    oracle = oracle_scores(table, len(docs), ROUNDS, prefix=PREFIX)
    prefix = routed_scores(table, route_chunks(route, docs, prefix=PREFIX, window=10_000), ROUNDS, N_PATHS)
    assert np.all(oracle["nll"] <= prefix["nll"])
    np.testing.assert_array_equal(oracle["tokens"], prefix["tokens"])
    for d, doc in enumerate(docs):
        if len(doc) > PREFIX:
            per_path = [reference_span_nll(m, doc, PREFIX, len(doc)) for m in models]
            assert oracle["nll"][d] == pytest.approx(min(per_path), rel=1e-4, abs=1e-4)


def test_all_paths_diagonal_is_each_paths_routed_perplexity(setup):
    _, docs, table = setup
    routes = route_chunks(route, docs, prefix=PREFIX, window=10_000)
    routed = np.array([spans[0][2] if spans else -1 for spans in routes])
    grid = all_paths_table(table, routed, ROUNDS, prefix=PREFIX)
    prefix = routed_scores(table, routes, ROUNDS, N_PATHS)
    for p in range(N_PATHS):
        if prefix["path_tokens"][p]:
            assert grid[p, p] == pytest.approx(np.exp(prefix["path_nll"][p] / prefix["path_tokens"][p]))
        else:
            assert np.isnan(grid[:, p]).all()
