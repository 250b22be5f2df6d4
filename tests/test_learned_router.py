"""The learned router (issue 39.1): labels from the paths' own losses, a router on the prefix features, its cost.

- the labels equal an argmin of per-path losses computed here independently (a plain forward pass and
  cross-entropy per document and path) on the trained tiny run;
- routing is a pure function of the prefix, for the k-means and the learned router alike;
- the router file round-trips with pickle unavailable;
- the load balance and the routing cost against independent computations;
- (slow) `dipaco run` with `routing.router=learned`: the phases, the cost and balance in phases.json, the
  evaluation routed by the learned router, a second `dipaco run` adds no phase, and the exported mixture
  routes prompts as the learned router does.

HF_HUB_OFFLINE=1 python -m pytest tests/test_learned_router.py -q [-m slow]
"""

import json
import pickle
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_helpers import TINY, dipaco

from dipaco.config import load_config
from dipaco.eval.modes import LossTable
from dipaco.eval.path_labels import best_paths, candidate_losses, candidate_prefix_losses, losses_record
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.eval.scoring import token_losses
from dipaco.pipeline.context import PathFactory
from dipaco.run_dir import RunDir
from routing.assignments import Assignments
from routing.discriminative import fit_discriminative
from routing.router import ROUTER_JSON, ROUTER_TENSORS, Router
from routing.router_cost import load_balance, routing_cost
from sharding.reader import ShardReader


