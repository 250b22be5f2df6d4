"""The inner loop: AdamW steps on one path model, shared by islands and dense training (`dipaco.optim.dense`);
with `inner.optimizer: muon`, Muon on the blocks' matrices and AdamW on the rest (`dipaco.optim.muon`).

The learning rate follows `inner.schedule` over the whole run (every round's inner steps count), so an
island that trains round t of R uses `start_step = (t - 1) * H`:

- `cosine`: linear warmup, then cosine decay to lr x min_lr_ratio. Each phase has its own schedule: the
  dense warm start one over its steps, and the paths (or a baseline) that continue it another, warmup
  included.
- `wsd` (warmup-stable-decay, as in MiniCPM and Hägele et al. 2024, "Scaling Laws and Compute-Optimal
  Training Beyond Fixed Training Durations"): linear warmup, a constant lr, then a linear decay over the
  last `decay_fraction` of the model's whole run. A warm start is the constant part of every schedule
  that continues it (it never decays), and a phase continuing it counts its steps on from there
  (`phase_steps`): no second warmup, one decay at the end of each model's own budget.

The optimizer's state
can be saved to and restored from `{name: tensor}` dicts, so a path's inner state travels through the
store between rounds (DiLoCo keeps inner states local and unsynchronised).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dipaco.config import InnerConfig
from dipaco.device import autocast
from dipaco.optim.muon import MuonAdamW, is_block_matrix, parts_of

log = logging.getLogger(__name__)


def lr_at(step: int, *, config: InnerConfig, total_steps: int | None) -> float:
    """Learning rate at global inner step `step` (0-based) of a run of `total_steps`; None = a run
    without an end (`wsd` only: a warm start, which stays at the peak after its warmup)."""
    if total_steps is None and config.schedule != "wsd":
        raise ValueError(f"the {config.schedule} schedule needs the run's length (total_steps)")
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    floor = config.lr * config.min_lr_ratio
    if config.schedule == "wsd":
        start = decay_start(config, total_steps=total_steps)
        if start is None or step < start:
            return config.lr
        window = total_steps - start
        return config.lr + (floor - config.lr) * min(1.0, (step - start + 1) / window)  # the last step at the floor
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def decay_start(config: InnerConfig, *, total_steps: int | None) -> int | None:
    """`wsd`: the first step (in `lr_at`'s numbering) of the decay over the last `decay_fraction` of a
    run of `total_steps`; None for a run without an end or another schedule (cosine decays throughout)."""
    if config.schedule != "wsd" or total_steps is None:
        return None
    return total_steps - max(1, round(config.decay_fraction * total_steps))


def phase_steps(config: InnerConfig, *, steps: int, after: int = 0) -> tuple[int, int]:
    """(first step, total steps) in `lr_at`'s numbering for a phase of `steps` steps that continues
    `after` steps of earlier training (a dense warm start; 0 = none): `cosine` starts its own schedule
    (0, steps), `wsd` counts on from the warm start (after, after + steps)."""
    if config.schedule == "wsd":
        return after, after + steps
    return 0, steps


def warm_start_total(config: InnerConfig, steps: int) -> int | None:
    """The `total_steps` the dense warm start of `steps` steps trains with: its own length under
    `cosine`, none under `wsd` (it is the constant part of the schedules that continue it)."""
    return None if config.schedule == "wsd" else steps


def make_optimizer(model: torch.nn.Module, config: InnerConfig, *, fused: bool = False) -> torch.optim.Optimizer | MuonAdamW:
    """AdamW with weight decay on matrices only (not norms or biases); `fused` picks torch's fused
    kernel (`inner.fused`: one kernel over all parameters; it rounds differently from the default).
    `inner.optimizer: muon`: Muon on the transformer blocks' matrices, this AdamW on the rest (`dipaco.optim.muon`)."""
    named = list(model.named_parameters())
    matrices = [p for name, p in named if config.optimizer == "muon" and is_block_matrix(name, p)]
    chosen = {id(p) for p in matrices}
    rest = [p for _, p in named if id(p) not in chosen]
    decay = [p for p in rest if p.dim() >= 2]
    no_decay = [p for p in rest if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=1e-8,
                              fused=True if fused else None)
    if not matrices:
        return adamw
    muon = torch.optim.Muon(matrices, lr=config.lr, weight_decay=config.weight_decay, adjust_lr_fn="match_rms_adamw")
    return MuonAdamW(muon=muon, adamw=adamw)


CHECK_EVERY = 25  # steps between checks that the losses are finite (each check waits for the device)


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[np.ndarray | torch.Tensor],
    *,
    start_step: int,
    steps: int,
    total_steps: int,
    config: InnerConfig,
    device: torch.device,
    precision: str,
    after_step: Callable[[int, torch.Tensor, float, int], None] | None = None,
) -> dict:
    """Run `steps` AdamW steps on batches of token blocks `(B, T)`; returns losses and tokens seen.

    Batches are arrays, or int64 tensors already on `device` (`dipaco.optim.prefetch`). The losses
    stay on the device and are checked every `CHECK_EVERY` steps and at the end, so the host waits for
    the device once per check, not once per step; a non-finite loss raises FloatingPointError naming
    its step (the steps after it, up to the check, ran on a model that is then thrown away).
    `after_step(steps done, their losses on the device, seconds so far, tokens so far)` runs after each step
    (an island's inner checkpoints and injected slowdown). When `batches` ends early the steps stop there
    (a task cut short); "steps" says how many ran."""
    model.train()
    losses = torch.zeros(steps, device=device)  # (steps,) float32
    values: list[float] = []  # the losses checked so far
    tokens = 0
    started = time.perf_counter()
    done = 0
    for i in range(steps):
        batch = next(batches, None)
        if batch is None:
            break
        lr = lr_at(start_step + i, config=config, total_steps=total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids = torch.as_tensor(batch, dtype=torch.long, device=device)  # (B, T)
        with autocast(device, precision):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # here, not before backward: no gradients live through the next forward
        losses[i] = loss.detach()
        tokens += input_ids.numel()
        done = i + 1
        if done - len(values) == CHECK_EVERY or done == steps:
            values += _finite(losses[len(values) : done].tolist(), first_step=start_step + len(values), lr=config.lr)
        if after_step is not None:
            after_step(done, losses[:done], time.perf_counter() - started, tokens)
    if len(values) < done:  # ended early
        values += _finite(losses[len(values) : done].tolist(), first_step=start_step + len(values), lr=config.lr)
    return {"losses": values, "tokens": tokens, "seconds": time.perf_counter() - started, "steps": done}


def _finite(losses: list[float], *, first_step: int, lr: float) -> list[float]:
    """`losses` (of steps `first_step`, `first_step + 1`, ...); FloatingPointError at the first non-finite one."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            raise FloatingPointError(f"inner step {first_step + i}: loss is {loss}; lower inner.lr ({lr})")
    return losses


def optimizer_state(optimizer: torch.optim.Optimizer | MuonAdamW, names: dict[torch.nn.Parameter, str]) -> tuple[dict, dict]:
    """AdamW moments as `{f"{param}.exp_avg": tensor, ...}` (Muon's as `{f"{param}.momentum_buffer": tensor}`)
    plus `{"step": {param: int}}` metadata (AdamW's step counts; Muon keeps none)."""
    tensors, steps = {}, {}
    for part in parts_of(optimizer):
        for param, state in part.state.items():
            name = names[param]
            for key, value in state.items():
                if key == "step":
                    steps[name] = int(value)
                else:
                    tensors[f"{name}.{key}"] = value.detach().cpu()
    return tensors, {"step": steps}


def load_optimizer_state(optimizer: torch.optim.Optimizer | MuonAdamW, params: dict[str, torch.nn.Parameter],
                         tensors: dict[str, torch.Tensor], meta: dict, *, strict: bool = False) -> None:
    """Restore what `optimizer_state` saved (parameters missing from it start fresh; with `strict`, every
    parameter must be in it with its shape: a ValueError names the first that is not)."""
    for part in parts_of(optimizer):
        owned = {id(p) for group in part.param_groups for p in group["params"]}
        mine = {name: param for name, param in params.items() if id(param) in owned}
        if isinstance(part, torch.optim.AdamW):
            _load_adamw(part, mine, tensors, meta, strict=strict)
        else:
            _load_muon(part, mine, tensors, strict=strict)


def _load_adamw(optimizer: torch.optim.AdamW, params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor],
                meta: dict, *, strict: bool) -> None:
    fused = bool(optimizer.defaults.get("fused"))  # the fused kernel keeps its step counts on the device
    if strict:
        for name, param in params.items():
            saved = tensors.get(f"{name}.exp_avg")
            if name not in meta.get("step", {}) or saved is None or saved.shape != param.shape:
                raise ValueError(f"the AdamW state has no moments of shape {tuple(param.shape)} for {name} "
                                 f"(another model or vocabulary setting?)")
    for name, param in params.items():
        if name not in meta["step"]:
            continue
        optimizer.state[param] = {
            "step": torch.tensor(float(meta["step"][name]), device=param.device if fused else None),
            "exp_avg": tensors[f"{name}.exp_avg"].to(param.device),
            "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(param.device),
        }


def _load_muon(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
               tensors: dict[str, torch.Tensor], *, strict: bool) -> None:
    for name, param in params.items():
        saved = tensors.get(f"{name}.momentum_buffer")
        if saved is not None and saved.shape != param.shape:
            raise ValueError(f"the Muon state's momentum for {name} has shape {tuple(saved.shape)}, the "
                             f"parameter's is {tuple(param.shape)}")
        if saved is None:
            if strict:
                raise ValueError(f"the inner state has no Muon momentum for {name} (saved by AdamW, or another model?)")
            continue
        optimizer.state[param] = {"momentum_buffer": saved.to(param.device)}
