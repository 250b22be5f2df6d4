"""Muon inside (`inner.optimizer: muon`, MuLoCo arXiv 2505.23725): Muon on the 2-D weight matrices of the
transformer blocks, AdamW on the rest (embeddings, norms, the head, biases), stepped as one optimizer.

    optimizer = MuonAdamW(muon=torch.optim.Muon(matrices, ...), adamw=torch.optim.AdamW(rest, ...))
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
    for group in optimizer.param_groups: group["lr"] = lr      # one schedule for both

Muon (`torch.optim.Muon`, torch 2.9 and later) orthogonalises each matrix's Nesterov momentum with five
Newton–Schulz steps; with `adjust_lr_fn="match_rms_adamw"` its update has AdamW's RMS, so the inner lr,
its schedule and its weight decay apply to both halves unchanged. Its state is one momentum buffer per
matrix (`dipaco.optim.inner.optimizer_state` saves it as `{param}.momentum_buffer`, beside AdamW's moments).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def is_block_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """Whether Muon trains `param`: a 2-D weight of a transformer block (`model.layers.<i>....weight`)."""
    return param.dim() == 2 and ".layers." in name


class MuonAdamW:
    """Two torch optimizers over disjoint parameters, stepped together; what the inner loop and the state
    I/O use of an optimizer (`param_groups`, `step`, `zero_grad`, `parts`)."""

    def __init__(self, *, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def parts(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.muon, self.adamw

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def defaults(self) -> dict:
        return self.adamw.defaults

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)


def parts_of(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer` (itself, or a `MuonAdamW`'s two)."""
    yield from getattr(optimizer, "parts", (optimizer,))
