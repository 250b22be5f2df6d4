"""Configuration of the sharding stage (tokenizer choice, block length, splits, shard size).

Loaded by the ``dipaco`` config system from the ``sharding:`` section of a YAML file; on its own:
``python -c "from sharding.sharding_config import ShardingConfig; print(ShardingConfig(seq_len=128))"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from routing.fields import Count, Range, Section, Seed

# A byte-level BPE needs the 256 byte symbols plus the two special tokens (EOS, PAD).
MIN_BPE_VOCAB = 256 + 2


@dataclass(kw_only=True)
class ShardingConfig(Section):
    """How documents become token shards."""

    section = "sharding"
    tokenizer: str = ""  # "" = train a byte-level BPE on the corpus; else a local Hugging Face tokenizer directory
    vocab_size: Annotated[int, Range(min=MIN_BPE_VOCAB, max=1 << 32)] = 4096  # vocabulary of the trained BPE (256 bytes + EOS + PAD at least; ignored when tokenizer is given)
    seq_len: Annotated[int, Range(min=2)] = 256  # tokens per training block, and the most tokens kept of a test document
    val_fraction: Annotated[float, Range(above=0, below=1)] = 0.05  # share of each path's blocks held out for validation (at least one)
    tokens_per_shard: Annotated[int, Range(min=2)] = 1 << 24  # tokens per shard file before a new one is started (whole blocks; at least seq_len)
    max_encode_chars: Count = 1_000_000  # longer documents are tokenized (BPE training, sharding) in pieces of at most this many characters, cut at a space: peak memory is bounded by it, not by the largest document (0 = whole documents)
    seed: Seed = 0  # seed of the validation hold-out choice

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str):
            raise ValueError(f"sharding.tokenizer must be a string (a directory or ''), got {self.tokenizer!r}")
        super().__post_init__()
        if self.tokens_per_shard < self.seq_len:
            raise ValueError(f"sharding.tokens_per_shard must be >= sharding.seq_len {self.seq_len}, "
                             f"got {self.tokens_per_shard}")
