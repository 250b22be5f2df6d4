"""The one list of codec names (`compression.codec`'s allowed values) and what each name stands for.

    from dipaco.codec.registry import NAMES, codec_info
    codec_info("int8").suffix        # ".int8.safetensors": the file suffix of a pseudo-gradient it encodes
    codec_info("int4").bits          # 4: bits per parameter before zstd (None: set by the top-k settings)

Plain data, no torch: `dipaco.config` reads `NAMES` for its `Literal`, the store reads the suffixes, and
`dipaco.codec.compress` encodes and decodes by these names (`dipaco.codec.codec.Codec` is the interface).
A new codec is a new entry here, then its encoder in `compress`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CodecInfo:
    """One codec: its name, the suffix of the files it writes, and its size before zstd."""

    name: str  # the `compression.codec` value
    suffix: str  # suffix of a pseudo-gradient file it encodes, in the store
    bits: int | None  # bits per parameter before zstd; None: density x (bits + index), set by compression.*
    doc: str  # one line, for people


REGISTRY: dict[str, CodecInfo] = {info.name: info for info in (
    CodecInfo("none", ".safetensors", 32, "float32 safetensors, as before compression existed"),
    CodecInfo("int8", ".int8.safetensors", 8, "per-row scale, values rounded to 255 levels, then zstd"),
    CodecInfo("int4", ".int4.safetensors", 4, "per-row scale, values rounded to 15 levels, two per byte, then zstd"),
    CodecInfo("topk", ".topk.safetensors", None,
              "per chunk the largest-magnitude `density` of the entries at `bits` bits each, then zstd"),
)}
NAMES: tuple[str, ...] = tuple(REGISTRY)  # compression.codec's allowed values


def codec_info(name: str) -> CodecInfo:
    """The registry's entry for `name`; a ValueError naming the known codecs when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; codecs are {list(NAMES)}") from None
