"""Dense training: one path-shaped model trained by plain AdamW, for the warm start and the baselines.

    model, summary = train_dense(spec, batches, steps=200, inner=cfg.inner, seed=0, device=device,
                                 precision="fp32", out=run.pretrain)      # out/model.safetensors + summary.json
    model, summary = train_dense(spec, batches, steps=600, ..., init=run.pretrain / "model.safetensors",
                                 out=run.baselines / "dense-equal-compute")  # continues a trained model
    model, summary = load_dense(run.baselines / "dense-equal-steps", spec)

`dipaco pretrain` (the dense warm start) and `dipaco baselines` (the dense baselines) both train
this way: a freshly seeded model (or, with `init`, the parameters of one written before: a baseline
continuing from the warm start), the inner recipe (`dipaco.optim.inner`) with its warmup + cosine
schedule stretched over `steps`, then the parameters and a summary (steps, tokens, seconds,
parameters, the architecture, the losses, the commit of the code: `dipaco.code_version`) written next to each other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import LlamaForCausalLM

from dipaco.atomic import replacing, write_json
from dipaco.code_version import code_version
from dipaco.config import InnerConfig, ModelConfig
from dipaco.model.path_model import (
    PathSpec,
    count_parameters,
    load_parameters,
    path_parameters,
    save_parameters,
)
from dipaco.optim.inner import load_optimizer_state, make_optimizer, optimizer_state, train_steps
from dipaco.optim.prefetch import Prefetcher

log = logging.getLogger(__name__)

OPTIMIZER = "optimizer.safetensors"  # the AdamW state at the end (`{param}.exp_avg`, `{param}.exp_avg_sq`; step counts in the header)
PARAMETERS = "model.safetensors"
PROGRESS_EVERY = 25  # steps between progress-bar updates (each waits for the device once)
SUMMARY = "summary.json"


def train_dense(spec: PathSpec, batches: Iterator[np.ndarray], *, steps: int, inner: InnerConfig, seed: int,
                device: torch.device, precision: str, out: Path, info: dict | None = None,
                init: Path | None = None, schedule: tuple[int, int | None] | None = None,
                init_optimizer: Path | None = None, save_optimizer: bool = False) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh model of shape `spec` (seeded by `seed`; its parameters read from the safetensors file
    `init` when given) for `steps` AdamW steps on `batches` of token blocks `(B, T)`, with a fresh AdamW and
    the schedule spanning those steps, or `schedule` = (first step, total steps) of `dipaco.optim.inner.lr_at`
    (`phase_steps`: a baseline continuing the warm start under `inner.schedule: wsd`). `init_optimizer`: an
    `OPTIMIZER` file of an earlier `save_optimizer` run whose AdamW state the run continues. Writes
    `out/model.safetensors` and `out/summary.json` (`info` first, then the training record: `seconds` of
    wall time, `cpu_seconds` of this process, the schedule); returns the model (CPU) and the summary."""
    if steps < 1:
        raise ValueError(f"dense training needs steps >= 1, got {steps}")
    model = spec.new_model(seed=seed)
    if init is not None:
        load_parameters(model, Path(init))
        log.info("dense training continues from %s", init)
    model = model.to(device)
    optimizer = make_optimizer(model, inner)
    if init_optimizer is not None:
        load_optimizer_state(optimizer, path_parameters(model), *read_optimizer(Path(init_optimizer)), strict=True)
        log.info("dense training continues the AdamW state of %s", init_optimizer)
    log.info("training a dense model (%d parameters) for %d steps into %s", count_parameters(model), steps, out)
    started, cpu_started = time.perf_counter(), time.process_time()
    losses: list[float] = []
    tokens = 0
    first, total = schedule if schedule is not None else (0, steps)
    chunk = min(PROGRESS_EVERY, steps)  # the same steps, schedule and batches as one call: progress between chunks
    with Prefetcher(batches, count=steps, device=device) as ahead, \
            tqdm(total=steps, desc=f"dense {Path(out).name}", unit="step", mininterval=5) as bar:
        for start in range(0, steps, chunk):
            stats = train_steps(model, optimizer, ahead, start_step=first + start, steps=min(chunk, steps - start),
                                total_steps=total, config=inner, device=device, precision=precision)
            losses += stats["losses"]
            tokens += stats["tokens"]
            bar.update(len(stats["losses"]))
            bar.set_postfix(loss=f"{np.mean(stats['losses']):.3f}")
    stats = {"losses": losses, "tokens": tokens}
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    if save_optimizer:
        write_optimizer(Path(out) / OPTIMIZER, *optimizer_state(optimizer, {p: n for n, p in path_parameters(model).items()}))
    model = model.cpu()
    save_parameters(model, Path(out) / PARAMETERS)
    summary = {**(info or {}), "steps": steps, "schedule": {"name": inner.schedule, "first_step": first, "total_steps": total},
               "continued_optimizer": init_optimizer is not None,
               "tokens": stats["tokens"], "seconds": seconds,
               "cpu_seconds": cpu_seconds, "parameters": count_parameters(model), "model": dataclasses.asdict(spec.model),
               "final_train_loss": float(np.mean(stats["losses"][-10:])), "code": code_version(),
               "losses": stats["losses"]}
    write_json(Path(out) / SUMMARY, summary)
    return model, summary


def write_optimizer(file: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """An AdamW state of `dipaco.optim.inner.optimizer_state` as one local safetensors file, its metadata in
    the header: the format of the store's inner states (`ModuleStore.write_tensors_with_meta`, which writes
    through fsspec to a store URL; this is a run folder's file), written atomically."""
    with replacing(file) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"meta": json.dumps(meta)})


def read_optimizer(file: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """What `write_optimizer` wrote; an error naming the file when it is not such a file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, KeyError, ValueError, SafetensorError) as err:
        raise ValueError(f"{file} is not an AdamW state written by dipaco: {err}") from None
    return tensors, meta


def is_trained(folder: Path) -> bool:
    """Whether `train_dense` finished writing into `folder` (the summary is written last)."""
    return (Path(folder) / SUMMARY).exists()


def load_dense(folder: Path, spec: PathSpec) -> tuple[LlamaForCausalLM, dict]:
    """A model written by `train_dense` (CPU, float32) and its summary. The architecture is the one
    the summary records (`spec.model` when it records none); the vocabulary and length are `spec`'s."""
    folder = Path(folder)
    summary = json.loads((folder / SUMMARY).read_text())
    model_config = ModelConfig(**summary["model"]) if "model" in summary else spec.model
    model = dataclasses.replace(spec, model=model_config).new_model()
    load_parameters(model, folder / PARAMETERS)
    return model, summary
