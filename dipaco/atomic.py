"""Atomic local writes: readers see the old file or the whole new one, never a half-written file.

    from dipaco.atomic import write_json, write_text, write_bytes, replacing
    write_json(run.eval_results, results)

The data goes to a temporary sibling (`<name>.tmp-<random>`), is flushed, then renamed over the
target; a failed write (a full disk) removes the temporary file and names the target in its OSError. Files in the module store go through `dipaco.store` instead (it also handles object stores).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (parent directories are created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a full disk says only "No space left on device": name the file
        raise OSError(err.errno, f"{err.strerror or err} (writing {len(data):,} bytes)", str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> Path:
    return write_text(path, json.dumps(obj, indent=indent))


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of `path` for writers that need a file name (a memory-mapped array, a
    safetensors file): renamed over `path` when the block ends, removed if the block raises.

        with replacing(out) as tmp:
            features = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, d))
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