def _independent_mean_nll(model: torch.nn.Module, doc: np.ndarray, skip: int) -> float:
    """Mean NLL of tokens skip.. of one document, from the logits of one unpadded forward pass."""
    ids = torch.as_tensor(doc.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # (T, V)
    return float(F.cross_entropy(logits[skip - 1 : -1], ids[0, skip:], reduction="mean"))


def _independent_prefix_nll(model: torch.nn.Module, doc: np.ndarray, prefix: int) -> float:
    """Total NLL of tokens 1..prefix-1 of one document (the first has no context), one unpadded forward pass."""
    ids = torch.as_tensor(doc.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # (T, V)
    return float(F.cross_entropy(logits[: prefix - 1], ids[0, 1:prefix], reduction="sum"))


@pytest.fixture(scope="module")
def factory(tiny_trained) -> PathFactory:
    return PathFactory(load_config(tiny_trained.config, ["hardware.device=cpu"]), tiny_trained)


def test_labels_equal_an_independent_argmin_of_path_losses(factory, tiny_trained):
    docs = ShardReader(tiny_trained.shards).test_documents()[0][:10]
    skip, n_paths, round = factory.prefix_tokens, factory.topology.n_paths, factory.store.current_round()
    models = [factory.load_path(path=p, round=round).eval() for p in range(n_paths)]
    expected = np.array([[_independent_mean_nll(m, d, skip) for m in models] for d in docs])  # (D, paths)
    assert len(set(expected.argmin(axis=1).tolist())) > 1, "the paths should disagree on some document"
    table = LossTable(docs=docs, load=lambda p, r: factory.load_path(path=p, round=r),
                      score=partial(token_losses, batch_size=4, device=torch.device("cpu"), precision="fp32"))
    every = np.tile(np.arange(n_paths), (len(docs), 1))
    nll = candidate_losses(table, every, round=round, n_paths=n_paths, skip=skip)
    np.testing.assert_allclose(nll, expected, rtol=1e-5)
    np.testing.assert_array_equal(best_paths(nll), expected.argmin(axis=1))
    # with two candidates per document the label is the better of those two
    two = np.stack([np.arange(len(docs)) % n_paths, (np.arange(len(docs)) + 1) % n_paths], axis=1)
    nll2 = candidate_losses(table, two, round=round, n_paths=n_paths, skip=skip)
    assert np.isinf(nll2).sum() == len(docs) * (n_paths - 2)
    picked = expected[np.arange(len(docs))[:, None], two].argmin(axis=1)
    np.testing.assert_array_equal(best_paths(nll2), two[np.arange(len(docs)), picked])
    # the prefix losses (likelihood routing's) and the record `dipaco reroute` keeps
    prefix_expected = np.array([[_independent_prefix_nll(m, d, skip) for m in models] for d in docs])
    prefix_nll2 = candidate_prefix_losses(table, two, round=round, n_paths=n_paths, prefix=skip)
    finite = np.isfinite(prefix_nll2)
    np.testing.assert_array_equal(finite, np.isfinite(nll2))
    np.testing.assert_allclose(prefix_nll2[finite], prefix_expected[finite], rtol=1e-5)
    record = json.loads(json.dumps(losses_record(nll2, prefix_nll2, documents=np.arange(len(docs)) + 7, round=round,
                                                 prefix=skip)))
    assert record["documents"] == list(range(7, 7 + len(docs))) and record["round"] == round
    back = np.array([[np.inf if x is None else x for x in row] for row in record["nll"]])
    np.testing.assert_array_equal(back, nll2)


@pytest.fixture(scope="module")
def routers(tiny_trained) -> dict[str, Router]:
    """The run's k-means router, and a learned one on its features (labels: a seeded draw, every path)."""
    kmeans = Router.load(tiny_trained.routing)
    x = np.load(tiny_trained.routing / "features.npy")
    labels = np.random.default_rng(0).integers(0, kmeans.n_paths, len(x))
    (w, b), _ = fit_discriminative(x, labels, n_paths=kmeans.n_paths, target=None)
    learned = Router(levels=kmeans.levels, method=kmeans.method, featurizer=kmeans.featurizer,
                     centroids=kmeans.centroids, config=kmeans.config, linear=(w, b))
    return {"kmeans": kmeans, "learned": learned}


@pytest.mark.parametrize("kind", ["kmeans", "learned"])
def test_routing_is_a_pure_function_of_the_prefix(kind, routers, factory, tiny_trained):
    router = PrefixRouter(routers[kind], factory.tokenizer, factory.topology, prefix_tokens=factory.prefix_tokens)
    assert routers[kind].kind == kind
    docs = ShardReader(tiny_trained.shards).test_documents()[0][:12]
    skip = factory.prefix_tokens
    paths = router(docs)
    rng = np.random.default_rng(1)
    other_suffix = [np.concatenate([d[:skip], rng.integers(5, 500, len(d) - skip)]) for d in docs]
    np.testing.assert_array_equal(router(other_suffix), paths)
    np.testing.assert_array_equal(router(docs), paths)  # deterministic across calls
    np.testing.assert_array_equal([router([d])[0] for d in docs[::-1]], paths[::-1])  # alone = in a batch
    if kind == "learned":
        assert len(set(paths.tolist())) > 1


def test_router_file_round_trips_without_pickle(routers, tmp_path, monkeypatch):
    learned = routers["learned"]
    learned.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ROUTER_JSON, ROUTER_TENSORS])
    meta = json.loads((tmp_path / ROUTER_JSON).read_text())
    assert "router" not in meta["config"]  # the run's switch is not a property of a fitted router

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used to load a router")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    back = Router.load(tmp_path)
    assert back.kind == "learned" and back.fingerprint() == learned.fingerprint()
    np.testing.assert_array_equal(back.linear[0], learned.linear[0])
    np.testing.assert_array_equal(back.linear[1], learned.linear[1])
    prefixes = ["the quick brown fox", "def main(argv):", "In the beginning"]
    np.testing.assert_array_equal(back.route(prefixes), learned.route(prefixes))


def test_load_balance_against_numpy():
    paths = np.random.default_rng(3).choice(5, 200, p=[0.4, 0.3, 0.2, 0.1, 0.0])
    got = load_balance(paths, n_paths=6)
    counts = np.array([(paths == p).sum() for p in range(6)])
    share = counts[counts > 0] / counts.sum()
    assert got["sizes"] == counts.tolist() and got["empty_paths"] == 2
    assert (got["min"], got["median"], got["max"]) == (0, float(np.median(counts)), counts.max())
    assert got["entropy_bits"] == pytest.approx(-(share * np.log2(share)).sum())
    assert got["max_entropy_bits"] == pytest.approx(np.log2(6))
    assert load_balance(np.arange(8) % 4, n_paths=4)["entropy_bits"] == pytest.approx(2.0)


