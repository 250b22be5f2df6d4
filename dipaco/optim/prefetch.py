"""Batches read ahead: a background thread turns the next token blocks into torch tensors while the
model trains on the current ones.

    with Prefetcher(batches, count=25, device=device) as ahead:   # batches: an iterator of (B, T) arrays
        train_steps(model, optimizer, ahead, ...)                 # (B, T) int64 tensors on `device`

The thread reads exactly `count` batches (a shard's checksum and decompression, the shuffled gather)
at most `depth` ahead of the training thread, in order. On CUDA each batch is pinned and copied with
`non_blocking=True`, so the copy overlaps the step that is running instead of waiting for it. An
error raised while reading is raised in the training thread at the batch it belongs to.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch

_POLL_SECONDS = 0.1


class Prefetcher:
    def __init__(self, batches: Iterator[np.ndarray], *, count: int, device: torch.device, depth: int = 2):
        if count < 0 or depth < 1:
            raise ValueError(f"Prefetcher needs count >= 0 and depth >= 1, got count={count} depth={depth}")
        self.batches, self.count, self.device = batches, count, device
        self.pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="dipaco-prefetch", daemon=True)

    def __enter__(self) -> Iterator[torch.Tensor]:
        self._thread.start()
        return self._yield()

    def __exit__(self, *exc: object) -> None:
        """Stop the thread and wait for it, even when a signal interrupts the wait: left running at the
        interpreter's exit inside torch, it would abort the process."""
        self._stop.set()
        try:
            self._thread.join()
        except BaseException:
            self._thread.join()
            raise

    def _read(self) -> None:
        try:
            for _ in range(self.count):
                tensor = torch.from_numpy(np.asarray(next(self.batches), dtype=np.int64))  # (B, T)
                if self.pin:
                    tensor = tensor.pin_memory()
                if not self._put((tensor, None)):
                    return
        except BaseException as err:  # handed to the training thread, raised there
            self._put((None, err))

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _yield(self) -> Iterator[torch.Tensor]:
        for _ in range(self.count):
            tensor, err = self._queue.get()
            if err is not None:
                raise err
            yield tensor.to(self.device, non_blocking=self.pin)
