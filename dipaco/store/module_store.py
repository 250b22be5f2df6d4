"""The module store: the only medium between the coordinator and the islands.

An fsspec URL (a local directory by default; `s3://…`, `gs://…` or a shared filesystem when islands
sit on different machines). Layout under the root:

    state.json                               last completed round (written last: the commit point)
    modules/round-000003/<module>.safetensors   every module after round 3's outer step
    outer/round-000003/<module>.safetensors     the outer optimiser's momentum after round 3
    results/round-000004/path-0002.safetensors  an island's pseudo-gradient for round 4 (+ .json)
    islands/path-0002/inner-round-000004.safetensors  that path's AdamW state after round 4 (dipaco.store.board)

Each file has one writer: the coordinator writes `state.json`, `modules/` and `outer/`; an island
writes only its own results and inner state. Writes are atomic (a temporary name then a rename on
local disks, a single put on object stores), and a result's JSON is written after its tensors, so
whatever a reader finds complete is complete. Tensors are safetensors, never pickle.

    store = ModuleStore("runs/demo/store")
    store.write_module(0, "embeddings", {"model.embed_tokens.weight": w})
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

log = logging.getLogger(__name__)

STORE_VERSION = 1


class StoreError(RuntimeError):
    """A store file is missing, corrupt or of an unknown version."""


class ModuleStore:
    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.bytes_written = 0
        self.bytes_read = 0

    # --- raw files -------------------------------------------------------------------------------
    def _path(self, relative: str) -> str:
        return f"{self.root.rstrip('/')}/{relative}"

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self._path(relative))

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Atomically write a file: readers see the old file, or the whole new one."""
        target = self._path(relative)
        parent = target.rsplit("/", 1)[0]
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, target)
        else:
            self.fs.pipe_file(target, data)  # an object-store put is atomic
        self.bytes_written += len(data)

    def read_bytes(self, relative: str) -> bytes:
        try:
            data = self.fs.cat_file(self._path(relative))
        except FileNotFoundError:
            raise StoreError(f"store file {self._path(relative)} does not exist") from None
        self.bytes_read += len(data)
        return data

    def write_json(self, relative: str, obj: Any) -> None:
        self.write_bytes(relative, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, relative: str) -> Any:
        data = self.read_bytes(relative)
        try:
            return json.loads(data)
        except json.JSONDecodeError as err:
            raise StoreError(f"store file {self._path(relative)} is not valid JSON: {err}") from None

    def write_tensors(self, relative: str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        self.write_bytes(relative, data)
        return len(data)

    def read_tensors(self, relative: str) -> dict[str, torch.Tensor]:
        return self._decode_tensors(self.read_bytes(relative), relative)

    def _decode_tensors(self, data: bytes, relative: str) -> dict[str, torch.Tensor]:
        try:
            return load_safetensors(data)
        except Exception as err:  # safetensors raises its own error types
            raise StoreError(f"store file {self._path(relative)} is not a valid safetensors file: {err}") from None

    def remove_dir(self, relative: str) -> None:
        if self.exists(relative):
            self.fs.rm(self._path(relative), recursive=True)

    # --- run state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The committed state, or None for an empty store."""
        if not self.exists("state.json"):
            return None
        state = self.read_json("state.json")
        if state.get("store_version") != STORE_VERSION:
            raise StoreError(
                f"{self._path('state.json')} has store_version {state.get('store_version')!r}; "
                f"this dipaco reads version {STORE_VERSION}"
            )
        return state

    def commit(self, *, round: int, **meta: Any) -> None:
        """Mark `round` complete; written after every file of that round."""
        self.write_json("state.json", {"store_version": STORE_VERSION, "round": round, **meta})

    def current_round(self) -> int:
        state = self.state()
        if state is None:
            raise StoreError(f"store {self.url} is empty: run `dipaco train` to initialise it")
        return int(state["round"])

    # --- modules and outer state -----------------------------------------------------------------
    def write_module(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.write_tensors(f"modules/round-{round:06d}/{name}.safetensors", tensors)

    def read_module(self, round: int, name: str) -> dict[str, torch.Tensor]:
        return self.read_tensors(f"modules/round-{round:06d}/{name}.safetensors")

    def read_modules(self, round: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Several modules of version `round`, e.g. every module of one path."""
        return {name: self.read_module(round, name) for name in names}

    def write_outer_state(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.write_tensors(f"outer/round-{round:06d}/{name}.safetensors", tensors)

    def read_outer_state(self, round: int, name: str) -> dict[str, torch.Tensor] | None:
        relative = f"outer/round-{round:06d}/{name}.safetensors"
        return self.read_tensors(relative) if self.exists(relative) else None

    def prune(self, *, keep_from: int, folders: tuple[str, ...] = ("modules", "outer", "results")) -> None:
        """Delete module, outer-state and result versions older than round `keep_from` (in `folders`)."""
        for folder in folders:
            if not self.exists(folder):
                continue
            for entry in self.fs.ls(self._path(folder), detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if name.startswith("round-") and int(name[6:]) < keep_from:
                    self.fs.rm(entry, recursive=True)

    # --- island results --------------------------------------------------------------------------
    def _result(self, round: int, path: int) -> str:
        return f"results/round-{round:06d}/path-{path:04d}"

    def write_result(self, round: int, path: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
        """An island's pseudo-gradient and metadata; returns the bytes sent for the tensors."""
        sent = self.write_tensors(self._result(round, path) + ".safetensors", tensors)
        self.write_json(self._result(round, path) + ".json", {**meta, "bytes": sent})
        return sent

    def has_result(self, round: int, path: int) -> bool:
        return self.exists(self._result(round, path) + ".json")

    def read_result(self, round: int, path: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        meta = self.read_json(self._result(round, path) + ".json")
        return self.read_tensors(self._result(round, path) + ".safetensors"), meta

    def read_result_meta(self, round: int, path: int) -> dict[str, Any]:
        return self.read_json(self._result(round, path) + ".json")

    # --- tensors with JSON metadata in one file (inner optimiser states) -----------------------------
    def write_tensors_with_meta(self, relative: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
        """One file, the metadata in its safetensors header, so tensors and metadata never disagree."""
        return self.write_tensors(relative, tensors, {"meta": json.dumps(meta)})

    def read_tensors_with_meta(self, relative: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        data = self.read_bytes(relative)
        try:
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["meta"])
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            raise StoreError(f"store file {self._path(relative)} has no valid metadata: {err}") from None
        return self._decode_tensors(data, relative), meta
