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


def test_round_outer_step_averages_only_rounds_that_reach_the_decay():
    from dipaco.optim.outer import averaging, round_outer_step

    nesterov = OuterConfig(lr=0.7, momentum=0.9, rescale_by_paths=True, decay="average")
    plain = averaging(nesterov)
    assert (plain.lr, plain.momentum, plain.nesterov, plain.rescale_by_paths) == (1.0, 0.0, False, False)
    assert plain.weighting == nesterov.weighting and plain.normalize == nesterov.normalize
    assert round_outer_step(nesterov, step_ends=[10, 20], decay_from=20) is nesterov  # last step 19 < 20
    assert round_outer_step(nesterov, step_ends=[10, 21], decay_from=20) == plain  # one result reached it
    assert round_outer_step(nesterov, step_ends=[10], decay_from=0) == plain  # the whole path phase decays
    assert round_outer_step(nesterov, step_ends=[10], decay_from=None) is nesterov  # cosine: no decay phase
    keep = OuterConfig(lr=0.7, momentum=0.9, decay="keep")
    assert round_outer_step(keep, step_ends=[10_000], decay_from=0) is keep


def test_path_decay_from_counts_from_the_paths_first_step():
    from dipaco.config import InnerConfig
    from dipaco.optim.inner import lr_at
    from dipaco.optim.outer import path_decay_from

    wsd = InnerConfig(steps=10, schedule="wsd", decay_fraction=0.2, warmup_steps=20, lr=1e-3)
    # 200 warm-start steps + 15 rounds x 10 = 350; the last 70 decay, from step 280 = path step 80
    assert path_decay_from(wsd, rounds=15, warm_start_steps=200) == 80
    assert lr_at(200 + 79, config=wsd, total_steps=350) == wsd.lr > lr_at(200 + 80, config=wsd, total_steps=350)
    assert path_decay_from(wsd, rounds=10, warm_start_steps=400) == 0  # the demo: every path step decays
    assert path_decay_from(wsd, rounds=10, warm_start_steps=0) == 80
    assert path_decay_from(InnerConfig(steps=10, schedule="cosine"), rounds=10, warm_start_steps=0) is None