def test_routing_cost_times_both_routers_on_the_same_prefixes(routers):
    prefixes = [f"document {i} about topic {i % 7}" for i in range(50)]
    cost = routing_cost(routers, prefixes, repeats=2)
    for c in cost.values():
        assert c["documents"] == 50 and c["assign_ms_per_document"] > 0 and c["featurize_ms_per_document"] > 0
        assert c["ms_per_document"] == pytest.approx(c["assign_ms_per_document"] + c["featurize_ms_per_document"])


def test_a_learned_router_needs_a_router_split():
    with pytest.raises(ValueError, match=r"routing.router 'learned'.*corpus.router_fraction > 0 \(got 0.0\)"):
        load_config(TINY, ["routing.router=learned"])
    with pytest.raises(ValueError, match=r"reroute.phases 3 .* run.rounds 2"):
        load_config(TINY, ["routing.router=learned", "corpus.router_fraction=0.1", "reroute.phases=3"])


def test_a_resumed_run_skips_only_the_phases_of_its_own_training(tiny_trained, tmp_path):
    """A phase counts as done when the store has reached its round (tiny_trained's store: round 3); after
    `--restart-from train` (no store yet) none does."""
    from dipaco.stages.run import _phases_done

    run = RunDir(tmp_path / "run")
    run.routing.mkdir(parents=True)
    (run.routing / "phases.json").write_text(json.dumps([{"after_round": r} for r in (1, 3, 5)]))
    config = load_config(TINY, [f"store.url={tiny_trained.store}"])
    assert _phases_done(config, run) == {1, 3}
    assert _phases_done(load_config(TINY, [f"store.url={tmp_path / 'new-store'}"]), run) == set()


@pytest.mark.slow
def test_run_with_the_learned_router(tmp_path):
    """`dipaco run` with two phases: after round 1 (re-sharded, training goes on) and after round 2."""
    run = RunDir(tmp_path / "run")
    args = ["--config", str(TINY), "--run", str(run.root), "corpus.router_fraction=0.15", "routing.router=learned",
            "reroute.phases=2", "eval.baselines=false"]
    dipaco("run", *args, timeout=900)
    phases = json.loads((run.routing / "phases.json").read_text())
    assert [p["after_round"] for p in phases] == [1, 2]
    router = Router.load(run.routing)
    assert router.kind == "learned" and Router.load(run.routing / "phase-0").kind == "kmeans"
    first = phases[0]
    assert first["routing_cost"]["previous"]["router"] == "kmeans" and first["routing_cost"]["new"]["router"] == "learned"
    assert first["routing_cost"]["new"]["ms_per_document"] > 0
    train = Assignments.load(run.routing)
    assert sum(phases[-1]["balance"]["new"]["sizes"]) == int((train.split == 0).sum())
    assert json.loads((run.root / "eval.json").read_text())["routing_agrees_with_shards"] == 1.0
    dipaco("run", *args, timeout=900)  # resumed: finished, nothing to re-route
    assert len(json.loads((run.routing / "phases.json").read_text())) == 2
    # the exported mixture routes prompts by the learned router
    import dipaco as package

    dipaco("export", str(tmp_path / "mixture"), "--run", str(run.root))
    mixture = package.load(tmp_path / "mixture")
    factory = PathFactory(load_config(run.config), run)
    texts = [factory.tokenizer.decode(d) for d in ShardReader(run.shards).test_documents()[0][:16]]
    expected = PrefixRouter(router, factory.tokenizer, factory.topology, prefix_tokens=factory.prefix_tokens)
    np.testing.assert_array_equal(mixture.route_texts(texts), expected.route_texts(texts))
