"""DiLoCo replicas (islands sharing every module, on random shares of the data; routing answers with a
routed path's first replica) and the dense-large baseline."""

import numpy as np
import pytest
import torch

from dipaco.config import Config, ModelConfig, TopologyConfig, load_config
from dipaco.eval.dense_baselines import baseline_model_config, baseline_steps
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.model.path_model import build_path_model, count_parameters
from dipaco.model.topology import Topology
from dipaco.optim.outer import combine_pseudo_gradients, outer_update
from dipaco.pipeline.context import baseline_budgets
from dipaco.stages.route import assign_replicas
from sharding.tokenizer import encode_batch, train_tokenizer


def test_replicas_share_every_module_and_the_outer_step_averages_them():
    top = Topology.from_config(TopologyConfig(levels=[2], replicas=3, private_blocks=[1]), n_layers=2)
    assert top.n_paths == 6 and top.n_routed == 2 and top.data_levels == [2, 3]
    for path in range(6):
        assert top.modules_of_path(path) == top.modules_of_path(top.representative(top.routed_path(path)))
    assert top.paths_of_module("level0.module1") == [3, 4, 5]
    assert top.paths_of_module("path001.block01") == [3, 4, 5]
    diloco = Topology.from_config(TopologyConfig(levels=[1], replicas=4), n_layers=2)
    assert all(diloco.paths_of_module(m) == [0, 1, 2, 3] for m in diloco.modules)
    # plain averaging (lr 1, momentum 0) of the replicas' end points
    start = {"w": torch.zeros(3)}
    ends = [torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1]), torch.tensor([2.0, 2, 2])]
    grad = combine_pseudo_gradients([({"w": start["w"] - e}, 1.0) for e in ends], rescale_by_paths=False)
    new, _ = outer_update(start, None, grad, Config().outer.__class__(lr=1.0, momentum=0.0))
    torch.testing.assert_close(new["w"], torch.stack(ends).mean(0))


def test_replica_assignment_keeps_the_route_and_spreads_documents_evenly():
    routed = np.repeat(np.arange(2), 3000)
    data = assign_replicas(routed, replicas=4, seed=0)
    assert np.array_equal(data // 4, routed)
    counts = np.bincount(data, minlength=8)
    assert counts.min() > 0.8 * counts.mean()
    assert np.array_equal(assign_replicas(routed, replicas=1, seed=0), routed)


class FirstLetterRouter:
    """A stand-in router over 2 routed paths: path 1 for text starting with "B", else 0; it keeps
    the texts it was shown."""

    levels = [2]

    def __init__(self):
        self.seen: list[str] = []

    n_paths = 2

    def route(self, texts: list[str]) -> np.ndarray:
        self.seen += texts
        return np.array([int(t.startswith("B")) for t in texts], dtype=np.int64)

    def features(self, texts: list[str]) -> np.ndarray:
        return self.route(texts)[:, None]

    def assign_topk(self, features: np.ndarray, k: int) -> np.ndarray:
        return np.stack([features[:, 0], 1 - features[:, 0]], axis=1)[:, :k]


def test_prefix_router_shows_the_prefix_text_and_answers_with_the_first_replica(tmp_path):
    texts = ["Behold the fowls of the air", "And God said, Let there be light", "By the rivers of Babylon"] * 5
    tokenizer = train_tokenizer(texts, vocab_size=300, out_dir=tmp_path / "tok")
    top = Topology.from_config(TopologyConfig(levels=[2], replicas=3), n_layers=2)
    fake = FirstLetterRouter()
    router = PrefixRouter(fake, tokenizer, top, prefix_tokens=2)
    assert router.route_texts(texts[:3]).tolist() == [3, 0, 3]  # routed path q -> its first replica 3q
    docs = encode_batch(tokenizer, texts[:3])
    assert fake.seen == [tokenizer.decode(d[:2].tolist()) for d in docs]  # the text of the first 2 tokens
    assert router([docs[1], docs[2]], [1, 5]).tolist() == [0, 3]
    assert fake.seen[-2:] == [tokenizer.decode(docs[1][:1].tolist()), tokenizer.decode(docs[2][:5].tolist())]
    # likelihood:K's candidates: the router's best paths, best first, each answered with its first replica
    assert router.shortlist(docs, 2).tolist() == [[3, 0], [0, 3], [3, 0]]
    assert router.shortlist(docs, 5)[:, 0].tolist() == router(docs).tolist()
    plain = PrefixRouter(fake, tokenizer, Topology.from_config(TopologyConfig(levels=[2]), n_layers=2),
                         prefix_tokens=2)
    assert plain.route_texts(texts[:3]).tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="4"):
        PrefixRouter(fake, tokenizer, Topology.from_config(TopologyConfig(levels=[2, 2]), n_layers=2), prefix_tokens=2)


