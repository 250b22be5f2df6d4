"""Richer prefix features from the k-means router's own featurize pass (no extra forward pass).

The base-model featurizer is the mean of the dense warm start's last hidden states over the prefix. The same
forward pass also gives the last token's hidden state and every layer's: `pooled` returns the three variants,
the first equal to `Router.features` (experiments/router_labels.py checks it).

    variants = pooled(Router.load("runs/x/routing/phase-0").featurizer, prefix_texts)
"""

from __future__ import annotations

import numpy as np
import torch

VARIANTS = ("mean last layer", "mean last layer + last token", "mean of every layer")


def pooled(featurizer, texts: list[str], *, batch_size: int = 32) -> dict[str, np.ndarray]:
    """{variant: (N, dim) float32} for `texts`, one forward pass of `featurizer`'s model per batch."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in VARIANTS}
    for start in range(0, len(texts), batch_size):
        batch = [t if t else " " for t in texts[start:start + batch_size]]
        enc = featurizer.tokenizer(batch, truncation=True, max_length=featurizer.max_tokens, padding=True,
                                   return_tensors="pt")
        with torch.no_grad():
            hidden = featurizer.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                      output_hidden_states=True).hidden_states
        mask = enc["attention_mask"].unsqueeze(-1).float()
        means = [(h * mask).sum(1) / mask.sum(1).clamp(min=1) for h in hidden]
        last = hidden[-1][torch.arange(len(batch)), enc["attention_mask"].sum(1) - 1]
        out[VARIANTS[0]].append(means[-1])
        out[VARIANTS[1]].append(torch.cat([means[-1], last], 1))
        out[VARIANTS[2]].append(torch.cat(means, 1))
    return {name: torch.cat(parts).numpy().astype(np.float32) for name, parts in out.items()}
