"""Continuing a prompt with one path model: greedy or sampled, capped at the sequence length paths saw.

    check_options(max_new_tokens=20, temperature=0.0, seed=0, route="router")
    new = continue_tokens(model, prompt_ids, max_length=256, max_new_tokens=20, temperature=0.0, seed=0,
                          pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)   # (N,) the generated ids

`dipaco generate`, `dipaco.load(...).generate` and `dipaco serve` all continue prompts here (the server
also passes `top_p`, a `streamer` that receives each new token, and `stop_when`, asked after each token).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch
from transformers import LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

from dipaco.inference.routes import parse_route

log = logging.getLogger(__name__)


def check_options(*, max_new_tokens: int, temperature: float, seed: int, route: str = "router") -> None:
    """Refuse options that would silently mean something else (a negative temperature is not greedy)."""
    parse_route(route)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature must be 0 (greedy) or a positive number, got {temperature}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")


@torch.no_grad()
def continue_tokens(model: LlamaForCausalLM, prompt: np.ndarray, *, max_length: int, max_new_tokens: int,
                    temperature: float, seed: int, pad_id: int | None, eos_id: int | None, top_p: float = 1.0,
                    streamer: object | None = None,
                    stop_when: Callable[[list[int]], bool] | None = None) -> np.ndarray:
    """Up to `max_new_tokens` token ids after `prompt` (T,), no more than `max_length` in all: greedy when
    `temperature` is 0, sampled with `seed` (nucleus `top_p` < 1: from the smallest set of tokens holding
    that probability) otherwise; generation stops after `eos_id`, or once `stop_when(new ids)` is true.
    `streamer` (a transformers streamer) gets the prompt, then each new token."""
    model.eval()
    model.config.use_cache = True
    if len(prompt) == 0:
        raise ValueError("the prompt is empty after tokenization; give some text")
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(np.asarray(prompt)[None], dtype=torch.long, device=device)  # (1, T)
    torch.manual_seed(seed)
    limit = max_length - input_ids.shape[1]
    if limit < 1:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens; paths see at most sharding.seq_len {max_length}")
    if max_new_tokens > limit:
        log.warning("--max-new-tokens %d: a path sees at most sharding.seq_len %d tokens and the prompt has %d, "
                    "so it generates at most %d", max_new_tokens, max_length, input_ids.shape[1], limit)
    sample = temperature > 0
    criteria = None if stop_when is None else StoppingCriteriaList([_StopWhen(stop_when, input_ids.shape[1])])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=min(max_new_tokens, limit), do_sample=sample,
                            temperature=temperature if sample else None, top_k=None,
                            top_p=top_p if sample and top_p < 1 else None, streamer=streamer,
                            stopping_criteria=criteria,
                            pad_token_id=pad_id if pad_id is not None else eos_id, eos_token_id=eos_id)
    return output[0, input_ids.shape[1]:].cpu().numpy()


class _StopWhen(StoppingCriteria):
    """Stops generation once `stop_when` holds for the ids generated after the first `prompt` tokens."""

    def __init__(self, stop_when: Callable[[list[int]], bool], prompt: int):
        self.stop_when, self.prompt = stop_when, prompt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = self.stop_when(input_ids[0, self.prompt:].tolist())
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
