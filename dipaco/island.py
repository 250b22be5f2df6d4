"""An island: trains one path for one round and pushes its pseudo-gradient to the store.

    dipaco island --config configs/tiny.yaml --run runs/tiny --path 3            # the next round
    dipaco island --config configs/tiny.yaml --run runs/tiny --path 3 --round 2
    dipaco island --config configs/tiny.yaml --run runs/tiny --path 1 --path 3 --follow

With `--follow` the island is a long-running worker: it trains its paths for every round as soon as
the store commits the previous one, until the run's last round (what `dipaco train` starts, so the
cost of starting Python and loading the tokenizer and shards is paid once).

The island pulls its path's modules at the version the round starts from, restores its inner AdamW
state, runs `inner.steps` steps on its path's shard, and writes Δ = θ_start − θ_end per module plus
its token count. It holds only its own path in memory and talks to nothing but the store. A task
whose result already exists is not run again.
"""

from __future__ import annotations

import logging
import time

import torch

from dipaco.config import Config
from dipaco.inner import (
    load_optimizer_state,
    make_optimizer,
    mean_loss,
    optimizer_state,
    resolve_device,
    train_steps,
)
from dipaco.model import load_modules, path_parameters, split_into_modules
from dipaco.paths import PathFactory

log = logging.getLogger(__name__)


def data_seed(config: Config, *, path: int) -> int:
    """One data order per path for the whole run (rounds continue it, so each epoch is exact)."""
    return config.train.seed * 1_000_003 + path * 7919 + 17


def run_island_task(factory: PathFactory, *, path: int, round: int) -> dict:
    """Train `path` for round `round` (from module version round − 1); returns the result metadata."""
    config, store, topology = factory.config, factory.store, factory.topology
    committed = store.current_round()
    if round != committed + 1:
        raise ValueError(f"round {round} cannot start: the store {store.url} has completed round {committed}")
    if store.has_result(round, path):
        log.info("round %d path %d already has a result; nothing to do", round, path)
        return store.read_result_meta(round, path)

    device = resolve_device(config.train.device)
    start = {name: store.read_module(round - 1, name) for name in topology.modules_of_path(path)}
    model = factory.new_model()
    load_modules(model, start)
    model.to(device)
    params = path_parameters(model)
    optimizer = make_optimizer(model, config.inner)
    saved = store.read_inner_state(path, round - 1)
    if saved is not None:
        load_optimizer_state(optimizer, params, *saved)

    reader = factory.reader
    steps = config.inner.steps
    val = list(_take(reader.iter_batches(path, "val", batch_size=config.inner.batch_size, seed=0),
                     min(config.inner.val_batches, -(-reader.num_blocks(path, "val") // config.inner.batch_size))))
    val_loss = mean_loss(model, val, device=device, precision=config.train.precision)
    batches = reader.iter_batches(path, "train", batch_size=config.inner.batch_size,
                                  seed=data_seed(config, path=path), skip_batches=(round - 1) * steps)
    stats = train_steps(
        model, optimizer, batches,
        start_step=(round - 1) * steps, steps=steps, total_steps=config.train.rounds * steps,
        config=config.inner, device=device, precision=config.train.precision,
    )

    end = split_into_modules(model, topology, path=path)
    pseudo_gradient = {
        f"{module}/{name}": start[module][name] - tensor for module, tensors in end.items() for name, tensor in tensors.items()
    }
    names = {param: name for name, param in params.items()}
    store.write_inner_state(path, round, *optimizer_state(optimizer, names))
    meta = {
        "path": path,
        "round": round,
        "tokens": stats["tokens"],
        "train_loss": sum(stats["losses"][-5:]) / len(stats["losses"][-5:]),
        "losses": stats["losses"],
        "val_loss_start": val_loss,
        "seconds": stats["seconds"],
        "finished": time.time(),
    }
    meta["bytes_up"] = store.write_result(round, path, pseudo_gradient, meta)
    log.info("round %d path %d: %d tokens in %.1fs, train loss %.3f, val loss at start %.3f",
             round, path, stats["tokens"], stats["seconds"], meta["train_loss"], val_loss)
    return meta


def follow_rounds(factory: PathFactory, *, paths: list[int], poll_seconds: float = 0.2) -> int:
    """Train `paths` in every round the store opens until the run's last round; returns tasks run."""
    train = factory.config.train
    store, last = factory.store, min(train.stop_after_round or train.rounds, train.rounds)
    done = 0
    while (committed := store.current_round()) < last:
        todo = [p for p in paths if not store.has_result(committed + 1, p)]
        if not todo:
            time.sleep(poll_seconds)  # waiting for the other islands and the outer step
            continue
        for path in todo:
            run_island_task(factory, path=path, round=committed + 1)
            done += 1
    return done


def _take(iterator, n: int) -> list:
    return [next(iterator) for _ in range(n)]


def unflatten_pseudo_gradient(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`{"module/param": Δ}` → `{module: {param: Δ}}`."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, name = key.partition("/")
        modules.setdefault(module, {})[name] = tensor
    return modules
