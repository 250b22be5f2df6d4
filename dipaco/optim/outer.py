"""The outer step (DiLoCo / DiPaCo), one module at a time, written out plainly.

For a module m shared by the paths P(m) that reported this round:

    pseudo-gradient of path p     Δ_p = θ_m(start of round) − θ_m(end of p's inner steps)
    weights                       α_p = tokens_p / Σ_{q∈P(m)} tokens_q      (or 1/|P(m)|)
    outer gradient                g = s · Σ_p α_p Δ_p,   s = √|P(m)| if rescale_by_paths else 1
    update                        θ_m ← NesterovSGD(θ_m, g; lr 0.7, momentum 0.9)

With lr 1 and momentum 0 (and no rescale) this is plain averaging: θ_m ← Σ_p α_p θ_p.
Path-private modules get the same step with one contribution. The coordinator calls
`outer_update` explicitly from its round loop; nothing hides in optimizer hooks.
"""

from __future__ import annotations

import math

import torch

from dipaco.config import OuterConfig

Tensors = dict[str, torch.Tensor]


def combine_pseudo_gradients(contributions: list[tuple[Tensors, float]], *, rescale_by_paths: bool) -> Tensors:
    """Weighted average of pseudo-gradients `[(Δ_p, weight_p)]`, float32, optionally scaled by √count."""
    if not contributions:
        raise ValueError("a module's outer step needs at least one pseudo-gradient")
    total = sum(weight for _, weight in contributions)
    if total <= 0:
        raise ValueError(f"pseudo-gradient weights {[w for _, w in contributions]} sum to {total}, not > 0")
    scale = math.sqrt(len(contributions)) if rescale_by_paths else 1.0
    names = contributions[0][0].keys()
    combined: Tensors = {}
    for name in names:
        acc = torch.zeros_like(contributions[0][0][name], dtype=torch.float32)
        for delta, weight in contributions:
            acc.add_(delta[name].float(), alpha=weight / total)
        combined[name] = acc.mul_(scale)
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
