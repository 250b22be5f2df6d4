"""Eval modes against direct references: re-routing, oracle, split oracle, all-paths, on small real path models."""

import math

import numpy as np
import pytest
import torch

from dipaco.config import ModelConfig
from dipaco.eval.modes import (
    LossTable,
    all_paths_table,
    chunk_spans,
    evaluate_modes,
    format_modes,
    likelihood_choice,
    oracle_scores,
    parse_mode,
    prefix_routes,
    route_chunks,
    routed_scores,
    split_oracle_scores,
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


def reference_prefix(models, docs):
    """The `prefix` mode computed directly: each document routed once from its first PREFIX tokens,
    that path's model run on the document alone, the losses of tokens PREFIX.. summed."""
    paths = [int(route([doc], [PREFIX])[0]) for doc in docs]
    nll = [reference_span_nll(models[p], doc, PREFIX, len(doc)) if len(doc) > PREFIX else 0.0
           for p, doc in zip(paths, docs)]
    return np.array(paths), np.array(nll)


def test_every_window_at_least_the_sequence_equals_a_direct_prefix_computation(setup):
    models, docs, table = setup
    paths, nll = reference_prefix(models, docs)
    tokens = np.array([max(0, len(d) - PREFIX) for d in docs])
    longest = max(len(d) for d in docs)
    prefix = routed_scores(table, prefix_routes(docs, route(docs, [PREFIX] * len(docs)), prefix=PREFIX), ROUNDS,
                           N_PATHS)
    for scores in [prefix] + [routed_scores(table, route_chunks(route, docs, prefix=PREFIX, window=window), ROUNDS,
                                            N_PATHS) for window in (longest, longest + 1, 10 * longest)]:
        np.testing.assert_allclose(scores["nll"], nll, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(scores["tokens"], tokens)
        np.testing.assert_array_equal(scores["path_documents"], np.bincount(paths[tokens > 0], minlength=N_PATHS))
        for key in scores:  # all windows >= the longest document are one and the same routing
            np.testing.assert_array_equal(scores[key], prefix[key])


def test_rerouting_scores_each_chunk_with_the_path_chosen_before_it(setup):
    models, docs, table = setup
    routes = route_chunks(route, docs, prefix=PREFIX, window=8)
    scores = routed_scores(table, routes, ROUNDS, N_PATHS)
    for d, doc in enumerate(docs):
        expected = 0.0
        for start, end, path in routes[d]:
            assert path == route([doc[start - PREFIX:start]], [PREFIX])[0]  # the PREFIX tokens before the span
            expected += reference_span_nll(models[path], doc, start, end)
        assert scores["nll"][d] == pytest.approx(expected, rel=1e-4, abs=1e-4)
        assert scores["tokens"][d] == max(0, len(doc) - PREFIX)
    assert len({p for spans in routes for _, _, p in spans}) > 1, "the test should exercise re-routing"


def test_rerouting_with_a_router_that_reads_only_its_first_tokens_still_follows_the_text(setup):
    # the base-model featurizer truncates its input to routing.prefix_tokens: routed from "the first s
    # tokens", every chunk would get the prefix's path and every:W would be the prefix mode again
    _, docs, _ = setup

    def truncating(batch, n_tokens):
        return route([d[:PREFIX] for d in batch], [min(PREFIX, n) for n in n_tokens])

    routes = route_chunks(truncating, docs, prefix=PREFIX, window=8)
    first = truncating(docs, [PREFIX] * len(docs))
    assert all(spans[0][2] == first[d] for d, spans in enumerate(routes) if spans)
    assert any(p != first[d] for d, spans in enumerate(routes) for _, _, p in spans[1:])


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


def reference_token_losses(model, doc) -> np.ndarray:
    """Loss of each token given those before it, from the model's own forward pass on the document alone
    (`[0]`: none predicts the first token)."""
    ids = torch.as_tensor(doc, dtype=torch.long).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    return np.concatenate([[0.0], torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").numpy()])


def test_split_oracle_chooses_on_one_half_and_scores_the_other(setup):
    """`oracle-split` against numpy on each model's own token losses: the best path on the even offsets
    (from PREFIX) scores the odd ones and back; never better than the in-sample oracle, same tokens."""
    models, docs, table = setup
    split = split_oracle_scores(table, len(docs), ROUNDS, prefix=PREFIX)
    oracle = oracle_scores(table, len(docs), ROUNDS, prefix=PREFIX)
    np.testing.assert_array_equal(split["tokens"], oracle["tokens"])
    for d, doc in enumerate(docs):
        losses = np.array([reference_token_losses(m, doc)[PREFIX:] for m in models])  # (P, scored tokens)
        even = np.arange(losses.shape[1]) % 2 == 0
        on_even, on_odd = int(np.argmin(losses[:, even].sum(1))), int(np.argmin(losses[:, ~even].sum(1)))
        assert split["choice"][d].tolist() == [on_even, on_odd]
        assert split["nll"][d] == pytest.approx(losses[on_even, ~even].sum() + losses[on_odd, even].sum(), abs=1e-4)
        assert split["nll"][d] >= oracle["nll"][d] - 1e-9
    assert split["path_tokens"].sum() == split["tokens"].sum()
    assert split["path_nll"].sum() == pytest.approx(split["nll"].sum())
    assert np.any(split["choice"][:, 0] != split["choice"][:, 1]), "the halves should disagree somewhere"


def test_split_oracle_costs_no_forward_pass_beyond_the_oracle(setup):
    """Its losses are the oracle's table entries: after `oracle`, `oracle-split` loads no path model."""
    models, docs, _ = setup
    loads = []
    table = LossTable(docs=docs, load=lambda p, r: loads.append(p) or models[p],
                      score=lambda m, batch: token_losses(m, batch, batch_size=3, device=CPU, precision="fp32"))
    kwargs = dict(route=route, paths=np.zeros(len(docs), dtype=np.int64), rounds=ROUNDS, best=None,
                  n_paths=N_PATHS, prefix=PREFIX)
    evaluate_modes(table, modes=["oracle"], **kwargs)
    assert sorted(loads) == list(range(N_PATHS))
    (row,) = evaluate_modes(table, modes=["oracle-split"], **kwargs)["rows"]
    assert sorted(loads) == list(range(N_PATHS)) and row["mode"] == "oracle-split"


def fixed_table(docs: list[np.ndarray], losses: dict[int, list[np.ndarray]]) -> LossTable:
    """A `LossTable` whose path p gives document d the token losses `losses[p][d]`."""
    index = {id(doc): d for d, doc in enumerate(docs)}
    return LossTable(docs=docs, load=lambda p, r: p, score=lambda p, batch: [losses[p][index[id(x)]] for x in batch])


def test_split_oracle_never_scores_a_token_with_a_path_chosen_on_it(setup):
    """Replace every path's losses on one half of the scored tokens: the path chosen on the other half
    (the one scoring the replaced half) does not move, and what it scores is the replaced losses."""
    _, docs, table = setup
    before = split_oracle_scores(table, len(docs), ROUNDS, prefix=PREFIX)
    rng = np.random.default_rng(1)
    for half in (0, 1):
        changed = {p: [table.get(p, 0, d).copy() for d in range(len(docs))] for p in range(N_PATHS)}
        for p in range(N_PATHS):
            for losses in changed[p]:
                scored = losses[PREFIX:]  # a view: writes into `losses`
                scored[half::2] = rng.uniform(0, 50, size=len(scored[half::2]))
        after = split_oracle_scores(fixed_table(docs, changed), len(docs), ROUNDS, prefix=PREFIX)
        kept = 1 - half  # the choice made on the half left alone
        np.testing.assert_array_equal(after["choice"][:, kept], before["choice"][:, kept])
        assert np.any(after["choice"][:, half] != before["choice"][:, half]), "the replaced half should move its choice"
        for d in range(len(docs)):
            scores_replaced = changed[after["choice"][d, kept]][d][PREFIX:][half::2].sum()
            scores_kept = changed[after["choice"][d, half]][d][PREFIX:][kept::2].sum()
            assert after["nll"][d] == pytest.approx(scores_replaced + scores_kept)


def test_all_paths_diagonal_is_each_paths_routed_perplexity(setup):
    _, docs, table = setup
    routes = route_chunks(route, docs, prefix=PREFIX, window=10_000)
    routed = np.array([spans[0][2] if spans else -1 for spans in routes])
    grid = all_paths_table(table, routed, ROUNDS, prefix=PREFIX)
    prefix = routed_scores(table, routes, ROUNDS, N_PATHS)
    for p in range(N_PATHS):
        if prefix["path_tokens"][p]:
            assert grid[p, p] == pytest.approx(math.exp(prefix["path_nll"][p] / prefix["path_tokens"][p]))
        else:
            assert np.isnan(grid[:, p]).all()


def test_evaluate_modes_rows_match_direct_computations_and_reuse_the_table(setup):
    models, docs, _ = setup
    loads = []

    def load(path, round):
        loads.append((path, round))
        return models[path]

    table = LossTable(docs=docs, load=load,
                      score=lambda m, batch: token_losses(m, batch, batch_size=3, device=CPU, precision="fp32"))
    paths, nll = reference_prefix(models, docs)
    tokens = sum(max(0, len(d) - PREFIX) for d in docs)
    # the caller scores the prefix routing first (dipaco eval's headline row) ...
    routed_scores(table, prefix_routes(docs, paths, prefix=PREFIX), ROUNDS, N_PATHS)
    scored = len(loads)
    kwargs = dict(route=route, paths=paths, rounds=ROUNDS, best=None, n_paths=N_PATHS, prefix=PREFIX)
    (only,) = evaluate_modes(table, modes=["prefix"], **kwargs)["rows"]
    assert len(loads) == scored  # ... and the prefix row reads those losses: no path model is loaded again
    out = evaluate_modes(table, modes=["prefix", "every:8", "oracle", "all-paths"], **kwargs)
    rows = {r["mode"]: r for r in out["rows"]}
    assert rows["prefix"] == only
    assert rows["prefix"]["perplexity"] == pytest.approx(math.exp(nll.sum() / tokens), rel=1e-5)
    every = 0.0
    for doc in docs:
        for start, end in chunk_spans(len(doc), prefix=PREFIX, window=8):
            every += reference_span_nll(models[route([doc[start - PREFIX:start]], [PREFIX])[0]], doc, start, end)
    assert rows["every:8"]["perplexity"] == pytest.approx(math.exp(every / tokens), rel=1e-5)
    oracle = sum(min(reference_span_nll(m, doc, PREFIX, len(doc)) for m in models) for doc in docs if len(doc) > PREFIX)
    assert rows["oracle"]["perplexity"] == pytest.approx(math.exp(oracle / tokens), rel=1e-5)
    assert all(r["tokens"] == tokens and r["checkpoints"] == "last" for r in rows.values())
    assert len(out["all_paths"]) == N_PATHS and out["best_rounds"] is None
    # at `best` versions equal to the last ones, every row repeats (all-paths only at the last)
    both = evaluate_modes(table, modes=["prefix", "every:8", "oracle", "all-paths"], **{**kwargs, "best": ROUNDS})
    assert [r["checkpoints"] for r in both["rows"]] == ["last"] * 3 + ["best"] * 3
    assert [{**r, "checkpoints": "last"} for r in both["rows"][3:]] == out["rows"]


def test_likelihood_routes_each_document_by_the_paths_loss_on_its_prefix(setup):
    """`likelihood`: the path whose model reads the first PREFIX tokens with the lowest loss scores the
    rest; computed here from each model's own forward pass, not from the table."""
    models, docs, table = setup
    expected_paths, nll = [], 0.0
    for doc in docs:
        ids = torch.as_tensor(doc[:PREFIX], dtype=torch.long).unsqueeze(0)
        prefix_loss = []
        for m in models:
            with torch.no_grad():
                logits = m(input_ids=ids).logits[0, :-1]
            prefix_loss.append(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")))
        best = int(np.argmin(prefix_loss))
        expected_paths.append(best)
        if len(doc) > PREFIX:
            nll += reference_span_nll(models[best], doc, PREFIX, len(doc))
    choice = likelihood_choice(table, len(docs), ROUNDS, prefix=PREFIX)
    assert choice.tolist() == expected_paths
    assert len(set(expected_paths)) > 1  # the random models disagree: a constant choice would not pass
    tokens = sum(max(0, len(d) - PREFIX) for d in docs)
    kwargs = dict(route=route, paths=np.zeros(len(docs), dtype=np.int64), rounds=ROUNDS, best=None,
                  n_paths=N_PATHS, prefix=PREFIX)
    (row,) = evaluate_modes(table, modes=["likelihood"], **kwargs)["rows"]
    assert row["mode"] == "likelihood" and row["tokens"] == tokens
    assert row["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    scored = [p for p, d in zip(expected_paths, docs, strict=True) if len(d) > PREFIX]  # a 5-token doc has no span
    assert [p["documents"] for p in row["per_path"]] == np.bincount(scored, minlength=N_PATHS).tolist()
    # only the paths evaluated are candidates (e.g. one path's island never finished)
    assert set(likelihood_choice(table, len(docs), {0: 0, 2: 0}, prefix=PREFIX).tolist()) <= {0, 2}


def test_a_path_without_test_documents_is_null_not_a_broken_number(setup):
    """Issue 29, item 5: every test document routed to paths 0 and 2, none to path 1: the all-paths column of
    path 1 and its per-path perplexities are null, and eval's check for non-finite numbers (a broken module)
    finds nothing; a real NaN loss is still found."""
    from dipaco.stages.evaluate import non_finite

    models, docs, table = setup
    paths = np.array([0 if i % 2 else 2 for i in range(len(docs))])
    kwargs = dict(route=route, paths=paths, rounds=ROUNDS, best=None, n_paths=N_PATHS, prefix=PREFIX)
    out = evaluate_modes(table, modes=["prefix", "all-paths"], **kwargs)
    assert [row[1] for row in out["all_paths"]] == [None] * N_PATHS
    assert all(isinstance(row[q], float) for row in out["all_paths"] for q in (0, 2))
    assert out["rows"][0]["per_path"][1]["perplexity"] is None
    assert non_finite(out) == []
    assert "docs of 1" in format_modes(out)

    broken = LossTable(docs=docs, load=lambda p, r: models[p],
                       score=lambda m, batch: [np.full(len(d), np.nan if m is models[2] else 1.0) for d in batch])
    found = non_finite(evaluate_modes(broken, modes=["prefix", "all-paths"], **kwargs))
    assert "all_paths[2][0]=nan" in found and "rows[0].perplexity=nan" in found


def test_likelihood_among_the_routers_shortlist_scores_only_its_candidates(setup):
    """`likelihood:K`: each document goes to the candidate of its row whose model reads the prefix with the
    lowest loss, computed here from each model's own forward pass; only the candidates' losses are computed;
    K = every path is `likelihood`, one candidate is that candidate's routing."""
    models, docs, _ = setup
    scored: list[tuple[int, int]] = []

    def score(model, batch):
        scored.append((models.index(model), len(batch)))
        return token_losses(model, batch, batch_size=3, device=CPU, precision="fp32")

    table = LossTable(docs=docs, load=lambda p, r: models[p], score=score)
    candidates = np.array([[(d + 1) % N_PATHS, d % N_PATHS] for d in range(len(docs))])
    choice = likelihood_choice(table, len(docs), ROUNDS, prefix=PREFIX, candidates=candidates)
    for d, doc in enumerate(docs):
        ids = torch.as_tensor(doc[:PREFIX], dtype=torch.long).unsqueeze(0)
        losses = {}
        for p in sorted(candidates[d]):
            with torch.no_grad():
                logits = models[p](input_ids=ids).logits[0, :-1]
            losses[int(p)] = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        assert choice[d] == min(losses, key=losses.get)
    assert sum(n for _, n in scored) == 2 * len(docs)  # two candidates per document, no other path scored
    full = LossTable(docs=docs, load=lambda p, r: models[p],
                     score=lambda m, batch: token_losses(m, batch, batch_size=3, device=CPU, precision="fp32"))
    everyone = np.tile(np.arange(N_PATHS), (len(docs), 1))
    assert (likelihood_choice(full, len(docs), ROUNDS, prefix=PREFIX, candidates=everyone)
            == likelihood_choice(full, len(docs), ROUNDS, prefix=PREFIX)).all()
    kwargs = dict(route=route, paths=candidates[:, 0], rounds=ROUNDS, best=None, n_paths=N_PATHS, prefix=PREFIX)
    one, prefix_row = evaluate_modes(full, modes=["likelihood:1", "prefix"], shortlist=lambda ds, k: candidates[:, :k],
                                     **kwargs)["rows"]
    assert one["perplexity"] == prefix_row["perplexity"] and one["mode"] == "likelihood:1"
    with pytest.raises(ValueError, match="shortlist"):
        evaluate_modes(full, modes=["likelihood:2"], **kwargs)
    with pytest.raises(ValueError, match="none of its candidate paths"):
        likelihood_choice(full, len(docs), {0: 0}, prefix=PREFIX, candidates=np.ones((len(docs), 1), dtype=np.int64))
    assert parse_mode("likelihood:4") == ("likelihood", 4)
    for bad in ("likelihood:0", "likelihood:x"):
        with pytest.raises(ValueError, match="candidate paths"):
            parse_mode(bad)
