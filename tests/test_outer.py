"""The outer step against references: plain averaging, and Nesterov momentum written out by hand."""

import math

import pytest
import torch

from dipaco.config import OuterConfig
from dipaco.optim.outer import combine_pseudo_gradients, combine_streamed, outer_update


def test_lr1_momentum0_is_shard_weighted_averaging():
    """DiLoCo reference: with lr 1 and momentum 0 the module becomes the weighted mean of the islands."""
    torch.manual_seed(0)
    start = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    islands = [{k: v + torch.randn_like(v) for k, v in start.items()} for _ in range(3)]
    shard_tokens = [9001 * 256.0, 4627 * 256.0, 3100 * 256.0]  # training shards as routing leaves them
    deltas = [{k: start[k] - island[k] for k in start} for island in islands]
    grad = combine_pseudo_gradients(list(zip(deltas, shard_tokens)), rescale_by_paths=False)
    new, momentum = outer_update(start, None, grad, OuterConfig(lr=1.0, momentum=0.0))
    for k in start:
        expected = sum(t * island[k] for t, island in zip(shard_tokens, islands)) / sum(shard_tokens)
        torch.testing.assert_close(new[k], expected)
    assert momentum == {}


def test_a_total_over_all_paths_scales_the_average_down():
    """`outer.normalize: all`: the weights are divided by a total over all paths, not their own sum."""
    deltas = [{"w": torch.full((2,), 1.0)}, {"w": torch.full((2,), 3.0)}]
    combined = combine_streamed(iter(deltas), [1.0, 1.0], total=4.0, rescale_by_paths=True)["w"]
    torch.testing.assert_close(combined, torch.full((2,), (1.0 + 3.0) / 4.0 * math.sqrt(2)))


def test_rescale_multiplies_by_sqrt_of_contributors():
    deltas = [({"w": torch.ones(2)}, 1.0) for _ in range(4)]
    plain = combine_pseudo_gradients(deltas, rescale_by_paths=False)["w"]
    scaled = combine_pseudo_gradients(deltas, rescale_by_paths=True)["w"]
    torch.testing.assert_close(scaled, plain * math.sqrt(4))


def test_nesterov_matches_the_formula_over_two_steps():
    lr, mu = 0.7, 0.9
    theta = {"w": torch.tensor([1.0, -2.0])}
    g1, g2 = torch.tensor([0.5, 0.1]), torch.tensor([-0.2, 0.3])
    cfg = OuterConfig(lr=lr, momentum=mu)
    p1, m1 = outer_update(theta, None, {"w": g1}, cfg)
    p2, m2 = outer_update(p1, m1, {"w": g2}, cfg)
    buf1 = g1
    expected1 = theta["w"] - lr * (g1 + mu * buf1)
    buf2 = mu * buf1 + g2
    expected2 = expected1 - lr * (g2 + mu * buf2)
    torch.testing.assert_close(p1["w"], expected1)
    torch.testing.assert_close(p2["w"], expected2)
    torch.testing.assert_close(m2["w"], buf2)


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least one"):
        combine_pseudo_gradients([], rescale_by_paths=False)
    with pytest.raises(ValueError, match="divided by 0.0, not > 0"):
        combine_pseudo_gradients([({"w": torch.ones(1)}, 0.0)], rescale_by_paths=False)
    with pytest.raises(ValueError, match="must be >= 0"):
        combine_streamed(iter([{"w": torch.ones(1)}]), [-1.0], total=1.0, rescale_by_paths=False)