def test_dense_large_is_about_eight_times_a_path():
    config = load_config(None, ["model.hidden_size=128", "model.n_layers=4", "model.n_heads=4",
                                "topology.blocks_per_level=[2,2]", "eval.large_hidden_size=256",
                                "eval.large_n_layers=12"])
    per_path, warm = config.run.rounds * config.inner.steps, config.pretrain_steps  # the warm start counts
    assert baseline_budgets(config, 4) == {"dense-equal-steps": warm + per_path, "dense-equal-compute": warm + 4 * per_path,
                                           "dense-large": warm + per_path}
    large = baseline_model_config(config.model, config.eval, "dense-large")
    assert large.hidden_size // large.n_heads == 32
    assert baseline_model_config(config.model, config.eval, "dense-equal-steps") == config.model
    ratio = (count_parameters(build_path_model(large, vocab_size=4096, seq_len=256))
             / count_parameters(build_path_model(config.model, vocab_size=4096, seq_len=256)))
    assert 7 < ratio < 9
    assert "dense-large" not in baseline_budgets(load_config(None, []), 4)
    assert "dense-large" not in baseline_steps(steps_per_path=1, n_paths=4, large=False)
    assert isinstance(large, ModelConfig)


@pytest.mark.slow  # 12 s of make test's 2 minutes: make test-slow
def test_a_warm_started_runs_baselines_count_the_pretraining(tmp_path):
    """With a warm start of P steps the paths start from a dense model trained P steps, and every budget counts
    them: by default (`eval.baselines_init: warm-start`) a baseline continues from that very model for the
    rest of its budget; with `scratch` it trains P steps more than the grid's share from a fresh model.
    The eval table gives each model's warm start, steps and tokens in all."""
    import json
    import shutil
    from pathlib import Path

    from dipaco.run_dir import RunDir
    from dipaco.stages.baselines import train_baseline
    from dipaco.stages.evaluate import evaluate, format_results
    from dipaco.stages.pretrain import pretrain
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard
    from dipaco.stages.train import train

    tiny = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    overrides = [f"warm_start.fraction={3 / (3 + 4 * 1 * 2)!r}", "run.rounds=1", "inner.steps=2", "eval.modes=[]",
                 "hardware.device=cpu"]  # 3 warm-start steps before 4 paths x 1 round x 2 steps
    config = load_config(tiny, overrides)
    assert config.eval.baselines_init == "warm-start"
    run = RunDir(tmp_path / "run")
    for stage in (pretrain, route, shard):
        stage(config, run)
    train(config, run)

    budgets = baseline_budgets(config, 4)
    assert budgets == {"dense-equal-steps": 3 + 2, "dense-equal-compute": 3 + 4 * 2}
    warm = {name: train_baseline(config, run, name=name) for name in budgets}
    assert {name: (s["init"], s["steps"]) for name, s in warm.items()} == {
        "dense-equal-steps": ("warm-start", 2), "dense-equal-compute": ("warm-start", 8)}
    assert warm["dense-equal-compute"]["schedule"] == {"name": "cosine", "first_step": 0, "total_steps": 8}
    block = config.inner.batch_size * config.sharding.seq_len
    models = {m["model"]: m for m in evaluate(config, run, modes=[])["models"]}
    ours, steps, compute = models["DiPaCo 2x2 routed"], models["dense-equal-steps"], models["dense-equal-compute"]
    assert (ours["pretrain_steps"], ours["steps_per_path"], ours["steps_total"]) == (3, 2, 5)
    assert ours["train_tokens_total"] == 3 * block + 4 * 2 * block  # the warm start, then 4 paths x 2 steps
    assert (steps["pretrain_steps"], steps["steps_per_path"], steps["steps_total"]) == (3, 2, 5)
    assert steps["train_tokens_total"] == 5 * block
    assert (compute["pretrain_steps"], compute["steps_total"]) == (3, 11)
    assert compute["train_tokens_total"] == ours["train_tokens_total"]
    table = format_results(evaluate(config, run, modes=[]))
    assert "warm start" in table and "train tokens (all)" in table

    pretrained = json.loads((run.pretrain / "summary.json").read_text())
    assert warm["dense-equal-steps"]["pretrain_tokens"] == pretrained["tokens"] == 3 * block

    # from scratch: the whole budget in one schedule from a fresh model
    shutil.rmtree(run.baselines)
    scratch = load_config(tiny, [*overrides, "eval.baselines_init=scratch"])
    cold = train_baseline(scratch, run, name="dense-equal-steps")
    assert (cold["init"], cold["pretrain_steps"], cold["steps"]) == ("scratch", 0, 5)
    row = {m["model"]: m for m in evaluate(scratch, run, modes=[])["models"]}["dense-equal-steps"]
    assert (row["pretrain_steps"], row["steps_per_path"], row["steps_total"], row["train_tokens_total"]) == (0, 5, 5, 5 * block)

    # inner.schedule wsd: the warm start never decays and a baseline continues its schedule from step 3
    wsd = load_config(tiny, [*overrides, "inner.schedule=wsd"])
    with pytest.raises(ValueError, match="inner.schedule"):
        train_baseline(wsd, run, name="dense-equal-compute")  # this warm start was trained under cosine
    shutil.rmtree(run.pretrain)
    assert pretrain(wsd, run)["schedule"] == {"name": "wsd", "first_step": 0, "total_steps": None}
    continued = train_baseline(wsd, run, name="dense-equal-compute")
    assert continued["schedule"] == {"name": "wsd", "first_step": 3, "total_steps": 11}
    assert not continued["continued_optimizer"]
    shutil.rmtree(run.baselines)
    resumed = load_config(tiny, [*overrides, "inner.schedule=wsd", "warm_start.continue_optimizer=true"])
    assert train_baseline(resumed, run, name="dense-equal-steps")["continued_optimizer"]
    (run.pretrain / "optimizer.safetensors").unlink()
    with pytest.raises(ValueError, match="optimizer.safetensors is missing"):
        train_baseline(resumed, run, name="dense-equal-compute")

    # a warm start that is gone: a clear error, not a silent baseline from scratch
    (run.pretrain / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="baselines_init"):
        train_baseline(config, run, name="dense-equal-steps")


