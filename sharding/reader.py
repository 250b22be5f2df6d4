"""Read a shard directory: train/val blocks per path, batches for training, test documents.

``ShardReader(dir)`` loads and checks ``index.json`` (format version, fields), verifies every
file's sha256 as it reads it, and serves:

- ``blocks(path, split)``: all blocks of one path, a list of paths, or every path (None);
- ``iter_batches(path, split, batch_size=, seed=)``: an endless, deterministic stream of full
  ``(B, seq_len)`` int64 batches, one epoch after another, read one shard per path at a time;
- ``test_documents()``: the held-out documents with their ids and routed paths.

``ShardReader(dir, fetch=f)`` reads only ``index.json`` from ``dir`` and gets each shard file's bytes
from ``f(file, sha256)`` when it first needs them (an island that downloads only its paths' shards from
a store: ``dipaco.pipeline.published``); they are verified the same way.

CPU example: ``python -c "from sharding.reader import ShardReader; r = ShardReader('shards'); \
print(next(r.iter_batches(0, 'train', batch_size=4, seed=0)).shape)"``.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sharding.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    TOKEN_DTYPES,
    ShardError,
    decode_array,
    read_array,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

SPLITS = ("train", "val")
PathSpec = int | Sequence[int] | None

_INDEX_FIELDS = (
    "seq_len",
    "token_dtype",
    "vocab_size",
    "eos_token_id",
    "tokenizer_fingerprint",
    "router_fingerprint",
    "n_paths",
    "paths",
    "test",
)
_SPLIT_FIELDS = ("blocks", "tokens", "shards")
_BLOCK_SHARD_FIELDS = ("file", "blocks", "tokens", "bytes", "sha256")
_DOC_ARRAYS = ("", "offsets_", "doc_ids_", "paths_")  # prefixes of file / bytes / sha256 in a test shard
_DOC_SHARD_FIELDS = ("documents", "tokens") + tuple(
    f"{a}{k}" for a in _DOC_ARRAYS for k in ("file", "bytes", "sha256")
)
# Tags that keep the seeded generators of iter_batches apart.
_TAG_INTERLEAVE, _TAG_SHARD_ORDER, _TAG_BLOCK_ORDER = 1, 2, 3


class ShardReader:
    """Read-only view of a shard directory written by :func:`sharding.build.build_shards`."""

    def __init__(
        self, directory: str | Path, *, fetch: Callable[[str, str], bytes] | None = None
    ) -> None:
        self.directory = Path(directory)
        self.fetch = fetch  # (file, sha256) -> the file's bytes; None: read them from `directory`
        self.index_path = self.directory / INDEX_NAME
        if not self.index_path.is_file():
            raise FileNotFoundError(
                f"{self.index_path} not found: {self.directory} is not a complete shard directory"
            )
        try:
            index = json.loads(self.index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShardError(f"{self.index_path} is not valid JSON: {e}") from e
        _check_index(index, self.index_path)
        self.index: dict[str, Any] = index
        self.seq_len: int = index["seq_len"]
        self.n_paths: int = index["n_paths"]
        self.token_dtype: str = index["token_dtype"]
        self.vocab_size: int = index["vocab_size"]
        self.eos_token_id: int = index["eos_token_id"]
        self.tokenizer_fingerprint: str = index["tokenizer_fingerprint"]
        self.router_fingerprint: str = index["router_fingerprint"]

    def __repr__(self) -> str:
        return f"ShardReader({str(self.directory)!r}, n_paths={self.n_paths}, seq_len={self.seq_len})"

    # ----------------------------------------------------------------------------- checks
    def check_fingerprints(self, *, tokenizer: str | None = None, router: str | None = None) -> None:
        """Raise :class:`ShardError` if a given fingerprint differs from the one in index.json."""
        for name, given, stored in (
            ("tokenizer", tokenizer, self.tokenizer_fingerprint),
            ("router", router, self.router_fingerprint),
        ):
            if given is not None and given != stored:
                raise ShardError(
                    f"{self.index_path}: shards were built with {name} fingerprint {stored}, "
                    f"but the {name} in use has {given}; rebuild the shards"
                )

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer saved with the shards, checked against the index's fingerprint."""
        from sharding.tokenizer import load_tokenizer, tokenizer_fingerprint

        tokenizer = load_tokenizer(self.directory / self.index.get("tokenizer_dir", "tokenizer"))
        self.check_fingerprints(tokenizer=tokenizer_fingerprint(tokenizer))
        return tokenizer

    def verify(self) -> int:
        """Read every file of the directory, checking sizes and checksums; return the number of files."""
        n = 0
        for p in range(self.n_paths):
            for split in SPLITS:
                for shard in self._shards(p, split):
                    self._read_blocks(shard)
                    n += 1
        for shard in self.index["test"]["shards"]:
            self._read_documents(shard)
            n += len(_DOC_ARRAYS)
        return n

    # ----------------------------------------------------------------------------- counts
    def num_blocks(self, path: PathSpec, split: str) -> int:
        """Blocks of ``split`` ("train" or "val") in one path, a list of paths, or all paths (None)."""
        return sum(self.index["paths"][p][self._split(split)]["blocks"] for p in self._path_ids(path))

    def num_tokens(self, path: PathSpec, split: str) -> int:
        """Tokens of ``split`` in the given path(s): ``num_blocks * seq_len``."""
        return self.num_blocks(path, split) * self.seq_len

    # ----------------------------------------------------------------------------- data
    def blocks(self, path: PathSpec, split: str) -> np.ndarray:
        """All blocks (n, seq_len) int64 of the given path(s) and split, in path then storage order.

        Loads everything asked for into memory: meant for validation sets, not training streams.
        """
        parts = [self._read_blocks(s) for p in self._path_ids(path) for s in self._shards(p, split)]
        if not parts:
            return np.zeros((0, self.seq_len), dtype=np.int64)
        return np.concatenate(parts).astype(np.int64)

    def iter_batches(
        self,
        path: PathSpec,
        split: str,
        *,
        batch_size: int,
        seed: int,
        epoch_shuffle: bool = True,
        skip_batches: int = 0,
    ) -> Iterator[np.ndarray]:
        """Endless stream of full (batch_size, seq_len) int64 batches; a pure function of its arguments.

        Each epoch visits every block of the chosen paths exactly once; epoch ``e`` shuffles, per
        path, the shard order and the blocks within each shard, and interleaves the paths in a
        random order (generators seeded by ``seed``, ``e``, the path and the shard). Only one shard
        per path is decompressed at a time. Batches are always full: one may span the end of an
        epoch and the start of the next. ``epoch_shuffle=False`` reads paths, shards and blocks in
        stored order every epoch.

        Resuming: ``skip_batches=k`` yields exactly the batches ``k, k+1, ...`` of the same stream,
        skipping whole shards without reading them. Alternatively pass a fresh ``seed`` per round.
        """
        paths = self._path_ids(path)
        split = self._split(split)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0 or skip_batches < 0:
            raise ValueError(
                f"seed and skip_batches must be >= 0, got seed={seed} skip_batches={skip_batches}"
            )
        counts = np.array([self.num_blocks(p, split) for p in paths], dtype=np.int64)
        if counts.sum() == 0:
            raise ShardError(f"{self.index_path}: no {split} blocks in paths {paths}")
        return self._batches(
            paths,
            split,
            counts,
            batch_size=batch_size,
            seed=seed,
            shuffle=epoch_shuffle,
            skip=skip_batches * batch_size,
        )

    def test_documents(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Test documents (each int64, at most seq_len tokens), their doc ids (D,) and routed paths (D,)."""
        docs: list[np.ndarray] = []
        ids, paths = [], []
        for shard in self.index["test"]["shards"]:
            tokens, offsets, doc_ids, doc_paths = self._read_documents(shard)
            tokens = tokens.astype(np.int64)
            docs += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            ids.append(doc_ids)
            paths.append(doc_paths)
        empty = np.zeros(0, dtype=np.int64)
        return docs, np.concatenate([empty, *ids]), np.concatenate([empty, *paths])

    # ----------------------------------------------------------------------------- internals
    def _path_ids(self, path: PathSpec) -> list[int]:
        if path is None:
            return list(range(self.n_paths))
        ids = [path] if isinstance(path, Integral) else list(path)
        if not ids:
            raise ValueError("path must be an id, a non-empty list of ids, or None (all paths); got []")
        for p in ids:
            if not isinstance(p, Integral) or not 0 <= p < self.n_paths:
                raise ValueError(f"path {p!r} is not in [0, {self.n_paths}) of {self.index_path}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"path list {ids} repeats a path")
        return [int(p) for p in ids]

    def _split(self, split: str) -> str:
        if split not in SPLITS:
            raise ValueError(
                f"split must be one of {SPLITS}, got {split!r} (test documents: test_documents())"
            )
        return split

    def _shards(self, path: int, split: str) -> list[dict[str, Any]]:
        return self.index["paths"][path][self._split(split)]["shards"]

    def _read_blocks(self, shard: dict[str, Any]) -> np.ndarray:
        """One block shard as (blocks, seq_len) in the token dtype."""
        tokens = self._array(shard["file"], dtype=self.token_dtype, sha256=shard["sha256"], length=shard["tokens"])
        if shard["tokens"] != shard["blocks"] * self.seq_len:
            raise ShardError(
                f"{self.index_path}: shard {shard['file']} has {shard['tokens']} tokens, "
                f"not {shard['blocks']} blocks of {self.seq_len}"
            )
        return tokens.reshape(-1, self.seq_len)

    def _array(self, file: str, *, dtype: Any, sha256: str, length: int) -> np.ndarray:
        """One array file of the index, from ``directory`` or through ``fetch``, verified."""
        if self.fetch is None:
            return read_array(self.directory / file, dtype=dtype, sha256=sha256, length=length)
        data = self.fetch(file, sha256)
        return decode_array(data, where=file, dtype=dtype, sha256=sha256, length=length)

    def _read_documents(self, shard: dict[str, Any]) -> tuple[np.ndarray, ...]:
        n, n_tokens = shard["documents"], shard["tokens"]
        lengths = {"": n_tokens, "offsets_": n + 1, "doc_ids_": n, "paths_": n}
        arrays = tuple(
            self._array(
                shard[f"{a}file"],
                dtype=self.token_dtype if a == "" else np.int64,
                sha256=shard[f"{a}sha256"],
                length=lengths[a],
            )
            for a in _DOC_ARRAYS
        )
        offsets = arrays[1]
        if offsets[0] != 0 or offsets[-1] != n_tokens or (np.diff(offsets) < 0).any():
            raise ShardError(
                f"{self.directory / shard['offsets_file']}: offsets are not a partition of {n_tokens} tokens"
            )
        return arrays

    def _batches(
        self,
        paths: list[int],
        split: str,
        counts: np.ndarray,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        skip: int,
    ) -> Iterator[np.ndarray]:
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
            streams = [_PathStream(self, p, split, seed=seed, epoch=epoch, shuffle=shuffle) for p in paths]
            for stream, n in zip(streams, np.bincount(labels[:pos], minlength=len(paths)), strict=True):
                stream.skip(int(n))
            while pos < total:
                take = min(batch_size - n_pending, total - pos)
                pending.append(self._gather(streams, labels[pos : pos + take]))
                n_pending += take
                pos += take
                if n_pending == batch_size:
                    yield np.concatenate(pending).astype(np.int64)  # (B, seq_len)
                    pending, n_pending = [], 0
            epoch, pos = epoch + 1, 0

    def _gather(self, streams: list[_PathStream], labels: np.ndarray) -> np.ndarray:
        out = np.empty((len(labels), self.seq_len), dtype=self.token_dtype)  # (m, seq_len)
        for i in np.unique(labels):
            where = np.flatnonzero(labels == i)
            out[where] = streams[i].take(len(where))
        return out


class _PathStream:
    """One epoch of one path's blocks: shards in a seeded order, blocks shuffled within each shard."""

    def __init__(
        self, reader: ShardReader, path: int, split: str, *, seed: int, epoch: int, shuffle: bool
    ) -> None:
        self.reader = reader
        self.shards = reader._shards(path, split)
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
        self.blocks = self.reader._read_blocks(self.shards[i])
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


def _check_index(index: Any, where: Path) -> None:
    """Refuse an index.json of another format version or with missing fields, naming the file."""
    if not isinstance(index, dict):
        raise ShardError(f"{where}: expected a JSON object, got {type(index).__name__}")
    if "format_version" not in index:
        raise ShardError(f"{where}: missing field 'format_version'")
    if index["format_version"] != FORMAT_VERSION:
        raise ShardError(
            f"{where}: unknown format_version {index['format_version']!r} (this reader knows "
            f"{FORMAT_VERSION}); rebuild the shards or update dipaco"
        )
    _require(index, _INDEX_FIELDS, where, "")
    if index["token_dtype"] not in TOKEN_DTYPES:
        raise ShardError(f"{where}: token_dtype {index['token_dtype']!r} not in {TOKEN_DTYPES}")
    if len(index["paths"]) != index["n_paths"]:
        raise ShardError(
            f"{where}: n_paths is {index['n_paths']} but 'paths' has {len(index['paths'])} entries"
        )
    for i, entry in enumerate(index["paths"]):
        _require(entry, ("path", *SPLITS), where, f"paths[{i}].")
        if entry["path"] != i:
            raise ShardError(f"{where}: paths[{i}] is for path {entry['path']}")
        for split in SPLITS:
            _require(entry[split], _SPLIT_FIELDS, where, f"paths[{i}].{split}.")
            for j, shard in enumerate(entry[split]["shards"]):
                _require(shard, _BLOCK_SHARD_FIELDS, where, f"paths[{i}].{split}.shards[{j}].")
    _require(index["test"], ("documents", "tokens", "too_short", "shards"), where, "test.")
    for j, shard in enumerate(index["test"]["shards"]):
        _require(shard, _DOC_SHARD_FIELDS, where, f"test.shards[{j}].")


def _require(obj: Any, fields: Sequence[str], where: Path, prefix: str) -> None:
    if not isinstance(obj, dict):
        raise ShardError(f"{where}: {prefix.rstrip('.') or 'index'} is not an object")
    missing = [f for f in fields if f not in obj]
    if missing:
        raise ShardError(f"{where}: missing field(s) {', '.join(prefix + f for f in missing)}")
