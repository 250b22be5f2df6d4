"""The whole mixture as one directory (`dipaco export DIR`, `dipaco.load`): routed generation equal to
`dipaco generate` token for token for both routings, a copy of the directory that loads on its own,
each path loadable by transformers alone, a damaged manifest refused by name, at most N paths in memory.

The mixture is conftest's `tiny_mixture` (the tiny run exported, then moved), copied where a test
changes it."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import dipaco
from dipaco.cli import main
from dipaco.config import load_config
from dipaco.inference.hub_repo import INDEX
from dipaco.inference.manifest import MANIFEST
from dipaco.pipeline.context import PathFactory
from dipaco.stages.generate import generate


@pytest.fixture(scope="module")
def factory(tiny_trained) -> PathFactory:
    return PathFactory(load_config(tiny_trained.config), tiny_trained)


@pytest.fixture(scope="module")
def exported(tiny_mixture):
    """The mixture exported by the CLI, then moved elsewhere (the original directory deleted): what loads is
    a copy that holds everything it needs (conftest's `tiny_mixture`; read only)."""
    return tiny_mixture


@pytest.fixture(scope="module")
def prompts(factory) -> list[str]:
    """Prompts from test documents' first tokens, so the router spreads them over several paths."""
    docs, _, _ = factory.reader.test_documents()
    return [factory.tokenizer.decode(doc[:12].tolist()) for doc in docs[:8]]


def test_the_manifest_describes_the_directory(exported, factory):
    manifest = json.loads((exported / MANIFEST).read_text())
    assert manifest["format"] == "dipaco-mixture" and manifest["format_version"] == 2
    assert manifest["levels"] == [2, 2] and manifest["prefix_tokens"] == factory.prefix_tokens
    assert manifest["route"] == "router" and manifest["featurizer"] is None  # tiny routes on TF-IDF
    last = factory.store.current_round()
    assert {p: e["round"] for p, e in manifest["paths"].items()} == {str(p): last for p in range(4)}
    assert sorted(p.name for p in (exported / "baselines").iterdir()) == ["dense-equal-compute", "dense-equal-steps"]


@pytest.mark.parametrize("route", ["router", "likelihood", "likelihood:2"])
def test_routed_generation_equals_dipaco_generate_token_for_token(exported, factory, prompts, route):
    mixture = dipaco.load(exported, route=route)
    rounds = {p: factory.store.current_round() for p in range(factory.topology.n_paths)}
    paths = set()
    for prompt in prompts:
        expected, path = generate(factory, prompt, rounds=rounds, max_new_tokens=12, route=route)
        completion = mixture.complete(prompt, max_new_tokens=12)
        assert (completion.path, completion.text) == (path, expected)
        (prompt_ids,) = mixture.encode([prompt])
        assert mixture.tokenizer.decode([*prompt_ids.tolist(), *completion.tokens.tolist()]) == expected
        paths.add(path)
    assert len(paths) > 1, f"every prompt went to path {paths}: the test would not tell paths apart"


def test_each_path_loads_alone_with_transformers(exported):
    mixture = dipaco.load(exported)
    ids = torch.as_tensor(mixture.encode(["In the beginning God created"])[0])[None]
    for path, entry in mixture.manifest.paths.items():
        alone = AutoModelForCausalLM.from_pretrained(exported / entry.dir).eval()
        with torch.no_grad():
            np.testing.assert_allclose(alone(input_ids=ids).logits.numpy(),
                                       mixture.model(path)(input_ids=ids).logits.numpy(), rtol=1e-6, atol=1e-6)


def test_at_most_max_loaded_paths_stay_in_memory(exported, prompts):
    mixture = dipaco.load(exported, max_loaded=1)
    paths = mixture.route_texts(prompts)
    for prompt in prompts:
        mixture.complete(prompt, max_new_tokens=1)
        assert len(mixture.paths.loaded) == 1
    assert mixture.paths.loads == 1 + int((paths[1:] != paths[:-1]).sum())  # a load at each change of path


def corrupt(manifest: dict, change: str) -> dict:
    if change == "missing":
        del manifest["prefix_tokens"]
    elif change == "type":
        manifest["max_length"] = "64"
    elif change == "version":
        manifest["format_version"] = 99
    elif change == "escape":
        manifest["tokenizer"] = "../tokenizer"
    elif change == "path-dir":
        manifest["paths"]["2"]["dir"] = "path-0009"
    elif change == "paths":
        del manifest["paths"]["3"]
    elif change == "choice":
        manifest["paths"]["0"]["choice"] = [0]
    return manifest


@pytest.mark.parametrize("change, field", [("missing", "prefix_tokens"), ("type", "max_length"),
                                           ("version", "format_version"), ("escape", "tokenizer"),
                                           ("path-dir", "paths.2.dir"), ("paths", "paths"),
                                           ("choice", "paths.0.choice")])
def test_a_damaged_manifest_is_refused_naming_the_file_and_the_field(exported, tmp_path, change, field):
    copy = tmp_path / "mixture"
    shutil.copytree(exported, copy, ignore=shutil.ignore_patterns("path-*", "baselines"))
    for entry in exported.glob("path-*"):  # the paths' directories only need to exist with a config.json
        (copy / entry.name).mkdir()
        shutil.copy2(entry / "config.json", copy / entry.name / "config.json")
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps(corrupt(manifest, change)))
    with pytest.raises(ValueError, match=rf"{MANIFEST}: field '{field}'"):
        dipaco.load(copy)


