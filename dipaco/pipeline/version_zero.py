"""Module version 0 of a run: one seeded dense init, or the dense warm start, cut into every path's modules.

    done = start_or_resume_store(PathFactory(config, run))   # the last committed round (0 for a new store)
"""

from __future__ import annotations

import logging

import torch

from dipaco.model.path_model import load_parameters, split_into_modules
from dipaco.optim.dense import SUMMARY, read_optimizer
from dipaco.pipeline.context import PathFactory, check_schedule, warm_start_optimizer
from dipaco.store.run_state import committed_round, initialise_store

log = logging.getLogger(__name__)


def start_or_resume_store(factory: PathFactory) -> int:
    """The store's last committed round; an empty store first gets module version 0.

    Version 0 is one seeded dense init (`run.seed`), or the `dipaco pretrain` dense model when
    `warm_start.init_modules` is set and it exists; every path's modules are cut from it. With
    `warm_start.continue_optimizer` the warm start's AdamW state goes to the store too, and every path's
    first task continues it."""
    done = committed_round(factory.store, factory.topology)
    if done is not None:
        return done
    model = factory.new_model(seed=factory.config.run.seed)
    warm_start = factory.run.pretrain / "model.safetensors"
    inner = None
    if factory.config.warm_start.init_modules and warm_start.exists():
        check_schedule(factory.config, factory.run.pretrain / SUMMARY)
        load_parameters(model, warm_start)
        log.info("every module starts from the dense warm start %s", warm_start)
        optimizer = warm_start_optimizer(factory.config, factory.run)
        if optimizer is not None:
            inner = read_optimizer(optimizer)
            log.info("every path's inner AdamW starts from the warm start's state %s", optimizer)
    initialise_store(factory.store, factory.topology, every_module(model, factory), inner=inner)
    return 0


def every_module(model: torch.nn.Module, factory: PathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Every module of the grid cut from one path-shaped `model`, path by path (a shared module once)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for path in range(factory.topology.n_paths):
        for name, tensors in split_into_modules(model, factory.topology, path=path).items():
            modules.setdefault(name, tensors)
    return modules
