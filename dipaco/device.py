"""Where and in what precision a model runs: `train.device` / `eval.device` and `*.precision`.

    from dipaco.device import resolve_device, autocast
    device = resolve_device("auto")          # CUDA when present, else the CPU
    with autocast(device, "bf16"): loss = model(...).loss
"""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU; `cuda` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
