"""Routed generation (`dipaco generate`): route a prompt by its prefix to one path, generate with it.

    dipaco generate --run runs/demo "def fibonacci(n):"
    dipaco generate --run runs/demo --best --temperature 0.8 "In the beginning"

The prompt is routed by `dipaco.eval.prefix_routing.PrefixRouter`, as evaluation routes a test
document (with DiLoCo replicas, to the routed path's first replica), then the chosen path continues
it through `transformers`' `generate`. `--route likelihood` routes it as the `likelihood` eval mode
does instead: every path reads the prompt's first `routing.prefix_tokens` tokens, one at a time, and
the one that gives them the lowest loss continues it.

    dipaco generate --run runs/demo --route likelihood "def fibonacci(n):"
"""

from __future__ import annotations

import argparse
import logging
import math
from functools import partial

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.config import Config
from dipaco.eval.modes import LossTable, likelihood_choice
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.eval.scoring import token_losses
from dipaco.pipeline.context import PathFactory, chosen_versions
from dipaco.run_dir import RunDir
from sharding.tokenizer import encode_batch

log = logging.getLogger(__name__)

ROUTES = ("router", "likelihood")


def generate(factory: PathFactory, prompt: str, *, rounds: dict[int, int], max_new_tokens: int = 64,
             temperature: float = 0.0, seed: int = 0, route: str = "router") -> tuple[str, int]:
    """Route the prompt (`route`: the run's router, or `likelihood`), then continue it with the chosen
    path at module version `rounds[path]`.

    Returns (the prompt and its continuation as text, the path)."""
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, route=route)
    if route == "likelihood":
        path = likelihood_path(factory, prompt, rounds=rounds)
    else:
        router = PrefixRouter(factory.router, factory.tokenizer, factory.topology,
                              prefix_tokens=factory.prefix_tokens)
        path = int(router.route_texts([prompt])[0])
    model = factory.load_path(path=path, round=rounds[path])
    text = continue_text(model, factory.tokenizer, prompt, max_length=factory.config.sharding.seq_len,
                         max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return text, path


def likelihood_path(factory: PathFactory, prompt: str, *, rounds: dict[int, int]) -> int:
    """The path among the evaluated ones (`rounds`; one model per DiLoCo replica group) whose model gives
    the prompt's first `routing.prefix_tokens` tokens the lowest loss, loaded one at a time."""
    (tokens,) = encode_batch(factory.tokenizer, [prompt])
    prefix = np.asarray(tokens[: factory.prefix_tokens])
    if len(prefix) < 2:
        raise ValueError(f"--route likelihood needs a prompt of at least 2 tokens (this one has {len(prefix)}): "
                         "nothing predicts the first token")
    candidates = {factory.topology.representative(q) for q in range(factory.topology.n_routed)} & set(rounds)
    table = LossTable(docs=[prefix], load=lambda path, version: factory.load_path(path=path, round=version),
                      score=partial(token_losses, batch_size=1, device=torch.device("cpu"), precision="fp32"))
    (path,) = likelihood_choice(table, 1, {p: rounds[p] for p in candidates}, prefix=len(prefix))
    return int(path)


def check_options(*, max_new_tokens: int, temperature: float, seed: int, route: str = "router") -> None:
    """Refuse options that would silently mean something else (a negative temperature is not greedy)."""
    if route not in ROUTES:
        raise ValueError(f"--route must be one of {list(ROUTES)}, got {route!r}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature must be 0 (greedy) or a positive number, got {temperature}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")


@torch.no_grad()
def continue_text(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt: str, *, max_length: int,
                  max_new_tokens: int, temperature: float, seed: int) -> str:
    """The prompt and up to `max_new_tokens` more tokens (no more than `max_length` in all), as text.
    Greedy when `temperature` is 0, sampled with `seed` otherwise."""
    model.eval()
    model.config.use_cache = True
    (tokens,) = encode_batch(tokenizer, [prompt])
    if len(tokens) == 0:
        raise ValueError("the prompt is empty after tokenization; give some text")
    input_ids = torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long)  # (1, T)
    torch.manual_seed(seed)
    limit = max_length - input_ids.shape[1]
    if limit < 1:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens; paths see at most sharding.seq_len {max_length}")
    if max_new_tokens > limit:
        log.warning("--max-new-tokens %d: a path sees at most sharding.seq_len %d tokens and the prompt has %d, "
                    "so it generates at most %d", max_new_tokens, max_length, input_ids.shape[1], limit)
    sample = temperature > 0
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=min(max_new_tokens, limit), do_sample=sample,
                            temperature=temperature if sample else None, top_k=None, top_p=None,
                            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0].tolist(), skip_special_tokens=True)


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, route=args.route)
    factory = PathFactory(config, run)
    rounds = chosen_versions(factory, round=args.round, best=args.best)
    text, path = generate(factory, args.prompt, rounds=rounds, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, route=args.route)
    print(f"[path {path} {factory.topology.path_label(path)}, round {rounds[path]}]")
    print(text)
