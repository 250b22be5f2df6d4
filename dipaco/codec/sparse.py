"""Sparse low-bit pseudo-gradients: per chunk, the largest-magnitude entries at a few bits each (`compression.codec: topk`).

    from dipaco.codec.sparse import TopK, encode_tensor, decode_tensor
    spec = TopK(density=0.03, bits=2, chunk=4096)
    parts = encode_tensor(delta, spec)            # {"gaps", "codes", "lo", "step"}: what is stored
    back = decode_tensor(parts, shape=list(delta.shape), spec=spec, name="embeddings/w")

A tensor is flattened (row-major) and cut into chunks of `chunk` elements (the last one may be
shorter). From a chunk of n elements the k = ceil(density × n) entries of largest magnitude are kept
(at least one); the others are sent as zero (error feedback, `dipaco.codec.feedback`, carries them
to the path's next pseudo-gradient).

**b bits per kept value** = 1 sign bit + (b − 1) bits of magnitude level. Kept entries are the largest
of their chunk, so their magnitudes lie in [lo, hi] = [the smallest, the largest kept magnitude], far
from zero: the L = 2^(b−1) levels are spread evenly over that range, lo + j·step with
step = (hi − lo) / (L − 1), and each magnitude is rounded to the nearest level. So 2 bits = the sign and
one of {lo, hi}; 4 bits = the sign and 8 levels; 8 bits = the sign and 128 levels. Every kept value
comes back within step / 2 of its own, with its own sign; `lo` and `step` are the chunk's two float32
scales. The code of a value is level | sign << (b − 1), packed 8 / b codes per byte, low bits first.

**Indices** are each chunk's kept offsets in ascending order, delta-coded (the first offset, then the
gaps to the previous one, each < 2^16 since a chunk has at most 65,536 elements), stored as uint16
split into a plane of low bytes then a plane of high bytes (the high plane is mostly zeros, which zstd
squeezes). A decoder refuses, naming the tensor and the chunk: a gap of zero after a chunk's first
offset (a duplicate index), an offset past the chunk's end (out of range), a scale that is negative or
not finite, and arrays of the wrong length.

At density 0.03 and 2 bits a kept value costs its 2 bits plus about 6.5 bits of gap after zstd, so a
pseudo-gradient is ~100× smaller than float32 (`python -m dipaco.codec.compress` measures it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (2, 4, 8)
MAX_CHUNK = 1 << 16  # offsets within a chunk fit uint16


@dataclass(frozen=True)
class TopK:
    """How a pseudo-gradient is sparsified: the fraction kept per chunk, bits per kept value, chunk length."""

    density: float  # fraction of each chunk's entries kept, in (0, 1]
    bits: int  # bits per kept value: 2, 4 or 8 (one of them the sign)
    chunk: int  # elements per chunk, at most 65,536

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"top-k density must be in (0, 1], got {self.density!r}")
        if self.bits not in BITS:
            raise ValueError(f"top-k bits must be one of {list(BITS)}, got {self.bits!r}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"top-k chunk must be in [1, {MAX_CHUNK}], got {self.chunk!r}")

    def kept(self, n: int) -> int:
        """Entries kept of a chunk of `n` elements: ceil(density × n), at least one (none of an empty chunk)."""
        return min(n, max(1, math.ceil(self.density * n))) if n > 0 else 0

    def segments(self, numel: int) -> list[tuple[int, int, int]]:
        """The chunks of a tensor of `numel` elements as (chunks, elements each, kept each): the full chunks,
        then the shorter last one if any."""
        full, tail = divmod(numel, self.chunk)
        out = [(full, self.chunk, self.kept(self.chunk))] if full else []
        return out + [(1, tail, self.kept(tail))] if tail else out

    @classmethod
    def of(cls, codec: str, *, density: float, bits: int, chunk: int) -> TopK | None:
        """The sparsification `compression.codec` etc. ask for: None unless the codec is "topk"."""
        return cls(density=density, bits=bits, chunk=chunk) if codec == "topk" else None

    def to_json(self) -> dict:
        return {"density": self.density, "bits": self.bits, "chunk": self.chunk}


def select_chunks(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` (chunks, n) → (offsets (chunks, k) int64 ascending, their values (chunks, k)): each chunk's k
    entries of largest magnitude."""
    offsets = torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
    return offsets, rows.gather(1, offsets)


