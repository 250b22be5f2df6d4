"""How many of a mixture's paths to keep in memory: all of them when they fit (the bytes of one loaded path
times the number of paths, against the memory available on its device), else as many as fit, with a
warning that says what reloading will cost.

    kept = keep_loaded(mixture)        # None: every path stays loaded (and is loaded now)

`dipaco serve` calls this unless `--max-loaded` is given; likelihood routing reads every path for each
request, so with fewer paths kept than the mixture has, every request reloads paths from disk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dipaco.inference.mixture import Mixture

log = logging.getLogger(__name__)

HEADROOM = 0.8  # the share of the available memory paths may take (activations and the server need the rest)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device`: CUDA's free memory, or the host's MemAvailable (None when unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def keep_loaded(mixture: Mixture) -> int | None:
    """Set and return how many paths `mixture` keeps in memory (None: all), loading them now when all fit."""
    paths = mixture.path_ids
    per_path = model_bytes(mixture.model(paths[0]))
    free = available_bytes(mixture.device)  # the first path is loaded already
    if free is None:
        log.warning("cannot tell the free memory on %s: keeping all %d paths (%.2f GB each) loaded",
                    mixture.device, len(paths), per_path / 1e9)
        fits = len(paths)
    else:
        fits = 1 + int(free * HEADROOM // max(per_path, 1))
    if fits >= len(paths):
        mixture.paths.max_loaded = None
        for path in paths:
            mixture.model(path)
        log.info("all %d paths loaded (%.2f GB)", len(paths), per_path * len(paths) / 1e9)
        return None
    cost = ("every request reloads paths from disk (likelihood routing reads every path)"
            if mixture.route == "likelihood" else "a request routed to a path not in memory reloads it")
    log.warning("the %d paths need %.2f GB (%.2f GB each) but %.2f GB is free on %s: keeping %d loaded, so %s",
                len(paths), per_path * len(paths) / 1e9, per_path / 1e9, (free or 0) / 1e9, mixture.device, fits, cost)
    mixture.paths.max_loaded = fits
    return fits
