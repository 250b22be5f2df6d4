"""The path models of a mixture, loaded when first asked for and at most `max_loaded` kept in memory.

    cache = PathCache(load=lambda path: LlamaForCausalLM.from_pretrained(...), max_loaded=2)
    model = cache.get(3)      # loaded now; the least recently used model is dropped past 2

Thread-safe: the server's request threads share one cache.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class PathCache:
    """Least-recently-used path models: `get(path)` loads on a miss and drops the oldest past `max_loaded`
    (None: keep every model loaded)."""

    def __init__(self, load: Callable[[int], torch.nn.Module], *, max_loaded: int | None = None):
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1 (or None: no limit), got {max_loaded}")
        self._load = load
        self.max_loaded = max_loaded
        self._models: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0  # how many times a model was loaded (a miss)

    def get(self, path: int) -> torch.nn.Module:
        with self._lock:
            if path in self._models:
                self._models.move_to_end(path)
                return self._models[path]
            model = self._load(path)
            self.loads += 1
            self._models[path] = model
            while self.max_loaded is not None and len(self._models) > self.max_loaded:
                dropped, _ = self._models.popitem(last=False)
                log.debug("dropped path %d from memory (max_loaded %d)", dropped, self.max_loaded)
            return model

    @property
    def loaded(self) -> list[int]:
        """The paths in memory, least recently used first."""
        with self._lock:
            return list(self._models)
