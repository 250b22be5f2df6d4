"""The split oracle on a tiny run (issue 39, item 2): eval.json's `oracle-split` row equals a numpy
computation on each path's own token losses of the held-out documents, never scores a token with a path
chosen on it, and is never below the in-sample oracle.

The run is conftest's session-wide `tiny_trained` (one `dipaco run`, every eval mode)."""

import json
import math

import numpy as np
import pytest
import torch

from dipaco.config import load_config
from dipaco.eval.modes import LossTable, split_oracle_scores
from dipaco.pipeline.context import PathFactory


@pytest.fixture(scope="module")
def losses(tiny_trained) -> dict:
    """Each path's token losses (`[p][d]`, from the model's own unbatched forward pass, not dipaco.eval) on
    the test documents, at the last module version, with what eval.json says."""
    config = load_config(tiny_trained.config)
    factory = PathFactory(config, tiny_trained)
    docs, _, _ = factory.reader.test_documents()
    last = factory.store.current_round()
    results = json.loads(tiny_trained.eval_results.read_text())
    rows = {(r["mode"], r["checkpoints"]): r for r in results["modes"]["rows"]}
    paths = [p["path"] for p in rows["oracle-split", "last"]["per_path"]]
    per_path = {}
    for p in paths:
        model = factory.load_path(path=p, round=last).eval()
        per_path[p] = [own_token_losses(model, doc) for doc in docs]
    return {"docs": docs, "paths": paths, "losses": per_path, "rows": rows, "prefix": config.routing.prefix_tokens}


def own_token_losses(model, doc: np.ndarray) -> np.ndarray:
    ids = torch.as_tensor(doc, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    return np.concatenate([[0.0], torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").numpy()])


def test_eval_json_split_oracle_is_the_numpy_cross_fit(losses):
    """Per document: the path with the lowest loss on the even offsets after the prefix scores the odd ones,
    and back; the sum over documents is eval.json's row, which is at or above the in-sample oracle's."""
    prefix, paths, docs = losses["prefix"], losses["paths"], losses["docs"]
    nll = oracle = 0.0
    halves_disagree = 0
    for d in range(len(docs)):
        scored = np.array([losses["losses"][p][d][prefix:] for p in paths])  # (P, tokens after the prefix)
        if not scored.shape[1]:
            continue
        even = np.arange(scored.shape[1]) % 2 == 0
        on_even, on_odd = np.argmin(scored[:, even].sum(1)), np.argmin(scored[:, ~even].sum(1))
        nll += scored[on_even, ~even].sum() + scored[on_odd, even].sum()
        oracle += scored.sum(1).min()
        halves_disagree += on_even != on_odd
    tokens = sum(max(0, len(doc) - prefix) for doc in docs)
    row, in_sample = losses["rows"]["oracle-split", "last"], losses["rows"]["oracle", "last"]
    assert row["tokens"] == in_sample["tokens"] == tokens
    assert row["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert in_sample["perplexity"] == pytest.approx(math.exp(oracle / tokens), rel=1e-5)
    assert halves_disagree, "some document's halves should pick different paths, or the split checks little"
    for checkpoints in ("last", "best"):
        assert (losses["rows"]["oracle-split", checkpoints]["perplexity"]
                >= losses["rows"]["oracle", checkpoints]["perplexity"])


def test_no_token_is_scored_by_a_path_chosen_on_it(losses):
    """Through `split_oracle_scores` on the run's own losses: every path's losses on one half replaced by
    noise leave the path scoring that half (chosen on the other) where it was, and it scores the noise."""
    prefix, paths, docs = losses["prefix"], losses["paths"], losses["docs"]
    rounds = {p: 0 for p in paths}
    before = split_oracle_scores(table(docs, losses["losses"]), len(docs), rounds, prefix=prefix)
    rng = np.random.default_rng(0)
    for half in (0, 1):
        noisy = {p: [x.copy() for x in losses["losses"][p]] for p in paths}
        for p in paths:
            for x in noisy[p]:
                x[prefix + half::2] = rng.exponential(5.0, size=len(x[prefix + half::2]))
        after = split_oracle_scores(table(docs, noisy), len(docs), rounds, prefix=prefix)
        kept = 1 - half
        np.testing.assert_array_equal(after["choice"][:, kept], before["choice"][:, kept])
        assert np.any(after["choice"][:, half] != before["choice"][:, half])
        expected = [noisy[after["choice"][d, kept]][d][prefix + half::2].sum()
                    + noisy[after["choice"][d, half]][d][prefix + kept::2].sum() for d in range(len(docs))]
        np.testing.assert_allclose(after["nll"], expected, rtol=1e-12)


def table(docs: list[np.ndarray], per_path: dict[int, list[np.ndarray]]) -> LossTable:
    """A `LossTable` whose path p gives document d the token losses `per_path[p][d]`."""
    index = {id(doc): d for d, doc in enumerate(docs)}
    return LossTable(docs=docs, load=lambda p, r: p, score=lambda p, batch: [per_path[p][index[id(x)]] for x in batch])
