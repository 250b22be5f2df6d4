"""The routing artifacts' files: written atomically (a temporary name, then a rename), a format version
every reader checks, and fingerprints of tensors and metadata. No pickle.

    write_tensors(path, {"centroids.0": c}); write_json(path, {"format_version": FORMAT_VERSION, ...})
    meta = read_json(path)   # ValueError naming the file on an unknown format_version
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save

FORMAT_VERSION = 1


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path), then rename tmp_path to path (same directory, so the rename is atomic)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(path: Path, obj: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1) + "\n"))


def write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    contiguous = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    data = save(contiguous)  # bytes; written by us so the file mode follows the umask like the JSON
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {meta.get('format_version')!r}; this code reads {FORMAT_VERSION}"
        )
    return meta


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from e


def fingerprint_of(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    h = hashlib.sha256()
    hash_tensors(tensors, h)
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


def hash_tensors(tensors: dict[str, np.ndarray], h: Any) -> None:
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
