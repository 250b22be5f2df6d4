"""Read a shard directory: train/val blocks per path, batches for training, test documents.

``ShardReader(dir)`` loads and checks ``index.json`` (format version, fields), verifies every
file's sha256 as it reads it, and serves:

- ``blocks(path, split)``: all blocks of one path, a list of paths, or every path (None);
- ``iter_batches(path, split, batch_size=, seed=)``: an endless, deterministic stream of full
  ``(B, seq_len)`` int64 batches, one epoch after another, read one shard per path at a time;
- ``test_documents()``: the held-out documents with their ids and routed paths.

``ShardReader(dir, fetch=f)`` reads only ``index.json`` from ``dir`` and gets each shard file's bytes
from ``f(file, sha256)`` when it first needs them (an island that downloads only its paths' shards from
a store: ``dipaco.pipeline.published``); they are verified the same way (``shard_files``). The training
stream is ``batches``; ``format.check_index`` refuses an index of another version or with fields missing.

CPU example: ``python -c "from sharding.reader import ShardReader; r = ShardReader('shards'); \
print(next(r.iter_batches(0, 'train', batch_size=4, seed=0)).shape)"``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sharding.batches import batch_stream
from sharding.format import DOC_ARRAYS, INDEX_NAME, SPLITS, ShardError, check_index
from sharding.shard_files import ShardFiles

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PathSpec = int | Sequence[int] | None


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
        check_index(index, self.index_path)
        self.index: dict[str, Any] = index
        self.seq_len: int = index["seq_len"]
        self.n_paths: int = index["n_paths"]
        self.token_dtype: str = index["token_dtype"]
        self.vocab_size: int = index["vocab_size"]
        self.eos_token_id: int = index["eos_token_id"]
        self.tokenizer_fingerprint: str = index["tokenizer_fingerprint"]
        self.router_fingerprint: str = index["router_fingerprint"]
        self.files = ShardFiles(self.directory, index, index_path=self.index_path, fetch=fetch)

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
                for shard in self.shards_of(p, split):
                    self.files.read_blocks(shard)
                    n += 1
        for shard in self.index["test"]["shards"]:
            self.files.read_documents(shard)
            n += len(DOC_ARRAYS)
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
        parts = [self.files.read_blocks(s) for p in self._path_ids(path) for s in self.shards_of(p, split)]
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
        return batch_stream(
            self.files,
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
        return self.files.test_documents()

    # ----------------------------------------------------------------------------- internals
    def _path_ids(self, path: PathSpec) -> list[int]:
        return path_ids(path, n_paths=self.n_paths, where=self.index_path)

    def _split(self, split: str) -> str:
        if split not in SPLITS:
            raise ValueError(
                f"split must be one of {SPLITS}, got {split!r} (test documents: test_documents())"
            )
        return split

    def shards_of(self, path: int, split: str) -> list[dict[str, Any]]:
        return self.files.shards(path, self._split(split))


def path_ids(path: PathSpec, *, n_paths: int, where: Path) -> list[int]:
    """The path ids `path` names (an id, a list of ids, or None: all), each checked against `n_paths`."""
    if path is None:
        return list(range(n_paths))
    ids = [path] if isinstance(path, Integral) else list(path)
    if not ids:
        raise ValueError("path must be an id, a non-empty list of ids, or None (all paths); got []")
    for p in ids:
        if not isinstance(p, Integral) or not 0 <= p < n_paths:
            raise ValueError(f"path {p!r} is not in [0, {n_paths}) of {where}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"path list {ids} repeats a path")
    return [int(p) for p in ids]
