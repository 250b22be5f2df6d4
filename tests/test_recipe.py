"""A config of a few lines — the corpus and the sizes — trains the recipe: the defaults are the recipe.

`dipaco run` on such a config (tiny sizes) must pretrain a dense warm start of half the run, route on
its features, start every module and every path's AdamW from it, give each path its own embeddings,
and plain-average the rounds in the inner lr's decay.
"""

import json

import pytest
import torch
from cli_helpers import dipaco_in_process
from safetensors.torch import load_file

from dipaco.config import load_config
from dipaco.run_dir import RunDir
from dipaco.store.board import warm_start_inner_ref
from dipaco.store.module_store import ModuleStore

FEW_LINES = """\
corpus:
  path: demo
  max_documents: 600
sharding:
  vocab_size: 512
  seq_len: 64
routing:
  prefix_tokens: 8
model:
  hidden_size: 32
  n_layers: 2
  n_heads: 2
inner:
  steps: 4
  batch_size: 4
run:
  rounds: 2
"""

# The recipe, key by key, as docs/configuration.md describes it (a default that changes must change here too)
RECIPE = {
    "warm_start.fraction": 0.5, "warm_start.init_modules": True, "warm_start.continue_optimizer": True,
    "routing.featurizer": "base-model", "routing.method": "flat",
    "inner.schedule": "wsd", "inner.decay_fraction": 0.2, "inner.lr": 3e-3,
    "outer.lr": 0.7, "outer.momentum": 0.9, "outer.nesterov": True, "outer.rescale_by_paths": False,
    "outer.weighting": "shard", "outer.decay": "average",
    "topology.private_embeddings": True,
}


@pytest.fixture(scope="module")
def few_lines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipe")
    (folder / "mine.yaml").write_text(FEW_LINES)
    return folder / "mine.yaml"


def test_a_config_of_a_few_lines_resolves_to_the_recipe(few_lines):
    config = load_config(few_lines).to_dict()
    assert {key: config[key.split(".")[0]][key.split(".")[1]] for key in RECIPE} == RECIPE
    # half the run's path-model steps: as many warm-start steps as the 4 paths train (2 rounds x 4 steps)
    assert load_config(few_lines).pretrain_steps == 4 * 2 * 4


def test_a_config_of_a_few_lines_trains_the_recipe(few_lines, tmp_path):
    run = RunDir(tmp_path / "run")
    code, log = dipaco_in_process("run", "--config", few_lines, "--run", run.root, "eval.baselines=false",
                                  "eval.modes=[prefix]", "hardware.precision=fp32",
                                  "store.keep_versions=0")
    assert code == 0, log[-3000:]
    assert json.loads((run.pretrain / "summary.json").read_text())["steps"] == 32  # the warm start ran
    assert json.loads((run.routing / "router.json").read_text())["featurizer"]["name"] == "base-model"
    store = ModuleStore(str(run.store))
    assert store.exists(warm_start_inner_ref())  # every path's first task continues the warm start's AdamW
    names = set(store.state()["modules"])
    assert {f"path{p:03d}.embeddings" for p in range(4)} <= names and "embeddings" not in names
    warm = load_file(run.pretrain / "model.safetensors")
    for name in ("path002.embeddings", "level0.module1"):  # version 0 of every module is the warm start's
        module = store.read_module(0, name)
        assert module and all(torch.equal(tensor, warm[param]) for param, tensor in module.items()), name
    rounds = json.loads(run.train_summary.read_text())["rounds"]
    assert [r["outer_step"] for r in rounds] == ["average", "average"]  # every path step lies in the wsd decay
    # so the configured Nesterov never ran: train.json says the step as applied
    assert json.loads(run.train_summary.read_text())["outer_steps"] == [
        {"rounds": [1, 2], "outer_step": "average", "lr": 1.0, "momentum": 0.0, "nesterov": False,
         "rescale_by_paths": False}]
