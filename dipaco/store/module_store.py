"""The module store: the only medium between the coordinator and the islands, and the only code (with
the rest of `dipaco.store`) that knows its file names.

An fsspec URL (a local directory by default; `s3://…`, `gs://…` or a shared filesystem when islands
sit on different machines). Layout under the root:

    state.json                                  last completed round (written last: the commit point)
    modules/round-000003/<module>.safetensors   every module after round 3's outer step
    modules/round-000003/checksums.json         the sha256 of each of those files (written at the commit)
    outer/round-000003/<module>.safetensors     the outer optimiser's momentum after round 3
    best.json                                   validation loss per path and version (dipaco.eval.early_stopping)
    tasks.json, rounds/, heartbeats/, results/, islands/   the task board (dipaco.store.board)
    lease.json                                  the coordinator's lease and fencing token (dipaco.store.lease)

Each file has one writer: the coordinator writes `state.json`, `modules/`, `outer/`, `best.json` and
the board's tasks, round manifests and `lease.json`; an island writes only its own heartbeat, results and inner
states. Writes are atomic (a temporary name then a rename on local disks, a single put on object
stores). Tensors are safetensors, never pickle. Every module read is checked against its version's
`checksums.json` (a file changed after its commit is an error naming it; versions committed before
checksums existed are read unchecked). Old versions are deleted by `dipaco.store.retention`.
Its raw-file methods (`files.StoreFiles`: `read_json`, `write_bytes`, `listdir`, ...) are for `dipaco.store`'s own modules.

    store = ModuleStore("runs/demo/store")
    store.write_module(0, "embeddings", {"model.embed_tokens.weight": w})
    store.commit(round=0, levels=[2, 2], modules=["embeddings", ...]); store.current_round()  # 0
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dipaco.store.checksums import CHECKSUMS, VersionChecksums
from dipaco.store.errors import StoreError
from dipaco.store.files import StoreFiles

log = logging.getLogger(__name__)

STORE_VERSION = 1
BEST_FILE = "best.json"
KINDS = ("modules", "outer")


class ModuleStore(StoreFiles):
    def __init__(self, url: str):
        super().__init__(url)
        self.checksums = VersionChecksums(self)

    def remove(self, relative: str) -> bool:
        removed = super().remove(relative)
        if removed:
            self.checksums.forget()
        return removed

    # --- tensors ---------------------------------------------------------------------------------
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

    # --- run state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The committed state, or None for an empty store (read again only when state.json changed: `read_fresh`)."""
        state = self.read_fresh_json("state.json")
        if state is None:
            return None
        if not isinstance(state, dict) or not isinstance(state.get("round"), int):
            raise StoreError(f"store file {self._path('state.json')} is not a run state (a JSON object with the "
                             f"committed round), it holds {json.dumps(state)[:80]}; restore it, or use another store")
        if state.get("store_version") != STORE_VERSION:
            raise StoreError(
                f"{self._path('state.json')} has store_version {state.get('store_version')!r}; "
                f"this dipaco reads version {STORE_VERSION}"
            )
        return state

    def commit(self, *, round: int, **meta: Any) -> None:
        """Mark `round` complete; written after every file of that round. First the version's
        checksums.json: the sha256 of each of its module files (hashed as written, else read back)."""
        self.checksums.commit(round, f"modules/{round_dir(round)}")
        self.write_json("state.json", {"store_version": STORE_VERSION, "round": round, **meta})

    def current_round(self) -> int:
        state = self.state()
        if state is None:
            if not self.shared:
                raise StoreError(f"store {self.url} is empty: a memory:// store lives in one process, so nothing "
                                 f"another dipaco command trained is in it; use a directory or a shared URL")
            raise StoreError(f"store {self.url} is empty: run `dipaco train` to initialise it")
        return int(state["round"])

    # --- modules and outer state -----------------------------------------------------------------
    def write_module(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
        self.write_bytes(_version_file("modules", round, name), data)
        self.checksums.wrote(round, f"{name}.safetensors", data)

    def read_module(self, round: int, name: str) -> dict[str, torch.Tensor]:
        """Module `name` of version `round`, verified against the version's checksums."""
        relative = _version_file("modules", round, name)
        data = self.read_bytes(relative)
        self.checksums.verify(round, f"modules/{round_dir(round)}", f"{name}.safetensors", data,
                              where=self._path(relative))
        return self._decode_tensors(data, relative)

    def read_modules(self, round: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Several modules of version `round`, e.g. every module of one path."""
        return {name: self.read_module(round, name) for name in names}

    def module_shapes(self, name: str) -> dict[str, tuple[list[int], str]]:
        """Each parameter's (shape, dtype) of module `name`, from the safetensors header of version 0 (of the
        newest version when 0 was pruned): shapes never change."""
        relative = _version_file("modules", 0, name)
        versions = self.versions("modules")
        if not self.exists(relative) and versions:
            relative = _version_file("modules", versions[-1], name)
        size = int.from_bytes(self.read_range(relative, 0, 8), "little")
        header = json.loads(self.read_range(relative, 8, 8 + size))
        return {param: (spec["shape"], spec["dtype"]) for param, spec in header.items() if param != "__metadata__"}

    def module_sizes(self, names: list[str]) -> dict[str, int]:
        """Each module's parameter count (`module_shapes`: headers only)."""
        return {name: sum(math.prod(shape) for shape, _ in self.module_shapes(name).values()) for name in names}

    def has_module(self, round: int, name: str) -> bool:
        return self.exists(_version_file("modules", round, name))

    def write_outer_state(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.write_tensors(_version_file("outer", round, name), tensors)

    def read_outer_state(self, round: int, name: str) -> dict[str, torch.Tensor] | None:
        relative = _version_file("outer", round, name)
        return self.read_tensors(relative) if self.exists(relative) else None

    # --- versions, for retention (dipaco.store.retention) -----------------------------------------
    def versions(self, kind: str) -> list[int]:
        """The rounds that have a folder of `kind` ("modules" or "outer"), ascending."""
        return _rounds(self.listdir(_kind(kind)))

    def prune_version(self, kind: str, round: int, *, keep: set[str] = frozenset()) -> int:
        """Delete version `round` of `kind` except the files of the modules in `keep` (the whole folder
        when `keep` is empty); returns the bytes of the files kept."""
        folder = f"{_kind(kind)}/{round_dir(round)}"
        if not keep:
            self.remove(folder)
            return 0
        kept = 0
        for name in self.listdir(folder):
            if name.endswith(".safetensors") and name.removesuffix(".safetensors") in keep:
                kept += self.size(f"{folder}/{name}")
            elif name == CHECKSUMS:
                continue  # the kept files are still checked
            else:
                self.remove(f"{folder}/{name}")
        return kept

    # --- early stopping's record (dipaco.eval.early_stopping) --------------------------------------
    def read_best(self) -> dict[str, Any] | None:
        """best.json: each path's validation loss per module version and its best version (None when absent)."""
        return self.read_json(BEST_FILE) if self.exists(BEST_FILE) else None

    def write_best(self, obj: dict[str, Any]) -> None:
        self.write_json(BEST_FILE, obj)

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


def round_dir(round: int) -> str:
    """The folder (or file stem) name of round `round`: `round-000003`."""
    return f"round-{round:06d}"


def parse_round(name: str) -> int | None:
    """`round-000003` (or `round-000003.json`) → 3; None for any other name."""
    stem = name.split(".", 1)[0]
    if not stem.startswith("round-") or not stem[6:].isdigit():
        return None
    return int(stem[6:])


def _rounds(names: list[str]) -> list[int]:
    return sorted(r for r in map(parse_round, names) if r is not None)


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"a store version is one of {KINDS}, not {kind!r}")
    return kind


def _version_file(kind: str, round: int, name: str) -> str:
    return f"{kind}/{round_dir(round)}/{name}.safetensors"
