"""Configuration of the sharding stage (tokenizer choice, block length, splits, shard size).

Loaded by the ``dipaco`` config system from the ``sharding:`` section of a YAML file; on its own:
``python -c "from sharding.config import ShardingConfig; print(ShardingConfig(seq_len=128))"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A byte-level BPE needs the 256 byte symbols plus the two special tokens (EOS, PAD).
MIN_BPE_VOCAB = 256 + 2


@dataclass(kw_only=True)
class ShardingConfig:
    """How documents become token shards."""

    tokenizer: str = ""  # "" = train a byte-level BPE on the corpus; else a local Hugging Face tokenizer directory
    vocab_size: int = 4096  # vocabulary of the trained BPE (ignored when tokenizer is given)
    seq_len: int = 256  # tokens per training block, and the most tokens kept of a test document
    val_fraction: float = 0.05  # share of each path's blocks held out for validation (at least one)
    tokens_per_shard: int = 1 << 24  # tokens per shard file before a new one is started (whole blocks)
    seed: int = 0  # seed of the validation hold-out choice
    max_encode_chars: int = 1_000_000  # longer documents are tokenized (BPE training, sharding) in pieces of at most this many characters, cut at a space: peak memory is bounded by it, not by the largest document (0 = whole documents)

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str):
            raise ValueError(
                f"sharding.tokenizer must be a string (a directory or ''), got {self.tokenizer!r}"
            )
        if not MIN_BPE_VOCAB <= self.vocab_size <= 1 << 32:
            raise ValueError(
                f"sharding.vocab_size must be in [{MIN_BPE_VOCAB}, 2**32] (256 bytes + EOS + PAD), "
                f"got {self.vocab_size}"
            )
        if self.max_encode_chars < 0:
            raise ValueError(f"sharding.max_encode_chars must be >= 0 (0 = whole documents), got {self.max_encode_chars}")
        if self.seq_len < 2:
            raise ValueError(f"sharding.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"sharding.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.tokens_per_shard < self.seq_len:
            raise ValueError(
                f"sharding.tokens_per_shard must be >= seq_len {self.seq_len}, got {self.tokens_per_shard}"
            )
        if self.seed < 0:
            raise ValueError(f"sharding.seed must be >= 0, got {self.seed}")