def test_a_directory_without_a_manifest_or_with_broken_json_is_refused(exported, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{MANIFEST} does not exist"):
        dipaco.load(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=f"{MANIFEST} is not valid JSON"):
        dipaco.load(tmp_path)


def test_export_all_is_the_mixture_and_a_path_keeps_its_own_export(tiny_trained, tmp_path):
    assert main(["export", str(tmp_path / "all"), "--run", str(tiny_trained.root), "--all", "--route",
                 "likelihood"]) == 0
    assert dipaco.load(tmp_path / "all").route == "likelihood"
    assert main(["export", str(tmp_path / "one"), "--run", str(tiny_trained.root), "--path", "2", "--baselines"]) == 1


def test_a_router_on_a_model_featurizer_travels_with_its_model(tiny_trained, exported, factory, tmp_path):
    """A router that featurizes prefixes with a model (`hf`, `base-model`): the export copies that model in,
    so the mixture routes as the run's router does after the model's own directory is gone."""
    from cli_helpers import copy_run

    from routing import Router, RoutingConfig

    source = tmp_path / "featurizer-source"
    shutil.copytree(exported / "path-0000", source)
    run = copy_run(tiny_trained, tmp_path / "run", tuple(p.name for p in tiny_trained.root.iterdir()))
    docs, _, _ = factory.reader.test_documents()
    prefixes = [factory.tokenizer.decode(doc[:8].tolist()) for doc in docs]
    router, _ = Router.fit(prefixes, levels=[2, 2], config=RoutingConfig(featurizer="hf", hf_model=str(source),
                                                                         prefix_tokens=8, kmeans_iters=5))
    router.save(run.routing)  # in place of the run's TF-IDF router
    assert main(["export", str(tmp_path / "mixture"), "--run", str(run.root)]) == 0
    shutil.rmtree(source)
    mixture = dipaco.load(tmp_path / "mixture")
    assert mixture.manifest.featurizer == "featurizer"
    np.testing.assert_array_equal(mixture.route_texts(prefixes), router.route(prefixes))
    hub = AutoModelForCausalLM.from_pretrained(tmp_path / "mixture", trust_remote_code=True)  # without dipaco's router
    tokens = [torch.as_tensor(t.astype(np.int64)) for t in mixture.encode(prefixes)]
    assert hub.route(tokens) == mixture.route_tokens(mixture.encode(prefixes)).tolist()


def test_a_pickled_weight_file_is_never_loaded(exported, tmp_path):
    """The paths are built from the shards at the top: a pickle there, or no shard index, is refused."""
    copy = tmp_path / "mixture"
    shutil.copytree(exported, copy, ignore=shutil.ignore_patterns("baselines"))
    torch.save({"weights": torch.zeros(1)}, copy / "pytorch_model.bin")
    mixture = dipaco.load(copy)
    with pytest.raises(ValueError, match=r"mixture holds \['pytorch_model.bin'\]: .* never a pickle"):
        mixture.model(1)
    (copy / "pytorch_model.bin").unlink()
    (copy / INDEX).unlink()
    with pytest.raises(ValueError, match=f"mixture has no {INDEX}"):
        mixture.model(1)


def test_likelihood_among_the_routers_best_paths_picks_from_its_shortlist(exported, prompts):
    """`route="likelihood:K"`: each prompt goes to the path of lowest prefix loss among the router's K best for
    it (checked against each candidate's own forward pass); K = every path is `likelihood`, K = 1 the router;
    a route that is not one is refused by name."""
    router = dipaco.load(exported, route="router")
    shortlist = router.router.shortlist(router.encode(prompts), 2)
    two = dipaco.load(exported, route="likelihood:2")
    chosen = two.route_texts(prompts)
    for tokens, row, path in zip(two.encode(prompts), shortlist, chosen, strict=True):
        ids = torch.as_tensor(tokens[:two.prefix_tokens])[None]
        losses = {}
        for p in sorted(int(q) for q in row):
            with torch.no_grad():
                logits = two.model(p)(input_ids=ids).logits[0, :-1].float()
            losses[p] = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        assert path == min(losses, key=losses.get)
    assert (dipaco.load(exported, route="likelihood:4").route_texts(prompts)
            == dipaco.load(exported, route="likelihood").route_texts(prompts)).all()
    assert (dipaco.load(exported, route="likelihood:1").route_texts(prompts) == router.route_texts(prompts)).all()
    for bad in ("likelihood:0", "likelihood:two", "router:2"):
        with pytest.raises(ValueError, match="likelihood:K"):
            dipaco.load(exported, route=bad)
