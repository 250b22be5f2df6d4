"""DiLoCo replicas (islands sharing every module, on random shares of the data) and the dense-large baseline."""

import numpy as np
import torch

from dipaco.config import Config, ModelConfig, TopologyConfig, load_config
from dipaco.model.path_model import build_path_model, count_parameters
from dipaco.model.topology import Topology
from dipaco.optim.outer import combine_pseudo_gradients, outer_update
from dipaco.stages.baselines import baseline_model_config, baseline_steps
from dipaco.stages.route import assign_replicas


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


def test_dense_large_is_about_eight_times_a_path():
    config = load_config(None, ["model.hidden_size=128", "model.n_layers=4", "model.n_heads=4",
                                "topology.blocks_per_level=[2,2]", "eval.large_hidden_size=256",
                                "eval.large_n_layers=12"])
    assert baseline_steps(config, 4)["dense-large"] == config.train.rounds * config.inner.steps
    large = baseline_model_config(config, "dense-large")
    assert large.hidden_size // large.n_heads == 32 and baseline_model_config(config, "dense-equal-steps") == config.model
    ratio = (count_parameters(build_path_model(large, vocab_size=4096, seq_len=256))
             / count_parameters(build_path_model(config.model, vocab_size=4096, seq_len=256)))
    assert 7 < ratio < 9
    assert "dense-large" not in baseline_steps(load_config(None, []), 4)
    assert isinstance(large, ModelConfig)