def quantize_kept(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept values (chunks, k) → (codes (chunks, k) uint8, lo (chunks,), step (chunks,)): sign bit + the
    nearest of 2^(bits−1) magnitude levels lo + j·step spanning the chunk's kept magnitudes."""
    levels = 1 << (bits - 1)
    magnitude = values.abs()
    lo, hi = magnitude.amin(dim=1), magnitude.amax(dim=1)
    step = (hi - lo) / (levels - 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    level = torch.round((magnitude - lo[:, None]) / safe[:, None]).clamp_(0, levels - 1).to(torch.uint8)
    sign = (values < 0).to(torch.uint8)
    return level | (sign << (bits - 1)), lo, step


def dequantize_kept(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (chunks, k) with their chunks' `lo`, `step` → float32 values (chunks, k)."""
    level = (codes & ((1 << (bits - 1)) - 1)).float()
    sign = 1.0 - 2.0 * (codes >> (bits - 1)).float()
    return sign * (lo[:, None] + level * step[:, None])


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits → uint8, 8 / bits per byte, low bits first (the count padded with zeros)."""
    per = 8 // bits
    flat = codes.reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % per)]).reshape(-1, per)
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    return (flat << shifts).sum(dim=1, dtype=torch.uint8) if per > 1 else flat.reshape(-1)


def unpack_codes(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]


def encode_tensor(x: torch.Tensor, spec: TopK) -> dict[str, torch.Tensor]:
    """A tensor → its stored parts: "gaps" (uint8 low plane then high plane of the uint16 delta-coded
    offsets), "codes" (packed), "lo" and "step" (float32, one per chunk)."""
    flat = x.detach().float().reshape(-1)
    gaps, codes, lo, step = [], [], [], []
    start = 0
    for chunks, n, k in spec.segments(flat.numel()):
        rows = flat[start:start + chunks * n].reshape(chunks, n)
        start += chunks * n
        offsets, values = select_chunks(rows, k)
        gaps.append(torch.diff(offsets, dim=1, prepend=torch.zeros(chunks, 1, dtype=torch.int64)).reshape(-1))
        c, low, s = quantize_kept(values, spec.bits)
        codes.append(c.reshape(-1))
        lo.append(low)
        step.append(s)
    gap = torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.int64)
    return {"gaps": torch.cat([gap & 0xFF, gap >> 8]).to(torch.uint8),
            "codes": pack_codes(torch.cat(codes) if codes else torch.zeros(0, dtype=torch.uint8), spec.bits),
            "lo": torch.cat(lo) if lo else torch.zeros(0), "step": torch.cat(step) if step else torch.zeros(0)}


def decode_tensor(parts: dict[str, torch.Tensor], *, shape: list[int], spec: TopK, name: str) -> torch.Tensor:
    """The float32 tensor of `shape` that `parts` (from `encode_tensor`) hold: zero where nothing was kept.
    A ValueError names `name` (and the chunk) when the parts are not a valid encoding of that shape."""
    numel = math.prod(shape)
    segments = spec.segments(numel)
    n_chunks, n_kept = sum(s[0] for s in segments), sum(s[0] * s[2] for s in segments)
    expected = {"gaps": 2 * n_kept, "codes": -(-n_kept * spec.bits // 8), "lo": n_chunks, "step": n_chunks}
    for part, size in expected.items():
        got = parts.get(part)
        if got is None or got.dim() != 1 or got.numel() != size:
            raise ValueError(f"{name}: {part} should hold {size} values for shape {shape}, it has "
                             f"{None if got is None else list(got.shape)}")
    dtypes = {"gaps": torch.uint8, "codes": torch.uint8, "lo": torch.float32, "step": torch.float32}
    for part, dtype in dtypes.items():
        if parts[part].dtype != dtype:
            raise ValueError(f"{name}: {part} is {parts[part].dtype}, not {dtype}")
    lo_all, step_all = parts["lo"], parts["step"]
    for part, scale in (("lo", lo_all), ("step", step_all)):
        bad = ~(torch.isfinite(scale) & (scale >= 0))
        if bool(bad.any()):
            chunk = int(bad.nonzero()[0])
            raise ValueError(f"{name}: chunk {chunk}: scale {part} = {float(scale[chunk])} is not a finite number >= 0")
    gaps_plane = parts["gaps"].to(torch.int64)
    gap_all = gaps_plane[:n_kept] | (gaps_plane[n_kept:] << 8)
    codes_all = unpack_codes(parts["codes"], n_kept, spec.bits)
    out = torch.zeros(numel)
    start = kept = chunk0 = 0
    for chunks, n, k in segments:
        gap = gap_all[kept:kept + chunks * k].reshape(chunks, k)
        _check_offsets(gap, n=n, name=name, first_chunk=chunk0)
        values = dequantize_kept(codes_all[kept:kept + chunks * k].reshape(chunks, k),
                                 lo_all[chunk0:chunk0 + chunks], step_all[chunk0:chunk0 + chunks], spec.bits)
        rows = out[start:start + chunks * n].view(chunks, n)
        rows.scatter_(1, gap.cumsum(dim=1), values)
        start, kept, chunk0 = start + chunks * n, kept + chunks * k, chunk0 + chunks
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name}: decodes to values that are not finite")
    return out.reshape(shape)


def _check_offsets(gap: torch.Tensor, *, n: int, name: str, first_chunk: int) -> None:
    """Refuse duplicate (a zero gap after a chunk's first offset) and out-of-range (past `n`) offsets."""
    duplicate = gap[:, 1:] == 0
    if bool(duplicate.any()):
        row, col = (int(i) for i in duplicate.nonzero()[0])
        raise ValueError(f"{name}: chunk {first_chunk + row}: duplicate index {int(gap[row, :col + 1].sum())}")
    last = gap.sum(dim=1)
    outside = last >= n
    if bool(outside.any()):
        row = int(outside.nonzero()[0])
        raise ValueError(f"{name}: chunk {first_chunk + row}: index {int(last[row])} out of range "
                         f"(the chunk has {n} elements)")
