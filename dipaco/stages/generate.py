"""Routed generation (`dipaco generate`): route a prompt by its prefix to one path, generate with it.

    dipaco generate --run runs/demo "def fibonacci(n):"
    dipaco generate --run runs/demo --best --temperature 0.8 "In the beginning"
"""

from __future__ import annotations

import numpy as np
import torch

from dipaco.stages.context import PathFactory
from routing.router import Router
from sharding.tokenizer import decode_prefix, encode_batch


def route_prompt(factory: PathFactory, router: Router, prompt: str) -> int:
    """The path the router picks for a prompt: from the text of its first `routing.prefix_tokens` tokens
    (a shorter prompt is routed whole)."""
    (tokens,) = encode_batch(factory.tokenizer, [prompt])
    return int(router.route([decode_prefix(factory.tokenizer, tokens, factory.config.routing.prefix_tokens)])[0])


@torch.no_grad()
def generate(factory: PathFactory, prompt: str, *, round: int, max_new_tokens: int = 64, temperature: float = 0.0,
             seed: int = 0, rounds: dict[int, int] | None = None) -> tuple[str, int]:
    """Route the prompt, then generate with the chosen path through `transformers`' `generate`.

    Greedy when `temperature` is 0. Returns (the prompt and its continuation as text, the path)."""
    path = route_prompt(factory, factory.router, prompt)
    round = rounds[path] if rounds else round
    model = factory.load_path(path=path, round=round)
    model.eval()
    model.config.use_cache = True
    tokenizer = factory.tokenizer
    (tokens,) = encode_batch(tokenizer, [prompt])
    if len(tokens) == 0:
        raise ValueError("the prompt is empty after tokenization; give some text")
    input_ids = torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long)
    torch.manual_seed(seed)
    limit = factory.config.sharding.seq_len - input_ids.shape[1]
    if limit < 1:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens; paths see at most sharding.seq_len "
                         f"{factory.config.sharding.seq_len}")
    sample = temperature > 0
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=min(max_new_tokens, limit), do_sample=sample,
                            temperature=temperature if sample else None, top_k=None, top_p=None,
                            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0].tolist(), skip_special_tokens=True), path
