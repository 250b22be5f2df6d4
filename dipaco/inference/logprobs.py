"""Each token's log-probability under one path and the most likely tokens at each position: what
OpenAI's `logprobs` field holds, so lm-evaluation-harness's `local-completions` can score a served mixture.

    logprob, top_ids, top_logprobs = token_logprobs(model, ids, top=1, device=device)   # (T,), (T, 1), (T, 1)
    entry = openai_logprobs(tokenizer, ids, logprob, top_ids, top_logprobs, start=0, offset=0)

One forward pass, batch 1, fp32: the same numbers as the eval's scorer (`dipaco.eval.scoring.token_losses`
gives minus `logprob`), and a token is the position's most likely one exactly when its logprob equals
the largest of `top_logprobs` (both come from one log-softmax).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, ids: np.ndarray, *, top: int,
                   device: torch.device) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`logprob[i]`: log p(ids[i] | ids[:i]) (`logprob[0]` NaN: nothing predicts the first token); the `top`
    most likely tokens at each position and their logprobs (row 0 empty). Shapes (T,), (T, top), (T, top)."""
    model.eval()
    logprob = np.full(len(ids), np.nan)
    top_ids = np.zeros((len(ids), top), dtype=np.int64)
    top_values = np.full((len(ids), top), np.nan)
    if len(ids) < 2:
        return logprob, top_ids, top_values
    input_ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)[None], device=device)  # (1, T)
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits  # (1, T, V)
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # (T-1, V)
    logprob[1:] = logp.gather(-1, input_ids[0, 1:, None])[:, 0].double().cpu().numpy()
    if top:
        values, index = logp.topk(top, dim=-1)  # (T-1, top)
        top_ids[1:], top_values[1:] = index.cpu().numpy(), values.double().cpu().numpy()
    return logprob, top_ids, top_values


def openai_logprobs(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray, logprob: np.ndarray, top_ids: np.ndarray,
                    top_values: np.ndarray, *, start: int, offset: int, top: int) -> dict:
    """OpenAI's `logprobs` object for tokens `ids[start:]`: their text, logprob (None for the first token
    of a sequence), the `top` most likely tokens ({text: logprob}) and each token's character offset,
    counted from `offset`."""
    tokens = [tokenizer.decode([int(t)]) for t in ids[start:]]
    offsets = list(np.cumsum([0, *map(len, tokens[:-1])]) + offset) if tokens else []
    entries, tops = [], []
    for i in range(start, len(ids)):
        first = i == 0
        entries.append(None if first else float(logprob[i]))
        tops.append(None if first else _top(tokenizer, top_ids[i, :top], top_values[i, :top]))
    return {"tokens": tokens, "token_logprobs": entries, "top_logprobs": tops, "text_offset": [int(o) for o in offsets]}


def _top(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """{token text: logprob}, most likely first; two tokens with one text keep the larger logprob."""
    out: dict[str, float] = {}
    for token, value in zip(ids, values, strict=True):
        out.setdefault(tokenizer.decode([int(token)]), float(value))
    return out