def test_the_diloco_config_has_diloco_s_outer_step():
    """configs/diloco.yaml: 4 replicas of one path sharing every module, Nesterov 0.7 / 0.9, no √ rescale."""
    from pathlib import Path

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "diloco.yaml", [])
    assert config.topology.levels == [1] and config.topology.replicas == 4
    outer = config.outer
    assert (outer.lr, outer.momentum, outer.nesterov, outer.rescale_by_paths) == (0.7, 0.9, True, False)


def _schedule(monkeypatch, tmp_path, *, fail: bool):
    """`train_baselines` with an `alongside` stage, its processes replaced by recorders."""
    from pathlib import Path

    from dipaco.run_dir import RunDir
    from dipaco.stages import baselines as stage

    events: list[tuple] = []

    class Pool:
        def __init__(self, tasks, *, threads):
            events.append(("start alongside", [t.name for t in tasks], threads))

        def wait(self):
            events.append(("wait",))

        def terminate(self):
            events.append(("terminate",))

    def alongside():
        events.append(("islands",))
        if fail:
            raise KeyboardInterrupt("stopped")

    monkeypatch.setattr(stage, "check", lambda *a, **k: None)
    monkeypatch.setattr(stage, "available_cores", lambda: 2)
    monkeypatch.setattr(stage, "plan_parallelism", lambda n, processes=0, threads=0: (processes or min(n, 2), threads or 1))
    monkeypatch.setattr(stage, "WorkerPool", Pool)
    monkeypatch.setattr(stage, "run_tasks", lambda tasks, *, processes, threads, desc:
                        events.append(("after", [t.name for t in tasks], processes)))
    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml", ["hardware.islands=2"])
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    if fail:
        with pytest.raises(KeyboardInterrupt):
            stage.train_baselines(config, run, alongside=alongside)
    else:
        stage.train_baselines(config, run, alongside=alongside)
    return events


def test_the_longest_baseline_trains_alongside_the_islands_and_the_others_after(monkeypatch, tmp_path):
    """`dipaco run` (eval.baselines_with_train): dense-equal-compute, the longest job, starts with the islands
    (one thread: 2 cores, 2 islands + it); dense-equal-steps starts when they are done, on the core they free."""
    assert _schedule(monkeypatch, tmp_path, fail=False) == [
        ("start alongside", ["baseline dense-equal-compute"], 1), ("islands",),
        ("after", ["baseline dense-equal-steps"], 1), ("wait",)]


def test_a_failed_train_stage_stops_the_baseline_it_ran_with(monkeypatch, tmp_path):
    assert _schedule(monkeypatch, tmp_path, fail=True) == [
        ("start alongside", ["baseline dense-equal-compute"], 1), ("islands",), ("terminate",)]
