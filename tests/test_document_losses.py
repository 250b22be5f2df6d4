"""eval-documents.json (`dipaco.eval.document_losses`): each held-out document's loss under every path, from
which any router is scored after evaluation. On a synthetic table the record holds numpy's sums; on the tiny
run (conftest's `tiny_trained`, every path on every document through the oracle modes) the record re-scores
eval.json's own `prefix` and `oracle` rows."""

import json
import math

import numpy as np
import pytest

from dipaco.eval.document_losses import document_losses, routed_perplexity
from dipaco.eval.modes import LossTable
from routing.router import Router


def synthetic(n_paths: int = 3, n_docs: int = 5, seed: int = 0) -> tuple[LossTable, dict[int, list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    docs = [np.arange(int(n)) for n in rng.integers(3, 12, n_docs)]
    per_path = {p: [rng.random(len(d)) for d in docs] for p in range(n_paths)}
    index = {id(doc): d for d, doc in enumerate(docs)}
    table = LossTable(docs=docs, load=lambda p, r: p, score=lambda p, batch: [per_path[p][index[id(x)]] for x in batch])
    return table, per_path


def test_record_holds_every_path_loss_once_the_table_is_complete():
    table, per_path = synthetic()
    prefix, rounds = 4, {p: 2 for p in per_path}
    routed = np.array([0, 2, 1, 1, 0])
    table.ensure({(p, 2): {int(d) for d in np.flatnonzero(routed == p)} for p in per_path})  # the prefix mode's
    partial = document_losses(table, routed=routed, features=None, rounds=rounds, prefix=prefix, router="kmeans")
    assert partial["scored_nll"] is None and partial["routed"] == routed.tolist()
    table.ensure({(p, 2): set(range(len(table.docs))) for p in per_path})
    features = np.random.default_rng(1).normal(size=(len(routed), 2)).astype(np.float32)
    record = json.loads(json.dumps(document_losses(table, routed=routed, features=features, rounds=rounds,
                                                   prefix=prefix, router="kmeans")))
    np.testing.assert_array_equal(np.asarray(record["features"], dtype=np.float32), features)
    for d, doc in enumerate(table.docs):
        assert record["scored_tokens"][d] == max(0, len(doc) - prefix)
        np.testing.assert_allclose(record["scored_nll"][d], [per_path[p][d][prefix:].sum() for p in range(3)])
        np.testing.assert_allclose(record["prefix_nll"][d], [per_path[p][d][:prefix].sum() for p in range(3)])
    total = sum(per_path[int(p)][d][prefix:].sum() for d, p in enumerate(routed))
    tokens = sum(max(0, len(doc) - prefix) for doc in table.docs)
    assert routed_perplexity(record, routed) == pytest.approx(math.exp(total / tokens), rel=1e-12)
    with pytest.raises(ValueError, match="paths"):
        routed_perplexity(record, np.array([0, 1, 2, 3, 0]))  # no path 3
    with pytest.raises(ValueError, match="no per-path losses"):
        routed_perplexity(partial, routed)


def test_tiny_run_record_rescores_eval_json(tiny_trained):
    results = json.loads(tiny_trained.eval_results.read_text())
    record = json.loads((tiny_trained.root / "eval-documents.json").read_text())
    rows = {(r["mode"], r["checkpoints"]): r for r in results["modes"]["rows"]}
    assert record["router"] == "kmeans" and len(record["routed"]) == results["test_documents"]
    assert sum(record["scored_tokens"]) == results["scored_tokens"]
    assert routed_perplexity(record, np.array(record["routed"])) == pytest.approx(rows["prefix", "last"]["perplexity"],
                                                                                   rel=1e-9)
    router = Router.load(tiny_trained.routing)  # the features route every document to its eval path
    costs = router.path_costs(np.asarray(record["features"], dtype=np.float32))
    np.testing.assert_array_equal(np.argmin(costs, axis=1), record["routed"])
    oracle = np.asarray(record["paths"])[np.argmin(record["scored_nll"], axis=1)]
    assert routed_perplexity(record, oracle) == pytest.approx(rows["oracle", "last"]["perplexity"], rel=1e-9)
