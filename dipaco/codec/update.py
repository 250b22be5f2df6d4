"""A module's published update: how the coordinator encodes the step from version v to v+1, and the one
function that applies it, which the coordinator and the islands both run (`compression.download: update`).

    codec = download_codec(cfg.compression)                # dipaco.islands.update_codec; None: download full
    data, d, residual, stats = encode_update(before, after, module="embeddings", codec=codec, residual=r)
    committed = apply_update(before, data, module="embeddings", codec=codec)   # v+1 := v − d (coordinator, islands)

u = before − after (float32, CPU), the step the outer update took; a = u + r adds the module's download
residual r (what earlier encodings left out; absent = 0); data = codec.encode(a), d = codec.decode(data), and
the new residual is a − d. With codec `none`, d = u exactly (the float32 bytes) and no residual is left. The
committed version is before − d computed by `apply_update`, in a fixed order (the parameters' names, sorted),
in float32 on the CPU, so an island that holds version v and applies the same bytes rebuilds version v+1 bit
for bit (its safetensors sha256 equals the committed checksum: `dipaco.islands.island.held_modules`).
Tensors are named as in a module file (`{param: tensor}`); the encoded bytes hold them as "module/param".
"""

from __future__ import annotations

import torch

from dipaco.codec.codec import Codec

FLOAT32 = Codec("none")  # the final flush's update: the residual in full


def encode_update(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], *, module: str, codec: Codec,
                  residual: dict[str, torch.Tensor] | None = None
                  ) -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(the update's bytes, d as decoded `{param: tensor}`, the new residual a − d (empty for codec none),
    the codec's stats) for module `module` stepping from `before` to `after` (`{param: tensor}`)."""
    r = residual or {}
    a = {p: before[p].float().cpu() - after[p].float().cpu() + (r[p].float() if p in r else 0.0)
         for p in sorted(before)}
    data, stats = codec.encode({f"{module}/{p}": t for p, t in a.items()})
    d = decode_update(data, module=module, codec=codec, shapes={p: list(t.shape) for p, t in a.items()})
    left = {} if codec.name == "none" else {p: a[p] - d[p] for p in a}
    return data, d, left, stats


def decode_update(data: bytes, *, module: str, codec: Codec, shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The float32 d `{param: tensor}` of module `module` that `data` holds (exactly the `shapes`, else ValueError)."""
    tensors = codec.decode(data, shapes={f"{module}/{p}": s for p, s in shapes.items()})
    return {p: tensors[f"{module}/{p}"] for p in sorted(shapes)}


def apply_update(before: dict[str, torch.Tensor], data: bytes, *, module: str, codec: Codec) -> dict[str, torch.Tensor]:
    """Version v+1 of module `module` = `before` (version v, `{param: tensor}`) − d, d decoded from `data`:
    float32, CPU, the parameters in sorted order (the coordinator and every island run this)."""
    d = decode_update(data, module=module, codec=codec, shapes={p: list(t.shape) for p, t in before.items()})
    return {p: before[p].float().cpu() - d[p] for p in sorted(before)}
