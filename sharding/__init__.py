"""Token shards for DiPaCo paths: tokenizer, on-disk format, builder and reader.

``build_shards`` turns a routed corpus (texts + per-document path and split) into per-path,
block-packed, zstd-compressed, checksummed token shards with an ``index.json``; ``ShardReader``
serves them back as blocks, training batches and test documents. Inspect a shard directory with
``python -m sharding info DIR`` (CPU only). Importing this package does not import transformers.
"""

from sharding.build import build_shards
from sharding.format import FORMAT_VERSION, ShardError
from sharding.reader import ShardReader
from sharding.sharding_config import ShardingConfig

__all__ = ["FORMAT_VERSION", "ShardError", "ShardReader", "ShardingConfig", "build_shards"]
