"""A path model splits into modules and is rebuilt from them exactly."""

import pytest
import torch

from dipaco.config import ModelConfig, TopologyConfig
from dipaco.model.path_model import (
    build_path_model,
    count_parameters,
    load_modules,
    path_parameters,
    split_into_modules,
)
from dipaco.model.topology import Topology

CFG = ModelConfig(hidden_size=16, n_layers=2, n_heads=2)


def test_split_then_load_round_trip():
    top = Topology.from_config(TopologyConfig(levels=[2, 2], private_embeddings=False), n_layers=2)
    source = build_path_model(CFG, vocab_size=40, seq_len=16, seed=1)
    target = build_path_model(CFG, vocab_size=40, seq_len=16, seed=2)
    load_modules(target, split_into_modules(source, top, path=3))
    for name, param in path_parameters(target).items():
        torch.testing.assert_close(param, path_parameters(source)[name], rtol=0, atol=0)
    ids = torch.randint(0, 40, (2, 8))
    torch.testing.assert_close(target(input_ids=ids).logits, source(input_ids=ids).logits)


def test_seeded_builds_are_identical_and_tied_head_counts_once():
    a = build_path_model(CFG, vocab_size=40, seq_len=16, seed=0)
    b = build_path_model(CFG, vocab_size=40, seq_len=16, seed=0)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert "lm_head.weight" not in path_parameters(a)
    assert count_parameters(a) == sum(p.numel() for p in a.parameters())


def test_missing_or_misshapen_module_is_an_error():
    top = Topology.from_config(TopologyConfig(levels=[2], private_embeddings=False), n_layers=2)
    model = build_path_model(CFG, vocab_size=40, seq_len=16)
    modules = split_into_modules(model, top, path=0)
    with pytest.raises(ValueError, match="missing"):
        load_modules(model, {k: v for k, v in modules.items() if k != "embeddings"})
    bad = {k: dict(v) for k, v in modules.items()}
    bad["embeddings"]["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        load_modules(model, bad)
