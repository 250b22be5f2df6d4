"""Compressed pseudo-gradients: per-row int8 / int4 quantisation, then zstd (`outer.compression`).

    from dipaco.store.compress import compress, decompress
    data, stats = compress({"w": delta}, method="int8")        # bytes an island uploads
    tensors, _ = decompress(data, method="int8")               # float32 again, on the coordinator

Each tensor is viewed as rows: a tensor of two or more dimensions has one row per index of its first
dimension, a vector or a scalar is one row. A row's scale is max|x| / q_max (q_max = 127 for int8,
7 for int4) and its values are rounded to the nearest integer multiple of the scale, so every element
is off by at most scale / 2. int4 values are stored as
q + 8 in one nibble, two per byte. Quantised values and float32 scales go into one safetensors blob
(shapes in its header), compressed with zstd (level `outer.zstd_level`). `none` is the plain float32
safetensors file, as before compression existed. Decompression always yields float32, and the
coordinator accumulates in float32.

Run `python -m dipaco.store.compress` to print the sizes and errors for a random pseudo-gradient.
"""

from __future__ import annotations

import json
import math

import torch
import zstandard
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

METHODS = ("none", "int8", "int4")
Q_MAX = {"int8": 127, "int4": 7}


def quantize_rows(x: torch.Tensor, *, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape) → (integers in [−q_max, q_max] as int8, shape (rows, cols); float32 scales (rows,)).

    A tensor of two or more dimensions has rows = x.shape[0]; a vector or a scalar is one row."""
    q_max = Q_MAX[f"int{bits}"]
    n_rows = x.shape[0] if x.dim() >= 2 and x.shape[0] > 0 else 1
    rows = x.detach().float().reshape(n_rows, -1)  # (rows, cols)
    scale = rows.abs().amax(dim=1) / q_max
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / safe[:, None]).clamp_(-q_max, q_max).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return (q.float() * scale[:, None]).reshape(shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [−7, 7] → uint8, two per byte (low nibble first); an odd count is padded."""
    flat = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, torch.full((1,), 8, dtype=torch.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel].to(torch.int8)


def compress(tensors: dict[str, torch.Tensor], *, method: str, level: int = 1) -> tuple[bytes, dict]:
    """Serialise a pseudo-gradient `{name: tensor}`; returns (bytes to send, stats)."""
    if method not in METHODS:
        raise ValueError(f"compression method must be one of {METHODS}, got {method!r}")
    raw_bytes = sum(t.numel() * 4 for t in tensors.values())
    if method == "none":
        data = save_safetensors({k: v.detach().float().contiguous() for k, v in tensors.items()})
        return data, {"method": method, "raw_bytes": raw_bytes, "bytes": len(data), "ratio": raw_bytes / max(1, len(data))}
    bits = 8 if method == "int8" else 4
    blob: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in tensors.items():
        q, scale = quantize_rows(tensor, bits=bits)
        blob[f"{name}::q"] = q.contiguous() if bits == 8 else pack_int4(q)
        blob[f"{name}::scale"] = scale.contiguous()
        shapes[name] = list(tensor.shape)
    # one metadata key: safetensors writes a header map in arbitrary order, and the bytes must be reproducible
    payload = save_safetensors(blob, metadata={"dipaco": json.dumps({"method": method, "shapes": shapes})})
    data = zstandard.ZstdCompressor(level=level).compress(payload)
    return data, {"method": method, "raw_bytes": raw_bytes, "bytes": len(data), "ratio": raw_bytes / max(1, len(data))}


def decompress(data: bytes, *, method: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Bytes from `compress` → (`{name: float32 tensor}`, stats)."""
    if method not in METHODS:
        raise ValueError(f"compression method must be one of {METHODS}, got {method!r}")
    if method == "none":
        return {k: v.float() for k, v in load_safetensors(data).items()}, {"method": method, "bytes": len(data)}
    payload = zstandard.ZstdDecompressor().decompress(data)
    header_len = int.from_bytes(payload[:8], "little")
    meta = json.loads(json.loads(payload[8 : 8 + header_len])["__metadata__"]["dipaco"])
    if meta.get("method") != method:
        raise ValueError(f"pseudo-gradient was compressed with {meta.get('method')!r}, not {method!r}")
    shapes = meta["shapes"]
    blob = load_safetensors(payload)
    out = {}
    for name, shape in shapes.items():
        scale = blob[f"{name}::scale"]
        q = blob[f"{name}::q"]
        if method == "int4":
            q = unpack_int4(q, math.prod(shape) if shape else 1).reshape(scale.shape[0], -1)
        out[name] = dequantize_rows(q, scale, shape)
    return out, {"method": method, "bytes": len(data)}


if __name__ == "__main__":
    torch.manual_seed(0)
    delta = {"w": torch.randn(256, 128) * 1e-3, "b": torch.randn(128) * 1e-4}
    for m in METHODS:
        data, stats = compress(delta, method=m)
        back, _ = decompress(data, method=m)
        err = max((back[k] - delta[k]).abs().max().item() for k in delta)
        print(f"{m:5s} {stats['bytes']:8d} bytes  {stats['ratio']:5.1f}x smaller  max error {err:.2e}")
