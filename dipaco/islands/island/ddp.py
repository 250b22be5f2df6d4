"""Data parallelism inside one island: several processes (or GPUs) train one path with DDP.

    torchrun --nproc-per-node 2 -m dipaco -- island --config configs/tiny.yaml --run runs/tiny

Under `torchrun` (WORLD_SIZE > 1) every rank joins a process group (NCCL when the island trains on
CUDA, gloo on the CPU), rank 0 alone talks to the task board (heartbeats, results, inner state) and
broadcasts each task to the other ranks, and every inner batch of `inner.batch_size` sequences is
split across the ranks (rank r takes rows r, r + world, ...), so the island computes the same
pseudo-gradient as one process over the same data, up to float rounding. Each rank uses GPU
LOCAL_RANK when on CUDA. (The `--` stops torchrun's own option parser from reading `--run` as an
abbreviation of its `--run-path`.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class DDPContext:
    rank: int
    world: int
    control: object  # a gloo group for broadcasting tasks (works with any backend)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def init_from_env(device: torch.device) -> DDPContext | None:
    """Join the torchrun process group when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return DDPContext(rank=dist.get_rank(), world=dist.get_world_size(), control=control)


def local_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return device


def shard_batches(batches: Iterator[np.ndarray], ctx: DDPContext, *, batch_size: int) -> Iterator[np.ndarray]:
    if batch_size % ctx.world:
        raise ValueError(f"inner.batch_size {batch_size} does not split over {ctx.world} data-parallel ranks")
    for batch in batches:
        yield batch[ctx.rank :: ctx.world]


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def broadcast(ctx: DDPContext, obj: object) -> object:
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.control)
    return box[0]


def all_mean(ctx: DDPContext, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=ctx.control)
    return t.item() / ctx.world


def shutdown(ctx: DDPContext | None) -> None:
    if ctx is not None and dist.is_initialized():
        dist.barrier(group=ctx.control)
        dist.destroy_process_group()
