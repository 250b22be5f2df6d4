"""Shard writers: turn a stream of tokens (or documents) into checksummed shard files.

``BlockWriter`` packs a flat token stream into block-aligned shard files of at most
``tokens_per_shard`` tokens; ``DocumentWriter`` stores whole documents with their boundaries, ids
and routed paths. Both return the per-shard index records (file, counts, bytes, sha256) and keep
the list of files they wrote so a failed build can remove them. Used by ``sharding.build``; see
``python -m sharding --help``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from sharding.format import write_array

logger = logging.getLogger(__name__)


class BlockWriter:
    """Accumulates a flat token stream and writes whole blocks of ``seq_len`` tokens to shard files.

    Files are ``{directory}/{prefix}-{i:05d}.tok.zst``; each holds ``blocks * seq_len`` tokens with
    ``blocks <= max(1, tokens_per_shard // seq_len)``. Index records name files relative to ``root``.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        prefix: str,
        seq_len: int,
        dtype: str,
        tokens_per_shard: int,
        root: str | Path,
    ) -> None:
        self.directory = Path(directory)
        self.root = Path(root)
        self.prefix = prefix
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self.blocks_per_shard = max(1, tokens_per_shard // seq_len)
        self.shards: list[dict[str, Any]] = []
        self.files: list[Path] = []
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def append(self, tokens: np.ndarray) -> None:
        """Add tokens (1-D) to the stream; full shards are written as soon as they are complete."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.prefix}: append expects 1-D tokens, got shape {tokens.shape}")
        if not len(tokens):
            return
        self._buffer.append(tokens.astype(self.dtype, copy=False))
        self._buffered += len(tokens)
        capacity = self.blocks_per_shard * self.seq_len
        if self._buffered >= capacity:
            stream = np.concatenate(self._buffer)
            n_full = len(stream) // capacity
            for i in range(n_full):
                self._write(stream[i * capacity : (i + 1) * capacity])
            rest = stream[n_full * capacity :]
            self._buffer, self._buffered = ([rest] if len(rest) else []), len(rest)

    def close(self) -> np.ndarray:
        """Write the remaining whole blocks; return the tail (< ``seq_len`` tokens) that was not written."""
        stream = np.concatenate(self._buffer) if self._buffer else np.zeros(0, self.dtype)
        n_whole = len(stream) // self.seq_len * self.seq_len
        if n_whole:
            self._write(stream[:n_whole])
        self._buffer, self._buffered = [], 0
        return stream[n_whole:]

    @property
    def num_blocks(self) -> int:
        return sum(s["blocks"] for s in self.shards)

    def _write(self, tokens: np.ndarray) -> None:
        assert len(tokens) % self.seq_len == 0
        path = self.directory / f"{self.prefix}-{len(self.shards):05d}.tok.zst"
        self.files.append(path)
        record = write_array(path, tokens)
        self.shards.append(
            {
                "file": path.relative_to(self.root).as_posix(),
                "blocks": len(tokens) // self.seq_len,
                "tokens": len(tokens),
                **record,
            }
        )


class DocumentWriter:
    """Stores whole documents: per shard a flat token file plus offsets, doc-id and path arrays.

    Files are ``{directory}/{prefix}-{i:05d}.tok.zst`` and ``.offsets.zst`` (int64, D + 1 entries),
    ``.doc_ids.zst`` (int64, D), ``.paths.zst`` (int64, D). A shard is closed once it holds at least
    ``tokens_per_shard`` tokens.
    """

    def __init__(
        self, directory: str | Path, *, prefix: str, dtype: str, tokens_per_shard: int, root: str | Path
    ) -> None:
        self.directory = Path(directory)
        self.root = Path(root)
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self.tokens_per_shard = tokens_per_shard
        self.shards: list[dict[str, Any]] = []
        self.files: list[Path] = []
        self._docs: list[np.ndarray] = []
        self._doc_ids: list[int] = []
        self._paths: list[int] = []
        self._buffered = 0

    def add(self, tokens: np.ndarray, *, doc_id: int, path: int) -> None:
        """Add one document (1-D tokens) with its corpus id and routed path."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"{self.prefix}: document {doc_id} must be 1-D tokens, got shape {tokens.shape}")
        self._docs.append(tokens.astype(self.dtype, copy=False))
        self._doc_ids.append(int(doc_id))
        self._paths.append(int(path))
        self._buffered += len(tokens)
        if self._buffered >= self.tokens_per_shard:
            self._flush()

    def close(self) -> None:
        """Write the last, partly filled shard."""
        if self._docs:
            self._flush()

    def _flush(self) -> None:
        stem = self.directory / f"{self.prefix}-{len(self.shards):05d}"
        lengths = np.array([len(d) for d in self._docs], dtype=np.int64)
        arrays = {
            "": np.concatenate(self._docs),
            "offsets_": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "doc_ids_": np.array(self._doc_ids, dtype=np.int64),
            "paths_": np.array(self._paths, dtype=np.int64),
        }
        suffixes = {
            "": ".tok.zst",
            "offsets_": ".offsets.zst",
            "doc_ids_": ".doc_ids.zst",
            "paths_": ".paths.zst",
        }
        record: dict[str, Any] = {"documents": len(self._docs), "tokens": int(lengths.sum())}
        for key, array in arrays.items():
            path = stem.with_name(stem.name + suffixes[key])
            self.files.append(path)
            written = write_array(path, array)
            record[f"{key}file"] = path.relative_to(self.root).as_posix()
            record[f"{key}bytes"] = written["bytes"]
            record[f"{key}sha256"] = written["sha256"]
        self.shards.append(record)
        self._docs, self._doc_ids, self._paths, self._buffered = [], [], [], 0
