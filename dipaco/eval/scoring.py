"""Scoring a path model on tokens: the one place losses and perplexities are computed.

    losses = token_losses(model, docs, batch_size=16, device=device, precision="fp32")  # per token
    nll, counts = score_documents(model, docs, skip=32, ...)   # summed after a routing prefix
    perplexity(nll.sum(), counts.sum()); mean_loss(model, val_batches, ...)   # validation loss

Islands and early stopping score validation blocks with `mean_loss`; evaluation and re-routing score
held-out documents with `token_losses` (kept per path in `dipaco.eval.modes.LossTable`), the
baselines with `score_documents`, the lm-evaluation-harness model (`dipaco.inference.harness`) with
`token_losses_and_greedy`; every perplexity is `perplexity`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dipaco.device import autocast


def token_losses(model: torch.nn.Module, docs: list[np.ndarray], *, batch_size: int, device: torch.device,
                 precision: str, pad_id: int = 0) -> list[np.ndarray]:
    """Per-token negative log-likelihood of each document: `out[d][i]` is the loss of token i given
    tokens < i (`out[d][0] = 0`, nothing predicts the first token). Shapes: `(len(docs[d]),)` float64."""
    losses, _ = token_losses_and_greedy(model, docs, batch_size=batch_size, device=device, precision=precision,
                                        pad_id=pad_id)
    return losses


@torch.no_grad()
def token_losses_and_greedy(model: torch.nn.Module, docs: list[np.ndarray], *, batch_size: int,
                            device: torch.device, precision: str,
                            pad_id: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`token_losses`, and whether each token is the model's most likely one given tokens < i
    (`greedy[d][i]`, bool `(len(docs[d]),)`; `greedy[d][0]` is True): what lm-evaluation-harness calls
    `is_greedy` for a continuation."""
    model.eval()
    out: list[np.ndarray] = [np.zeros(len(d)) for d in docs]
    greedy: list[np.ndarray] = [np.ones(len(d), dtype=bool) for d in docs]
    order = np.argsort([-len(d) for d in docs], kind="stable")  # similar lengths share a batch
    for start in range(0, len(docs), batch_size):
        index = [i for i in order[start : start + batch_size] if len(docs[i]) > 1]
        if not index:
            continue
        length = max(len(docs[i]) for i in index)
        ids = torch.full((len(index), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(index), length), dtype=torch.long)
        for row, i in enumerate(index):
            ids[row, : len(docs[i])] = torch.as_tensor(docs[i].astype(np.int64))
            mask[row, : len(docs[i])] = 1
        ids, mask = ids.to(device), mask.to(device)
        with autocast(device, precision):
            logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).double().cpu().numpy()  # (B, T-1)
        best = (logp.argmax(dim=-1) == ids[:, 1:]).cpu().numpy()  # (B, T-1)
        for row, i in enumerate(index):
            out[i][1:] = nll[row, : len(docs[i]) - 1]
            greedy[i][1:] = best[row, : len(docs[i]) - 1]
    return out, greedy


def score_documents(model: torch.nn.Module, docs: list[np.ndarray], *, skip: int, batch_size: int,
                    device: torch.device, precision: str, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Summed negative log-likelihood of each document's tokens after the first `skip`, and their count.

    Returns `(nll (D,), tokens (D,))`; token i is predicted from tokens < i."""
    losses = token_losses(model, docs, batch_size=batch_size, device=device, precision=precision, pad_id=pad_id)
    nll = np.array([loss[skip:].sum() for loss in losses], dtype=np.float64)
    counts = np.array([max(0, len(d) - skip) for d in docs], dtype=np.int64)
    return nll, counts


def perplexity(nll: float, tokens: int) -> float:
    """`exp(nll / tokens)`: the perplexity of `tokens` tokens of summed loss `nll` (NaN for none)."""
    return math.exp(nll / tokens) if tokens else float("nan")


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: list[np.ndarray], *, device: torch.device, precision: str) -> float:
    """Mean next-token loss over full blocks `(B, T)` (no masking); NaN when there are none."""
    if not batches:
        return float("nan")
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        input_ids = torch.as_tensor(batch, dtype=torch.long, device=device)
        with autocast(device, precision):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        n = input_ids.shape[0] * (input_ids.shape[1] - 1)
        total += loss.float().item() * n
        count += n
    return total / count
