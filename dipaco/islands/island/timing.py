"""Per-phase wall and CPU seconds of a task, when asked (`bench/bench_speed.py`).

    timings = {}; train_task(setup, task, timings=timings); timings["inner_loop"], timings["inner_loop.cpu"]

"shard_read" is the part of "inner_loop" the training thread spent waiting for the next batch (read
ahead by `dipaco.optim.prefetch.Prefetcher`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

PHASES = ("load_modules", "restore_inner", "validation", "inner_loop", "shard_read", "pseudo_gradient",
          "save_inner", "write_inner", "write_result")


@contextlib.contextmanager
def timed(timings: dict[str, float] | None, phase: str, device: torch.device | None = None) -> Iterator[None]:
    """Add the block's wall time to `timings[phase]` and this process's CPU time to `timings[phase + ".cpu"]`
    (nothing when `timings` is None); on CUDA the device is synchronised at both ends, so queued kernels
    count in the phase that queued them."""
    if timings is None:
        yield
        return
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    _sync(device)
    timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - wall
    timings[f"{phase}.cpu"] = timings.get(f"{phase}.cpu", 0.0) + time.process_time() - cpu


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def waited(batches: Iterator[torch.Tensor], timings: dict[str, float] | None) -> Iterator[torch.Tensor]:
    """`batches`, the time spent waiting for each added to `timings["shard_read"]`."""
    if timings is None:
        yield from batches
        return
    while True:
        with timed(timings, "shard_read"):
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def stopped_by(check: Callable[[], None], stop: type[Exception] | None) -> bool:
    """Call `check`: True when it raised `stop`; anything else it raises propagates."""
    try:
        check()
    except Exception as err:
        if stop is None or not isinstance(err, stop):
            raise
        return True
    return False


def checked(batches: Iterator[torch.Tensor], check: Callable[[], None] | None,
            stop: type[Exception] | None = None) -> Iterator[torch.Tensor]:
    """`batches`, calling `check` (fault injection, cancellation) before each, in the training thread; a
    `stop` exception it raises ends the batches there (the task is cut short, after one step at least)."""
    for i, batch in enumerate(batches):
        if check is not None and stopped_by(check, stop):
            if i == 0:
                yield batch  # nothing trained yet: one step, then stop
            return
        yield batch
