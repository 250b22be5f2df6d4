"""What the workers of an elastic island tell each other inside a round, over their quorum's all-reduce.

    leader = lowest_holder(manager, rank=r, world=w, holds=result is not None)  # the rank that leads the round
    decision = share_json(manager, {"task": ...} if r == leader else None)      # the leader's message, everywhere
    same = same_everywhere(manager, digest_of(pseudo_gradient, carried))        # identical on every member?

torchft's `Manager` offers the quorum's all-reduce only, so every message is a sum in which the other members
add zeros: the leader's bytes, one flag per rank, and a digest with its square (the sums of d and d² over n
members equal n·d and n·d² only when every member holds d). Every member makes the same calls in the same
order; a call after an error in the round returns at once (torchft), and the round then does not commit, so
its result is never used.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import torch
import torch.distributed

MAX_MESSAGE = 1 << 20  # bytes of one leader's message (a task's JSON is a few hundred)


def _sum(manager, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the quorum, in place (torchft: a failed all-reduce leaves it as it was)."""
    manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM).wait()
    return tensor


def lowest_holder(manager, *, rank: int | None, world: int, holds: bool) -> int:
    """The lowest rank of the quorum whose member `holds` (0 when none does)."""
    flags = torch.zeros(max(world, 1), dtype=torch.int64)
    if rank is not None and holds:
        flags[rank] = 1
    held = torch.nonzero(_sum(manager, flags)).flatten().tolist()
    return held[0] if held else 0


def share_json(manager, payload: dict | None) -> dict | None:
    """The one `payload` a member gives (the others give None), on every member; None when the round failed
    before it arrived whole (the round then does not commit)."""
    data = json.dumps(payload).encode() if payload is not None else b""
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"an elastic island's message of {len(data)} bytes is over {MAX_MESSAGE}")
    size = _sum(manager, torch.tensor([len(data)], dtype=torch.int64))
    n = int(size.item())
    if not 0 < n <= MAX_MESSAGE:
        return None
    buffer = torch.zeros(n, dtype=torch.int32)
    if data:
        buffer[: len(data)] = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int32))
    summed = _sum(manager, buffer)
    if int(summed.min()) < 0 or int(summed.max()) > 255:
        return None
    try:
        return json.loads(bytes(summed.to(torch.uint8).numpy()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def digest_of(*groups: dict[str, torch.Tensor]) -> bytes:
    """sha256 of the tensors of `groups` (`{name: tensor}` each), names and dtypes included, in name order."""
    digest = hashlib.sha256()
    for group in groups:
        for name in sorted(group):
            tensor = group[name].detach().cpu().contiguous()
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.digest()


def same_everywhere(manager, digest: bytes) -> bool:
    """Whether every member of the quorum gave this `digest` (32 bytes)."""
    parts = torch.tensor(struct.unpack(">16H", digest[:32]), dtype=torch.int64)  # (16,) each < 2**16
    summed = _sum(manager, torch.cat([parts, parts * parts, torch.ones(1, dtype=torch.int64)]))
    members = summed[-1]
    return bool(torch.equal(summed[:16], members * parts) and torch.equal(summed[16:32], members * parts * parts))
