"""Tests of routing.embed and routing.router: featurizer state, fit / save / load, assignments.

python -m pytest tests/test_routing_router.py -q
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from routing import Assignments, Router, RoutingConfig, assign_splits
from routing.corpus import TEST, TRAIN
from routing.embed import TfidfSvdFeaturizer
from routing.featurizers import make_featurizer

TOPICS = [
    "cat dog horse cow sheep goat pig mouse rabbit hamster".split(),
    "python rust compiler kernel thread memory cache pointer syntax module".split(),
    "violin piano guitar drums melody rhythm chord orchestra singer concert".split(),
    "football tennis soccer rugby goal match referee league stadium coach".split(),
    "bread butter cheese pasta tomato garlic onion pepper salad soup".split(),
    "planet galaxy comet orbit telescope nebula asteroid rocket moon star".split(),
]


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = TOPICS[i % len(TOPICS)] + TOPICS[(i * 7 + 3) % len(TOPICS)][:3]
        docs.append(" ".join(rng.choice(words, size=12)))
    return docs


CONFIG = RoutingConfig(featurizer="tfidf", method="product", svd_dim=8, max_features=1000, kmeans_iters=10, seed=0)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return _docs(240)


@pytest.fixture(scope="module")
def product_router(docs):
    return Router.fit(docs, levels=[2, 3], config=CONFIG)


def test_featurizer_state_round_trip(docs):
    feat, stats = TfidfSvdFeaturizer.fit(docs, dim=8, max_features=1000, seed=0)
    x = feat.transform(docs)
    assert x.shape == (len(docs), 8) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    tensors, meta = feat.state_dict()
    json.dumps(meta)  # JSON-able
    loaded = TfidfSvdFeaturizer.from_state(
        {k: v.copy() for k, v in tensors.items()}, json.loads(json.dumps(meta))
    )
    new = _docs(50, seed=1) + ["nothing known here", "the a an"]
    np.testing.assert_allclose(loaded.transform(new), feat.transform(new), atol=1e-6, rtol=0)
    assert stats["n_terms"] == len(meta["vocabulary"])


def test_featurizer_clamps_dim_to_the_data(caplog):
    feat, stats = TfidfSvdFeaturizer.fit(
        ["red apple", "green pear", "red pear"], dim=64, max_features=100, seed=0
    )
    assert stats["dim"] == feat.dim == 2  # min(#terms=4, #texts=3) - 1
    assert "clamped" in caplog.text


@pytest.mark.parametrize("method,levels", [("product", [2, 3]), ("flat", [2, 3]), ("product", [4])])
def test_fit_routes_to_valid_paths(docs, method, levels):
    config = RoutingConfig(featurizer="tfidf", svd_dim=8, max_features=1000, kmeans_iters=10, method=method)
    router, stats = Router.fit(docs, levels=levels, config=config)
    paths = router.route(docs)
    assert paths.dtype == np.int64 and paths.shape == (len(docs),)
    assert router.n_paths == math.prod(levels)
    assert paths.min() >= 0 and paths.max() < router.n_paths
    np.testing.assert_array_equal(np.bincount(paths, minlength=router.n_paths), stats["sizes"])
    np.testing.assert_array_equal(paths, router.assign(router.features(docs)))


def test_product_route_is_ravelled_per_level_nearest_centroid(docs, product_router):
    router, _ = product_router
    x = router.features(docs).astype(np.float64)
    per_level = []
    for c, (lo, hi) in zip(router.centroids, router.slices, strict=True):
        per_level.append(((x[:, None, lo:hi] - c[None].astype(np.float64)) ** 2).sum(-1).argmin(1))
    np.testing.assert_array_equal(router.route(docs), np.ravel_multi_index(tuple(per_level), router.levels))


def test_one_level_product_equals_flat(docs):
    a, _ = Router.fit(docs, levels=[5], config=CONFIG)
    b, _ = Router.fit(docs, levels=[5], config=RoutingConfig(**{**vars(CONFIG), "method": "flat"}))
    np.testing.assert_array_equal(a.route(docs), b.route(docs))
    assert a.centroids[0].tobytes() == b.centroids[0].tobytes()


def test_too_few_prefixes():
    with pytest.raises(ValueError, match=r"\[4, 4\] give 16 paths.*10 prefixes"):
        Router.fit(_docs(10), levels=[4, 4], config=CONFIG)


def test_same_seed_identical_routes(docs, product_router):
    router, _ = product_router
    again, _ = Router.fit(docs, levels=[2, 3], config=CONFIG)
    np.testing.assert_array_equal(router.route(docs), again.route(docs))
    assert router.fingerprint() == again.fingerprint()


def test_save_load_round_trip(tmp_path, docs, product_router):
    router, _ = product_router
    router.save(tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["router.json", "router.safetensors"]
    loaded = Router.load(tmp_path / "r")
    new = _docs(60, seed=5)
    np.testing.assert_array_equal(loaded.route(new), router.route(new))
    np.testing.assert_array_equal(loaded.route(docs), router.route(docs))
    assert loaded.fingerprint() == router.fingerprint() == router.fingerprint()
    meta = json.loads((tmp_path / "r" / "router.json").read_text())
    assert (
        meta["format_version"] == 1
        and meta["levels"] == [2, 3]
        and meta["fingerprint"] == router.fingerprint()
    )
    assert loaded.config == router.config and loaded.method == "product"


def test_load_refuses_bad_version_missing_file_and_mismatch(tmp_path, docs, product_router):
    router, _ = product_router
    d = router.save(tmp_path / "r")
    meta_file = d / "router.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match=r"router\.json.*99"):
        Router.load(d)
    meta_file.write_text(json.dumps({**meta, "seed": 1}))
    with pytest.raises(ValueError, match="fingerprint"):
        Router.load(d)
    (d / "router.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="router.safetensors"):
        Router.load(d)
    with pytest.raises(FileNotFoundError, match="router.json"):
        Router.load(tmp_path / "nowhere")


def test_assignments_round_trip_and_sizes(tmp_path, docs, product_router):
    router, _ = product_router
    paths = router.route(docs)
    split = assign_splits(len(docs), test_fraction=0.1, seed=0)
    a = Assignments(path=paths, split=split, levels=router.levels, router_fingerprint=router.fingerprint())
    for code in (TRAIN, TEST):
        np.testing.assert_array_equal(a.sizes(code), np.bincount(paths[split == code], minlength=6))
    a.save(tmp_path / "a")
    b = Assignments.load(tmp_path / "a")
    np.testing.assert_array_equal(b.path, a.path)
    np.testing.assert_array_equal(b.split, a.split)
    assert b.path.dtype == np.int64 and b.split.dtype == np.int8
    assert b.levels == a.levels and b.router_fingerprint == router.fingerprint()
    meta = json.loads((tmp_path / "a" / "assignments.json").read_text())
    assert meta["counts"]["train"] == a.sizes(TRAIN).tolist()
    assert meta["counts"]["test"] == a.sizes(TEST).tolist()


def test_assignments_checks(tmp_path):
    with pytest.raises(ValueError, match="must be equal-length"):
        Assignments(path=np.zeros(3), split=np.zeros(4), levels=[2], router_fingerprint="x")
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        Assignments(path=np.array([0, 4]), split=np.zeros(2), levels=[2, 2], router_fingerprint="x")
    a = Assignments(
        path=np.array([0, 3, 1]), split=np.array([0, 1, 0]), levels=[2, 2], router_fingerprint="x"
    )
    d = a.save(tmp_path / "a")
    meta = json.loads((d / "assignments.json").read_text())
    (d / "assignments.json").write_text(json.dumps({**meta, "n_documents": 5}))
    with pytest.raises(ValueError, match=r"assignments.safetensors.*says 5 documents"):
        Assignments.load(d)
    (d / "assignments.json").write_text(json.dumps({**meta, "format_version": 2}))
    with pytest.raises(ValueError, match=r"assignments\.json.*format_version 2"):
        Assignments.load(d)


def test_corrupt_tensor_file_is_refused(tmp_path, product_router):
    router, _ = product_router
    d = router.save(tmp_path / "r")
    (d / "router.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="router.safetensors"):
        Router.load(d)


def test_cli_end_to_end(tmp_path, capsys, monkeypatch):
    import datasets

    from routing.__main__ import main

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # keep ~/.cache clean
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(120)))
    out = tmp_path / "out"
    main(["--corpus", str(corpus), "--levels", "2", "2", "--svd-dim", "8", "--out", str(out)])
    router, assignments = Router.load(out), Assignments.load(out)
    assert assignments.router_fingerprint == router.fingerprint() and len(assignments) == 120
    assert int(assignments.sizes(TRAIN).sum()) + int(assignments.sizes(TEST).sum()) == 120
    assert "total" in capsys.readouterr().out


def test_fit_on_features_is_fit_without_featurizing_again(docs, product_router):
    product_router, _ = product_router
    featurizer, stats = make_featurizer(docs, CONFIG)
    router, fit_stats = Router.fit_on_features(featurizer, featurizer.transform(docs), levels=[2, 3], config=CONFIG,
                                               featurizer_stats=stats)
    assert router.fingerprint() == product_router.fingerprint()
    assert fit_stats["featurizer"] == stats and sum(fit_stats["sizes"]) == len(docs)
    with pytest.raises(ValueError, match=r"features must have shape \(N, 8\), got \(240, 3\)"):
        Router.fit_on_features(featurizer, np.zeros((240, 3)), levels=[2, 3], config=CONFIG)
    with pytest.raises(ValueError, match="only 4 prefixes to fit on"):
        Router.fit_on_features(featurizer, featurizer.transform(docs[:4]), levels=[2, 3], config=CONFIG)


def test_route_featurizes_each_prefix_once(tmp_path, monkeypatch):
    from dipaco.config import load_config
    from dipaco.run_dir import RunDir
    from dipaco.stages.route import route

    rows = []
    transform = TfidfSvdFeaturizer.transform
    monkeypatch.setattr(TfidfSvdFeaturizer, "transform", lambda self, texts: rows.append(len(texts)) or transform(self, texts))
    run = RunDir(tmp_path / "run")
    route(load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"), run)
    documents = len(Assignments.load(run.routing).path)
    assert sum(rows) == documents
