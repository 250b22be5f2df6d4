"""The training stream of a shard directory: endless full batches, epoch after epoch, one shard per path
in memory at a time (`ShardReader.iter_batches`).

Epoch e interleaves the paths' blocks in a seeded order; each path reads its shards in a seeded order
and its blocks shuffled within each shard (generators seeded by the seed, e, the path and the shard).
Skipping k blocks skips whole shards without reading them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np

from sharding.shard_files import ShardFiles

# Tags that keep the seeded generators of iter_batches apart.
_TAG_INTERLEAVE, _TAG_SHARD_ORDER, _TAG_BLOCK_ORDER = 1, 2, 3


def batch_stream(
    files: ShardFiles,
    paths: list[int],
    split: str,
    counts: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool,
    skip: int,
) -> Iterator[np.ndarray]:
    """The batches of `paths` (`counts` blocks each) from block `skip` on (`ShardReader.iter_batches`)."""
    total = int(counts.sum())
    epoch, pos = divmod(skip, total)
    pending: list[np.ndarray] = []
    n_pending = 0
    while True:
        labels = np.repeat(
            np.arange(len(paths), dtype=np.int32), counts
        )  # (total,) which path each slot reads
        if shuffle and len(paths) > 1:
            np.random.default_rng([_TAG_INTERLEAVE, epoch, 0, 0, seed]).shuffle(labels)
        streams = [PathStream(files, p, split, seed=seed, epoch=epoch, shuffle=shuffle) for p in paths]
        for stream, n in zip(streams, np.bincount(labels[:pos], minlength=len(paths)), strict=True):
            stream.skip(int(n))
        while pos < total:
            take = min(batch_size - n_pending, total - pos)
            pending.append(_gather(files.seq_len, files.token_dtype, streams, labels[pos : pos + take]))
            n_pending += take
            pos += take
            if n_pending == batch_size:
                yield np.concatenate(pending).astype(np.int64)  # (B, seq_len)
                pending, n_pending = [], 0
        epoch, pos = epoch + 1, 0


def _gather(seq_len: int, dtype: str, streams: list[PathStream], labels: np.ndarray) -> np.ndarray:
    out = np.empty((len(labels), seq_len), dtype=dtype)  # (m, seq_len)
    for i in np.unique(labels):
        where = np.flatnonzero(labels == i)
        out[where] = streams[i].take(len(where))
    return out


class PathStream:
    """One epoch of one path's blocks: shards in a seeded order, blocks shuffled within each shard."""

    def __init__(
        self, files: ShardFiles, path: int, split: str, *, seed: int, epoch: int, shuffle: bool
    ) -> None:
        self.files = files
        self.shards = files.shards(path, split)
        self.path, self.seed, self.epoch, self.shuffle = path, seed, epoch, shuffle
        order = np.arange(len(self.shards))
        if shuffle:
            order = np.random.default_rng([_TAG_SHARD_ORDER, epoch, path, 0, seed]).permutation(
                len(self.shards)
            )
        self.queue: deque[int] = deque(int(i) for i in order)
        self.blocks: np.ndarray | None = None
        self.order = np.zeros(0, dtype=np.int64)
        self.pos = 0

    def skip(self, k: int) -> None:
        while k > 0:
            if self.blocks is None:
                n = self.shards[self.queue[0]]["blocks"]
                if k >= n:  # skip a whole shard without reading it
                    self.queue.popleft()
                    k -= n
                    continue
                self._load()
            r = min(k, len(self.order) - self.pos)
            self._advance(r)
            k -= r

    def take(self, k: int) -> np.ndarray:
        parts = []
        while k > 0:
            if self.blocks is None:
                self._load()
            r = min(k, len(self.order) - self.pos)
            parts.append(self.blocks[self.order[self.pos : self.pos + r]])
            self._advance(r)
            k -= r
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _load(self) -> None:
        i = self.queue.popleft()
        self.blocks = self.files.read_blocks(self.shards[i])
        n = len(self.blocks)
        if self.shuffle:
            self.order = np.random.default_rng(
                [_TAG_BLOCK_ORDER, self.epoch, self.path, i, self.seed]
            ).permutation(n)
        else:
            self.order = np.arange(n)
        self.pos = 0

    def _advance(self, r: int) -> None:
        self.pos += r
        if self.pos == len(self.order):
            self.blocks = None
