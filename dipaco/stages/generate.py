"""Routed generation (`dipaco generate`): route a prompt by its prefix to one path, generate with it.

    dipaco generate --run runs/demo "def fibonacci(n):"
    dipaco generate --run runs/demo --best --temperature 0.8 "In the beginning"

The prompt is routed by `dipaco.inference.prompt_routing.route_prompts` (the router's pick, as evaluation
routes a test document; with DiLoCo replicas, the routed path's first replica), then the chosen path
continues it through `transformers`' `generate` (`dipaco.inference.continuation`). An exported mixture
(`dipaco.load`) routes and continues through the same two functions. `--route likelihood` routes it as the `likelihood` eval mode
does instead: every path reads the prompt's first `routing.prefix_tokens` tokens, one at a time, and
the one that gives them the lowest loss continues it.

    dipaco generate --run runs/demo --route likelihood "def fibonacci(n):"

`--run` may also name a mixture `dipaco export` wrote: the prompt is routed and continued by
`dipaco.load(DIR)` (the same two functions), with the paths the export holds.

    dipaco generate --run out/demo "In the beginning"
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from dipaco.config import Config
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.inference.continuation import check_options, continue_tokens
from dipaco.inference.manifest import MANIFEST
from dipaco.inference.prompt_routing import ROUTES, route_prompts
from dipaco.pipeline.context import PathFactory, chosen_versions
from dipaco.run_dir import RunDir
from sharding.tokenizer import encode_batch

log = logging.getLogger(__name__)

__all__ = ["ROUTES", "check_options", "command", "generate"]


def generate(factory: PathFactory, prompt: str, *, rounds: dict[int, int], max_new_tokens: int = 64,
             temperature: float = 0.0, seed: int = 0, route: str = "router") -> tuple[str, int]:
    """Route the prompt (`route`: the run's router, `likelihood` or `likelihood:K`), then continue it with the chosen
    path at module version `rounds[path]`.

    Returns (the prompt and its continuation as text, the path)."""
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, route=route)
    tokenizer, topology = factory.tokenizer, factory.topology
    (tokens,) = encode_batch(tokenizer, [prompt])
    router = (PrefixRouter(factory.router, tokenizer, topology, prefix_tokens=factory.prefix_tokens)
              if route != "likelihood" else None)  # likelihood:K's candidates come from the router
    candidates = {topology.representative(q) for q in range(topology.n_routed)} & set(rounds)
    (path,) = route_prompts([tokens], route=route, router=router, prefix_tokens=factory.prefix_tokens,
                            load=lambda p, version: factory.load_path(path=p, round=version),
                            versions={p: rounds[p] for p in candidates}, device=torch.device("cpu"))
    model = factory.load_path(path=int(path), round=rounds[int(path)])
    new = continue_tokens(model, tokens, max_length=factory.config.sharding.seq_len, max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, pad_id=tokenizer.pad_token_id,
                          eos_id=tokenizer.eos_token_id)
    return tokenizer.decode([*tokens.tolist(), *new.tolist()], skip_special_tokens=True), int(path)


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, route=args.route)
    factory = PathFactory(config, run)
    rounds = chosen_versions(factory, round=args.round, best=args.best)
    text, path = generate(factory, args.prompt, rounds=rounds, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, route=args.route)
    print(f"[path {path} {factory.topology.path_label(path)}, round {rounds[path]}]")
    print(text)


def command_on_export(args: argparse.Namespace) -> bool:
    """`dipaco generate --run DIR` where DIR is an exported mixture: route and continue the prompt with
    `dipaco.load(DIR)` and print it as `command` does; False (nothing done) when DIR is not one."""
    directory = Path(args.run) if args.run else None
    if directory is None or not (directory / MANIFEST).is_file():
        return False
    if args.round is not None or args.best or args.config or args.overrides:
        raise ValueError(f"{directory} is an exported mixture (one version of each path, its own settings): "
                         f"--round, --best, --config and key=value overrides do not apply")
    check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, route=args.route)
    from dipaco.inference.mixture import load

    mixture = load(directory, route=args.route)
    completion = mixture.complete(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed)
    entry = mixture.manifest.paths[completion.path]
    label = "(" + ",".join(map(str, entry.choice)) + ")"
    print(f"[path {completion.path} {label}, round {entry.round}]")
    print(completion.text)
    return True
