"""Which path continues a prompt: the router's pick from the text of its first `prefix_tokens` tokens, the
path whose model gives those tokens the lowest loss (the `likelihood` eval mode), or that among the router's
K best paths (`likelihood:K`: K prefix passes, whatever the number of paths).

    paths = route_prompts(token_ids, route="router", router=prefix_router, load=load, versions={0: 8, 1: 8},
                          prefix_tokens=32)   # (N,) one path per tokenized prompt

`dipaco generate`, an exported `Mixture` (and so the harness model and the server) route through this
one function; the router's side is `dipaco.eval.prefix_routing.PrefixRouter`, the likelihood side the
eval's `LossTable` and `likelihood_choice` on the one scorer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from dipaco.eval.modes import LossTable, likelihood_choice
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.eval.scoring import token_losses
from dipaco.inference.routes import ROUTES, parse_route  # noqa: F401 - ROUTES re-exported


def route_prompts(prompts: list[np.ndarray], *, route: str, router: PrefixRouter | None,
                  load: Callable[[int, int], torch.nn.Module], versions: dict[int, int],
                  prefix_tokens: int, device: torch.device | None = None) -> np.ndarray:
    """The path (N,) of each tokenized prompt: by `router` (`route="router"`), or (`"likelihood"`) by the
    paths in `versions` ({path: module version}, `load(path, version)` gives its model on `device`), or
    (`"likelihood:K"`) by those among the router's K best paths for the prompt."""
    kind, k = parse_route(route)
    if kind == "likelihood":
        if k and router is None:
            raise ValueError(f"route {route!r} needs the router, which picks the candidates")
        return likelihood_paths(prompts, load=load, versions=versions, prefix_tokens=prefix_tokens, device=device,
                                candidates=router.shortlist(prompts, k) if k else None)
    if router is None:
        raise ValueError("route 'router' needs the router; this one was loaded for likelihood routing")
    return np.asarray(router(prompts), dtype=np.int64)


def likelihood_paths(prompts: list[np.ndarray], *, load: Callable[[int, int], torch.nn.Module],
                     versions: dict[int, int], prefix_tokens: int, device: torch.device | None = None,
                     candidates: np.ndarray | None = None) -> np.ndarray:
    """The path (N,) among `versions` (or each prompt's `candidates` row) whose model gives the prompt's first
    `prefix_tokens` tokens the lowest loss. Each prefix is scored alone (batch 1, fp32), so a prompt's path
    never depends on the prompts it is routed with."""
    prefixes = [np.asarray(p[:prefix_tokens]) for p in prompts]
    for prefix in prefixes:
        if len(prefix) < 2:
            raise ValueError(f"likelihood routing needs a prompt of at least 2 tokens (this one has {len(prefix)}): "
                             "nothing predicts the first token")
    table = LossTable(docs=prefixes, load=load, score=partial(token_losses, batch_size=1,
                                                              device=device or torch.device("cpu"), precision="fp32"))
    return np.asarray(likelihood_choice(table, len(prefixes), versions, prefix=prefix_tokens, candidates=candidates),
                      dtype=np.int64)
