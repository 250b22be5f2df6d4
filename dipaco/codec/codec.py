"""The codec interface: a `compression.codec` name with its settings, which encodes a pseudo-gradient to the
bytes an island uploads, decodes them to float32 on the coordinator, and names its file suffix.

    from dipaco.codec.codec import Codec
    codec = Codec.of("topk", level=1, density=0.03, bits=2, chunk=4096)
    data, stats = codec.encode({"embeddings/w": delta})   # stats["bytes"] == len(data): the byte count
    tensors = codec.decode(data, shapes={"embeddings/w": [512, 64]})
    name = "path-0002" + codec.suffix                      # ".topk.safetensors"

The names and suffixes are `dipaco.codec.registry`'s; the formats are `dipaco.codec.compress`'s (and
`dipaco.codec.sparse`'s for top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dipaco.codec.compress import compress, decompress
from dipaco.codec.registry import codec_info
from dipaco.codec.sparse import TopK


@dataclass(frozen=True)
class Codec:
    """One codec and its settings."""

    name: str  # a name of `dipaco.codec.registry`
    level: int = 1  # zstd level (compression.zstd_level)
    topk: TopK | None = None  # the sparsification: required by (and only by) codec "topk"

    def __post_init__(self) -> None:
        codec_info(self.name)
        if (self.name == "topk") != (self.topk is not None):
            raise ValueError(f"codec {self.name!r} " + ("needs" if self.topk is None else "takes no") + " top-k settings")

    @classmethod
    def of(cls, name: str, *, level: int, density: float, bits: int, chunk: int) -> Codec:
        """The codec `compression.codec` and its fields ask for (the top-k fields count only for "topk")."""
        return cls(name, level=level, topk=TopK(density=density, bits=bits, chunk=chunk) if name == "topk" else None)

    @property
    def suffix(self) -> str:
        """The suffix of a pseudo-gradient file this codec wrote."""
        return codec_info(self.name).suffix

    def encode(self, tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict]:
        """`{"module/param": tensor}` → (the bytes, stats: "bytes" = their count, "raw_bytes" = float32's, "ratio")."""
        return compress(tensors, method=self.name, level=self.level, topk=self.topk)

    def decode(self, data: bytes, *, shapes: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
        """The float32 tensors `data` holds (with `shapes`: exactly those, checked before anything is decoded)."""
        return decompress(data, method=self.name, shapes=shapes)[0]
