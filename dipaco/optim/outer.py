"""The outer step (DiLoCo / DiPaCo), one module at a time, written out plainly.

For a module m shared by the paths P(m) that reported this round:

    pseudo-gradient of path p     Δ_p = θ_m(start of round) − θ_m(end of p's inner steps)
    weights                       α_p = w_p / Z   (dipaco.optim.weighting: w_p = |D_p| shard tokens,
                                  Z = Σ_{q∈P(m)} w_q, or Z over all paths with outer.normalize: all)
    outer gradient                g = s · Σ_p α_p Δ_p,   s = √|P(m)| if rescale_by_paths else 1
                                  (|P(m)|: every path through m, however many reported)
    update                        θ_m ← NesterovSGD(θ_m, g; lr 0.7, momentum 0.9)

With lr 1 and momentum 0 (and no rescale, Z per module) this is plain averaging: θ_m ← Σ_p α_p θ_p.
Path-private modules get the same step with one contribution. The coordinator calls
`outer_update` explicitly from its round loop; nothing hides in optimizer hooks.

`outer.decay: average` (`round_outer_step`): a round with a result whose inner steps reached the inner
lr's decay (`inner.schedule: wsd`) takes plain averaging instead, and drops the momentum: the
momentum of the stable phase's rounds would otherwise keep moving the modules by several rounds'
worth of old steps while the inner lr anneals (docs/outer-step.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

import torch

from dipaco.config import InnerConfig, OuterConfig
from dipaco.optim.inner import decay_start, phase_steps

Tensors = dict[str, torch.Tensor]


def combine_pseudo_gradients(contributions: list[tuple[Tensors, float]], *, rescale_by_paths: bool) -> Tensors:
    """Weighted average of pseudo-gradients `[(Δ_p, weight_p)]`, float32, optionally scaled by √count."""
    return combine_streamed((delta for delta, _ in contributions), [weight for _, weight in contributions],
                            rescale_by_paths=rescale_by_paths)


def combine_streamed(deltas: Iterable[Tensors], weights: list[float], *, rescale_by_paths: bool,
                     total: float | None = None, paths: int | None = None) -> Tensors:
    """`combine_pseudo_gradients` with the Δ_p arriving one at a time (`deltas` may read each from the
    store when asked), so memory holds the sum and one Δ_p. The weights are known up front, so each
    Δ_p is added with the same factor weight_p / total, in the same order: the same floats. `total`
    (Z) defaults to Σ weights, a weighted average; `outer.normalize: all` passes the sum over all paths.
    `paths`: the paths through the module, which the √ rescale counts (default: the Δ_p given)."""
    if not weights:
        raise ValueError("a module's outer step needs at least one pseudo-gradient")
    if any(weight < 0 for weight in weights):
        raise ValueError(f"pseudo-gradient weights {weights} must be >= 0")
    total = sum(weights) if total is None else total
    if total <= 0:
        raise ValueError(f"pseudo-gradient weights {weights} are divided by {total}, not > 0")
    combined: Tensors = {}
    count = 0
    for delta in deltas:  # not zip / enumerate: their reused tuple would keep the last Δ_p alive during the next read
        if count == len(weights):
            raise ValueError(f"more pseudo-gradients than the {len(weights)} weights")
        if count == 0:
            combined = {name: torch.zeros_like(tensor, dtype=torch.float32) for name, tensor in delta.items()}
        elif delta.keys() != combined.keys():
            raise ValueError(f"pseudo-gradient {count} has tensors {sorted(delta)[:3]}, the first {sorted(combined)[:3]}")
        for name, acc in combined.items():
            acc.add_(delta[name].float(), alpha=weights[count] / total)
        count += 1
        del delta  # before the next one is read
    if count != len(weights):
        raise ValueError(f"{count} pseudo-gradients for {len(weights)} weights")
    scale = math.sqrt(count if paths is None else paths) if rescale_by_paths else 1.0
    for acc in combined.values():
        acc.mul_(scale)
    return combined


def outer_update(params: Tensors, momentum: Tensors | None, outer_grad: Tensors, config: OuterConfig) -> tuple[Tensors, Tensors]:
    """One Nesterov SGD step on a module; returns (new parameters, new momentum buffers)."""
    if params.keys() != outer_grad.keys():
        raise ValueError(f"outer gradient names {sorted(outer_grad)[:3]} do not match the module's {sorted(params)[:3]}")
    leaves = {name: torch.nn.Parameter(tensor.detach().float().clone()) for name, tensor in params.items()}
    use_momentum = config.momentum > 0
    optimizer = torch.optim.SGD(
        leaves.values(), lr=config.lr, momentum=config.momentum, nesterov=config.nesterov and use_momentum
    )
    for name, leaf in leaves.items():
        leaf.grad = outer_grad[name].float()
        if use_momentum and momentum is not None:
            optimizer.state[leaf]["momentum_buffer"] = momentum[name].float().clone()
    optimizer.step()
    new_momentum = {}
    if use_momentum:
        new_momentum = {name: optimizer.state[leaf]["momentum_buffer"] for name, leaf in leaves.items()}
    return {name: leaf.detach() for name, leaf in leaves.items()}, new_momentum


def averaging(config: OuterConfig) -> OuterConfig:
    """`config` made plain averaging: lr 1, momentum 0, no √ rescale, its weighting kept (θ_m ← Σ_p α_p θ_p)."""
    return replace(config, lr=1.0, momentum=0.0, nesterov=False, rescale_by_paths=False)


def round_outer_step(config: OuterConfig, *, step_ends: Iterable[int], decay_from: int | None) -> OuterConfig:
    """The outer step of a round whose results trained up to path steps `step_ends` (each task's
    step_offset + H): `config`'s, or plain averaging (`averaging`) when `outer.decay` is "average" and
    one of them reached `decay_from`, the path step where the inner lr starts to decay (None: never)."""
    if config.decay == "average" and decay_from is not None and any(end > decay_from for end in step_ends):
        return averaging(config)
    return config


def path_decay_from(inner: InnerConfig, *, rounds: int, warm_start_steps: int) -> int | None:
    """The path step (0 = a path's first inner step after the warm start) where the inner lr starts to
    decay in a run of `rounds` tasks of `inner.steps`; <= 0 when the whole path phase decays, None when
    the schedule has no separate decay (cosine)."""
    first, total = phase_steps(inner, steps=rounds * inner.steps, after=warm_start_steps)
    start = decay_start(inner, total_steps=total)
    return None if start is None else start - first
