"""On-disk shard format: zstd-compressed flat little-endian arrays, checksummed, plus an index.

A shard directory looks like this (``FORMAT_VERSION = 1``)::

    out_dir/
      index.json                       # written LAST: its presence means "complete"
      tokenizer/                       # the tokenizer the shards were made with (save_pretrained)
      path-0000/train-00000.tok.zst    # block shards: flat token array, length = blocks * seq_len
      path-0000/val-00000.tok.zst
      ...
      test/test-00000.tok.zst          # document shard: flat tokens of D documents
      test/test-00000.offsets.zst      # int64 (D + 1,) document boundaries into the flat tokens
      test/test-00000.doc_ids.zst      # int64 (D,) corpus document ids
      test/test-00000.paths.zst        # int64 (D,) path each document was routed to

Every array file is one zstd frame holding the raw little-endian bytes of a 1-D array; its dtype
comes from the index (``token_dtype`` for tokens, int64 for the rest), and the index records the
file's byte size and the sha256 of its (compressed) bytes, which readers verify on every read.

Nothing here runs on its own; the package CLI shows an index: ``python -m sharding info DIR``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
TOKENIZER_DIR = "tokenizer"
TEST_DIR = "test"
ZSTD_LEVEL = 3
TOKEN_DTYPES = ("uint16", "uint32")


class ShardError(ValueError):
    """A shard file or index is missing, corrupt, or inconsistent; the message names the file."""


def token_dtype_for(vocab_size: int) -> str:
    """Smallest token dtype holding ids ``0 .. vocab_size - 1``: "uint16" up to 65536, else "uint32"."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def path_dir_name(path: int) -> str:
    """Directory name of a path's shards, e.g. ``path-0003``."""
    return f"path-{path:04d}"


def _le(dtype: str | np.dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to a temporary file next to ``path`` and ``os.replace`` it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (fsynced: used for index.json)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"), fsync=True)


def write_array(path: str | Path, array: np.ndarray) -> dict[str, Any]:
    """Atomically write a 1-D array as one zstd frame of little-endian bytes.

    Returns ``{"bytes": file size, "sha256": hex digest of the file bytes}`` for the index.
    """
    array = np.asarray(array)
    if array.ndim != 1:
        raise ValueError(f"write_array expects a 1-D array for {path}, got shape {array.shape}")
    raw = np.ascontiguousarray(array, dtype=_le(array.dtype)).tobytes()
    data = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    atomic_write_bytes(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_array(
    path: str | Path, *, dtype: str | np.dtype, sha256: str, length: int | None = None
) -> np.ndarray:
    """Read an array written by :func:`write_array`, verifying the file's sha256 (and ``length``).

    Raises ``FileNotFoundError`` if the file is missing and :class:`ShardError` naming the file on a
    checksum mismatch, a zstd error, or a wrong length.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"shard file {path} is missing")
    return decode_array(path.read_bytes(), where=str(path), dtype=dtype, sha256=sha256, length=length)


def decode_array(
    data: bytes, *, where: str, dtype: str | np.dtype, sha256: str, length: int | None = None
) -> np.ndarray:
    """The array in the bytes of a file written by :func:`write_array` (``where`` names it in errors),
    verified as :func:`read_array` does: for shard bytes that come from elsewhere than a local file."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ShardError(f"shard file {where} is corrupt: sha256 {digest} != {sha256} recorded in the index")
    try:
        raw = zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as e:
        raise ShardError(f"shard file {where} is not a valid zstd frame: {e}") from e
    dt = _le(dtype)
    if len(raw) % dt.itemsize:
        raise ShardError(f"shard file {where} holds {len(raw)} bytes, not a whole number of {dt} items")
    array = np.frombuffer(raw, dtype=dt).astype(np.dtype(dtype), copy=False)
    if length is not None and len(array) != length:
        raise ShardError(f"shard file {where} holds {len(array)} items, the index says {length}")
    return array


SPLITS = ("train", "val")
INDEX_FIELDS = (
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
SPLIT_FIELDS = ("blocks", "tokens", "shards")
BLOCK_SHARD_FIELDS = ("file", "blocks", "tokens", "bytes", "sha256")
DOC_ARRAYS = ("", "offsets_", "doc_ids_", "paths_")  # prefixes of file / bytes / sha256 in a test shard
DOC_SHARD_FIELDS = ("documents", "tokens") + tuple(
    f"{a}{k}" for a in DOC_ARRAYS for k in ("file", "bytes", "sha256")
)


def check_index(index: Any, where: Path) -> None:
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
    _require(index, INDEX_FIELDS, where, "")
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
            _require(entry[split], SPLIT_FIELDS, where, f"paths[{i}].{split}.")
            for j, shard in enumerate(entry[split]["shards"]):
                _require(shard, BLOCK_SHARD_FIELDS, where, f"paths[{i}].{split}.shards[{j}].")
    _require(index["test"], ("documents", "tokens", "too_short", "shards"), where, "test.")
    for j, shard in enumerate(index["test"]["shards"]):
        _require(shard, DOC_SHARD_FIELDS, where, f"test.shards[{j}].")


def _require(obj: Any, fields: Sequence[str], where: Path, prefix: str) -> None:
    if not isinstance(obj, dict):
        raise ShardError(f"{where}: {prefix.rstrip('.') or 'index'} is not an object")
    missing = [f for f in fields if f not in obj]
    if missing:
        raise ShardError(f"{where}: missing field(s) {', '.join(prefix + f for f in missing)}")
