"""The codec module updates travel with (`compression.download: update`), read from the config once by the
coordinator, which encodes them, and by the islands, which decode them (`dipaco.codec.update`).

    codec = download_codec(config.compression)   # None with compression.download: full
"""

from __future__ import annotations

from dipaco.codec.codec import Codec
from dipaco.config import CompressionConfig


def download_codec(compression: CompressionConfig) -> Codec | None:
    """`compression.codec` and its settings, as module updates are encoded (the pseudo-gradients' codec; with
    `compression.download: results`, the updates of the rounds that are not a plain average); None with
    `compression.download: full` (islands read whole modules, no update is published)."""
    if compression.download == "full":
        return None
    c = compression
    return Codec.of(c.codec, level=c.zstd_level, density=c.density, bits=c.bits, chunk=c.chunk)
