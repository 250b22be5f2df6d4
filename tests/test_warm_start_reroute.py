"""Dense warm start, base-model routing and one discriminative phase on the tiny config.

- `dipaco pretrain` then `dipaco route` with the base-model featurizer: the router's features are the
  pretrained model's mean last hidden states; version 0 of every module equals the dense model;
- (slow) train one round, `dipaco reroute`: the phase is recorded, the shards are rewritten for the
  new router, training continues from the current modules, and evaluation routes by the new router.

HF_HUB_OFFLINE=1 python -m pytest tests/test_warm_start_reroute.py -q [-m slow]
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import TINY, dipaco
from safetensors.torch import load_file

from dipaco.config import load_config
from dipaco.model.path_model import split_into_modules
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir
from dipaco.stages.pretrain import pretrain
from dipaco.stages.route import route
from dipaco.stages.shard import shard
from routing.assignments import Assignments
from routing.router import Router
from sharding.reader import ShardReader

OVERRIDES = ["corpus.max_documents=400", "corpus.router_fraction=0.15", "warm_start.fraction=0.2",  # 4 warm-start steps
             "routing.featurizer=base-model", "routing.balance=1.2", "routing.train_top_k=2",
             "reroute.candidates=2", "routing.fit_sample=200", "run.rounds=1"]



@pytest.fixture(scope="module")
def routed(tmp_path_factory) -> RunDir:
    """`dipaco pretrain`, `route` and `shard` with OVERRIDES, through the Python API (no process start-ups)."""
    run = RunDir(tmp_path_factory.mktemp("warm"))
    config = load_config(TINY, OVERRIDES)
    for stage in (pretrain, route, shard):
        stage(config, run)
    return run


def test_base_model_features_are_the_pretrained_models_hidden_states(routed):
    from transformers import AutoModel, AutoTokenizer

    router = Router.load(routed.routing)
    assert router.featurizer.name == "base-model"
    hf = routed.root / "pretrain" / "hf"
    assert Path(router.featurizer.model_dir) == hf
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModel.from_pretrained(hf).eval()
    text = "In the beginning God created the heaven and the earth."
    ids = tok(text, truncation=True, max_length=router.config.prefix_tokens, return_tensors="pt")
    with torch.no_grad():
        ref = model(**ids).last_hidden_state[0].mean(0).numpy()
    np.testing.assert_allclose(router.features([text])[0], ref, atol=1e-4)


def test_overlap_and_router_split_reach_the_shards(routed):
    a = Assignments.load(routed.routing)
    reader = ShardReader(routed.shards)
    index = json.loads((routed.shards / "index.json").read_text())
    n_train = int((a.split == 0).sum())
    assert sum(p["train"]["documents"] for p in index["paths"]) == 2 * n_train
    _, doc_ids, _ = reader.test_documents()
    assert set(doc_ids.tolist()) <= set(np.flatnonzero(a.split == 1).tolist())
    report = json.loads((routed.routing / "report-route.json").read_text())
    assert report["purity"] is not None and (routed.routing / "report-route.png").stat().st_size > 0


def test_store_version_zero_is_the_dense_warm_start(routed):
    config = load_config(routed.config)
    factory = PathFactory(config, routed)
    start_or_resume_store(factory)
    dense = load_file(str(routed.root / "pretrain" / "model.safetensors"))
    model = factory.new_model()
    for k, p in model.named_parameters():
        p.data.copy_(dense[k])
    for path in range(factory.topology.n_paths):
        for name, tensors in split_into_modules(model, factory.topology, path=path).items():
            stored = factory.store.read_module(0, name)
            for key, value in tensors.items():
                torch.testing.assert_close(stored[key], value, rtol=0, atol=0)


def test_a_warm_start_is_continued_only_under_the_schedule_it_was_trained_with(routed, tmp_path):
    """The cosine warm start decayed; a `wsd` run would continue it as if it had not: refused, naming the file."""
    summary = json.loads((routed.root / "pretrain" / "summary.json").read_text())
    assert summary["schedule"] == {"name": "cosine", "first_step": 0, "total_steps": 4}
    config = load_config(routed.config, ["inner.schedule=wsd", f"store.url={tmp_path / 'store'}"])
    with pytest.raises(ValueError, match=r"pretrain/summary.json.*'cosine'.*inner.schedule is 'wsd'"):
        start_or_resume_store(PathFactory(config, routed))


@pytest.mark.slow
def test_reroute_phase_is_recorded_and_training_continues(routed):
    args = ["--config", str(TINY), "--run", str(routed.root), *OVERRIDES]
    dipaco("train", *args[:-1], "run.rounds=2", "run.stop_after_round=1")
    assert json.loads((routed.root / "train.json").read_text())["rounds_completed"] == 1
    before = Router.load(routed.routing).fingerprint()
    dipaco("reroute", *args)
    phases = json.loads((routed.routing / "phases.json").read_text())
    assert [p["phase"] for p in phases] == [1] and phases[0]["after_round"] == 1
    assert phases[0]["candidates_per_document"] == 2
    losses = json.loads((routed.routing / "phase-1-losses.json").read_text())
    assert len(losses["documents"]) == phases[0]["router_documents"] and losses["round"] == 1
    assert all(sum(x is not None for x in row) == 2 for row in losses["nll"] + losses["prefix_nll"])
    router = Router.load(routed.routing)
    assert router.linear is not None and router.fingerprint() != before
    assert ShardReader(routed.shards).router_fingerprint == router.fingerprint()
    assert Router.load(routed.routing / "phase-0").fingerprint() == before
    dipaco("train", *args[:-1], "run.rounds=2")
    assert json.loads((routed.root / "train.json").read_text())["rounds_completed"] == 2
    dipaco("eval", *args, "eval.baselines=false")
    assert json.loads((routed.root / "eval.json").read_text())["routing_agrees_with_shards"] == 1.0
