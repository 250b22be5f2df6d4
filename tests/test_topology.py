"""The module grid: path ids, module names, and which paths share which module."""

import numpy as np
import pytest

from dipaco.config import ModelConfig, TopologyConfig
from dipaco.model.path_model import build_path_model, path_parameters
from dipaco.model.topology import EMBEDDINGS, Topology


def make(levels, n_layers=4, **kw):
    return Topology.from_config(TopologyConfig(levels=levels, **{"private_embeddings": False, **kw}), n_layers=n_layers)


def test_path_ids_follow_ravel_multi_index():
    top = make([2, 3])
    assert top.n_paths == 6
    for path in range(6):
        assert np.ravel_multi_index(top.choice(path), (2, 3)) == path


def test_shared_modules_are_shared_by_the_right_paths():
    top = make([2, 2])
    assert top.paths_of_module(EMBEDDINGS) == [0, 1, 2, 3]
    assert top.paths_of_module("level0.module1") == [2, 3]
    assert top.paths_of_module("level1.module1") == [1, 3]
    assert len(top.modules) == 1 + 2 + 2


def test_private_blocks_and_embeddings_belong_to_one_path():
    top = make([2, 2], private_blocks=[0, 3], private_embeddings=True)
    assert top.paths_of_module("path002.block00") == [2]
    assert top.paths_of_module("path001.embeddings") == [1]
    assert top.module_of_param("model.layers.3.mlp.up_proj.weight", 1) == "path001.block03"
    assert top.module_of_param("model.layers.1.mlp.up_proj.weight", 2) == "level0.module1"


def test_a_level_made_only_of_private_blocks_has_no_shared_module():
    top = make([2, 2], blocks_per_level=[1, 3], private_blocks=[0])
    assert not any(m.startswith("level0.") for m in top.modules)


def test_every_parameter_of_a_path_model_is_in_exactly_one_of_its_modules():
    top = make([2, 2], private_blocks=[1])
    model = build_path_model(ModelConfig(hidden_size=16, n_layers=4, n_heads=2), vocab_size=50, seq_len=16)
    for path in range(top.n_paths):
        modules = {top.module_of_param(name, path) for name in path_parameters(model)}
        assert modules == set(top.modules_of_path(path))


def test_bad_inputs_name_the_value():
    top = make([2, 2])
    with pytest.raises(ValueError, match="path 4"):
        top.choice(4)
    with pytest.raises(ValueError, match="sum to 3"):
        make([2, 2], blocks_per_level=[1, 2])
