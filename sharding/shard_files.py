"""The files a shard index lists, read from the shard directory or through `fetch` (a store-only run's
shards, `dipaco.pipeline.published`), each verified against the index's size and sha256.

    files = ShardFiles(directory, index, index_path=directory / "index.json", fetch=None)
    files.read_blocks(files.shards(0, "train")[0])   # (blocks, seq_len) in the token dtype
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sharding.format import DOC_ARRAYS, ShardError, decode_array, read_array


class ShardFiles:
    def __init__(self, directory: Path, index: dict[str, Any], *, index_path: Path,
                 fetch: Callable[[str, str], bytes] | None):
        self.directory, self.index, self.index_path = directory, index, index_path
        self.fetch = fetch  # (file, sha256) -> the file's bytes; None: read them from `directory`
        self.seq_len: int = index["seq_len"]
        self.token_dtype: str = index["token_dtype"]

    def shards(self, path: int, split: str) -> list[dict[str, Any]]:
        """The block shards of `path`'s `split` ("train" or "val") as the index lists them."""
        return self.index["paths"][path][split]["shards"]

    def read_blocks(self, shard: dict[str, Any]) -> np.ndarray:
        """One block shard as (blocks, seq_len) in the token dtype."""
        tokens = self.array(shard["file"], dtype=self.token_dtype, sha256=shard["sha256"], length=shard["tokens"])
        if shard["tokens"] != shard["blocks"] * self.seq_len:
            raise ShardError(
                f"{self.index_path}: shard {shard['file']} has {shard['tokens']} tokens, "
                f"not {shard['blocks']} blocks of {self.seq_len}"
            )
        return tokens.reshape(-1, self.seq_len)

    def array(self, file: str, *, dtype: Any, sha256: str, length: int) -> np.ndarray:
        """One array file of the index, from ``directory`` or through ``fetch``, verified."""
        if self.fetch is None:
            return read_array(self.directory / file, dtype=dtype, sha256=sha256, length=length)
        data = self.fetch(file, sha256)
        return decode_array(data, where=file, dtype=dtype, sha256=sha256, length=length)

    def read_documents(self, shard: dict[str, Any]) -> tuple[np.ndarray, ...]:
        n, n_tokens = shard["documents"], shard["tokens"]
        lengths = {"": n_tokens, "offsets_": n + 1, "doc_ids_": n, "paths_": n}
        arrays = tuple(
            self.array(
                shard[f"{a}file"],
                dtype=self.token_dtype if a == "" else np.int64,
                sha256=shard[f"{a}sha256"],
                length=lengths[a],
            )
            for a in DOC_ARRAYS
        )
        offsets = arrays[1]
        if offsets[0] != 0 or offsets[-1] != n_tokens or (np.diff(offsets) < 0).any():
            raise ShardError(
                f"{self.directory / shard['offsets_file']}: offsets are not a partition of {n_tokens} tokens"
            )
        return arrays

    def test_documents(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Test documents (each int64, at most seq_len tokens), their doc ids (D,) and routed paths (D,)."""
        docs: list[np.ndarray] = []
        ids, paths = [], []
        for shard in self.index["test"]["shards"]:
            tokens, offsets, doc_ids, doc_paths = self.read_documents(shard)
            tokens = tokens.astype(np.int64)
            docs += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            ids.append(doc_ids)
            paths.append(doc_paths)
        empty = np.zeros(0, dtype=np.int64)
        return docs, np.concatenate([empty, *ids]), np.concatenate([empty, *paths])
