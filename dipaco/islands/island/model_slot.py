"""The path model an island trains, built once on the device and reused by every task: each task copies
its modules straight into the parameters (with the DDP wrapper under torchrun, and compiled once per
island when `hardware.compile` is set).

    slot = ModelSlot()
    model, trained = slot.load(modules, spec=spec, device=device, compile=False)
    # model: the LlamaForCausalLM (parameter names, validation); trained: what the inner loop calls
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LlamaForCausalLM

from dipaco.model.path_model import PathSpec, load_modules


class ModelSlot:
    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: LlamaForCausalLM | None = None
        self._trained: torch.nn.Module | None = None

    def load(self, modules: dict[str, dict[str, torch.Tensor]], *, spec: PathSpec, device: torch.device,
             compile: bool, wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
             ) -> tuple[LlamaForCausalLM, torch.nn.Module]:
        """The slot's model holding exactly `modules` on `device`, and the module to train (wrapped by
        `wrap`, e.g. DDP, then compiled when `compile`); built again only when the shape, device or
        wrapping changes."""
        key = (spec, device, compile, wrap is not None)
        if key != self._key or self._model is None:
            self._model = self._trained = None  # free the old model before building the new one
            model = spec.new_model().to(device)
            trained = wrap(model) if wrap is not None else model
            self._model, self._trained, self._key = model, torch.compile(trained) if compile else trained, key
        load_modules(self._model, modules)
        return self._model, self._trained

    def release_gradients(self) -> None:
        """Drop the last step's gradients, so an idle island holds only the parameters."""
        if self._model is not None:
            for param in self._model.parameters():
                param.grad = None
