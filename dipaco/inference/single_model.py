"""One Hugging Face model directory behind a `Mixture`'s interface: every prompt goes to its only path, 0.

    model = SingleModel("out/demo/baselines/dense-equal-steps")
    model.route_tokens(prompts)   # zeros; model.model(0), model.encode(texts), model.max_length

How the lm-evaluation-harness model type (`harness`) and `dipaco serve` run a dense baseline next to the
mixture, with the same tokenization, windows and scoring. Only safetensors and JSON are read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.inference.path_cache import PathCache
from sharding.tokenizer import encode_batch, load_tokenizer


class SingleModel:
    """A causal LM directory (config.json, model.safetensors, its tokenizer) read as a one-path mixture."""

    prefix_tokens = 1  # nothing is routed
    path_ids = [0]

    def __init__(self, directory: str | Path, *, device: str | torch.device = "cpu"):
        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise FileNotFoundError(f"{self.directory} holds neither a dipaco mixture (dipaco_mixture.json) nor a "
                                    "Hugging Face model (config.json)")
        self.device = torch.device(device)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.directory)
        self.paths = PathCache(self._load, max_loaded=1)
        self.route = "none"

    @property
    def max_length(self) -> int:
        """The most tokens the model reads (its `max_position_embeddings`)."""
        return int(self.model(0).config.max_position_embeddings)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return encode_batch(self.tokenizer, texts)

    def route_tokens(self, prompts: list[np.ndarray]) -> np.ndarray:
        return np.zeros(len(prompts), dtype=np.int64)

    def model(self, path: int) -> LlamaForCausalLM:
        if path != 0:
            raise ValueError(f"{self.directory} is one model (path 0), not a mixture; asked for path {path}")
        return self.paths.get(0)

    def _load(self, _path: int) -> LlamaForCausalLM:
        model = LlamaForCausalLM.from_pretrained(self.directory, use_safetensors=True, local_files_only=True)
        return model.to(self.device).eval()
