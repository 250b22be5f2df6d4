"""The modules of its path an island holds between tasks, and how a task fetches its base version from them
(`compression.download: update` or `results`): the published updates, not whole modules.

    held = HeldModules()                                             # one per island process (DDP: per rank)
    start, fallbacks = held.fetch(store, version=task.base, names=topology.modules_of_path(task.path), codec=codec)

Per module of the task's path at target version b: held at b → a copy; version b's checksum equal to the
held one → unchanged; held at v < b → the updates v+1 … b applied in turn (`dipaco.codec.update.apply_update`,
the function the coordinator committed them with; a version with no update left the module unchanged), then
the rebuilt bytes' sha256 (safetensors, as `ModuleStore.write_module` serialises) checked against version b's
checksums.json. A version published as the round's results (`compression.download: results`,
`dipaco.codec.contributions`) is read as its header, then each contribution's bytes by a ranged read, but for
the island's own: the bytes of its last uploads are kept (`uploaded`) and used where their sha256 matches.
Any failure (an update missing or pruned, undecodable, a checksum that does not match) → the
module read whole (`ModuleStore.read_module`, itself verified), logged with the reason and counted in
`fallbacks` (the task's `ResultMeta.module_fallbacks`, summed into train.json's `module_fallbacks`). Nothing
held (an island joining, or a module of a path it did not train) → a whole read, not a fallback. The copy
kept is the version as committed, taken before the task changes its start (`rebase_on_chain`); modules of
other paths are dropped.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from safetensors.torch import save as save_safetensors

from dipaco.codec.codec import Codec
from dipaco.codec.compress import header_size
from dipaco.codec.contributions import SUFFIX, Contribution, apply_contributions
from dipaco.codec.update import FLOAT32, apply_update
from dipaco.store.errors import StoreError
from dipaco.store.module_store import ModuleStore

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
KEEP_UPLOADS = 4  # the island's own uploads kept for the versions they enter (async: a few versions later)


class RebuildFailed(Exception):
    """A held module could not be brought to the target version from the published updates."""


def module_sha(tensors: Tensors) -> str:
    """The sha256 of a module's safetensors bytes, serialised as `ModuleStore.write_module` does."""
    return hashlib.sha256(save_safetensors({k: v.contiguous() for k, v in tensors.items()})).hexdigest()


class HeldModules:
    """Each held module's (version, tensors as committed, sha256 of its committed bytes)."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[int, Tensors, str]] = {}
        self.fallbacks = 0  # full reads in place of updates, over this island's life
        self.uploads: dict[str, bytes] = {}  # result file (store name) -> its bytes: this island's last uploads

    def forget(self) -> None:
        """Memory lost (an injected death): nothing is held any more."""
        self.modules.clear()
        self.uploads.clear()

    def uploaded(self, file: str, data: bytes) -> None:
        """This island wrote result `file` with bytes `data`: its contributions need not be downloaded."""
        self.uploads[file] = data
        while len(self.uploads) > KEEP_UPLOADS:
            del self.uploads[next(iter(self.uploads))]

    def fetch(self, store: ModuleStore, *, version: int, names: list[str], codec: Codec) -> tuple[dict[str, Tensors], int]:
        """`names`' modules at committed `version` (copies the caller may change), and the fallbacks taken.
        Keeps them as held, and only them."""
        out, fallbacks, kept = {}, 0, {}
        for name in names:
            tensors, sha, fell_back = self._one(store, name, version=version, codec=codec)
            fallbacks += fell_back
            if sha is not None:
                kept[name] = (version, tensors, sha)
            out[name] = {k: t.clone() for k, t in tensors.items()}
        self.modules = kept
        self.fallbacks += fallbacks
        return out, fallbacks

    def _one(self, store: ModuleStore, name: str, *, version: int, codec: Codec) -> tuple[Tensors, str | None, bool]:
        """(module `name` at `version`, its committed sha256 (None: its version lists none), a fallback taken)."""
        expected = store.module_checksum(version, name)
        held = self.modules.get(name)
        if held is None or expected is None:
            return store.read_module(version, name), expected, False
        at, tensors, sha = held
        if at == version or sha == expected:
            return tensors, sha, False
        try:
            if at > version:
                raise RebuildFailed(f"it holds version {at}, newer than {version}")
            return rebuild(store, name, tensors, since=at, version=version, codec=codec, expected=expected,
                           uploads=self.uploads), expected, False
        except (RebuildFailed, StoreError, ValueError, KeyError, RuntimeError) as err:
            log.warning("module %s: read whole at version %d (the fallback): %s", name, version, err)
            return store.read_module(version, name), expected, True


def rebuild(store: ModuleStore, name: str, tensors: Tensors, *, since: int, version: int, codec: Codec,
            expected: str, uploads: dict[str, bytes] | None = None) -> Tensors:
    """Module `name` at `version` from its copy at version `since` and the updates published in between,
    verified against `expected` (its committed sha256): RebuildFailed when it does not match. `uploads`: the
    island's own result files' bytes, used in place of downloading its contributions."""
    suffixes = tuple(dict.fromkeys((SUFFIX, codec.suffix, FLOAT32.suffix)))  # the flush's updates are float32
    for w in range(since + 1, version + 1):
        found = store.update_file(w, name, suffixes=suffixes)
        if found is None:  # unchanged at w, or pruned: the checksum below tells
            continue
        relative, suffix = found
        if suffix == SUFFIX:
            tensors = gather(store, relative, tensors, module=name, uploads=uploads or {})
            continue
        tensors = apply_update(tensors, store.read_bytes(relative), module=name,
                               codec=codec if suffix == codec.suffix else FLOAT32)
    actual = module_sha(tensors)
    if actual != expected:
        raise RebuildFailed(f"the rebuilt module from version {since} has sha256 {actual[:16]}..., version "
                            f"{version}'s checksums list {expected[:16]}... (an update missing or changed)")
    return tensors


def gather(store: ModuleStore, relative: str, tensors: Tensors, *, module: str, uploads: dict[str, bytes]) -> Tensors:
    """Module `module`'s next version from its contributions file `relative`: its header read, then each
    contribution's bytes, from `uploads` where the island wrote them (sha256 checked) else by a ranged read."""
    first = store.read_range(relative, 0, 8)
    head = first + store.read_range(relative, 8, header_size(first))

    def fetch(entry: Contribution, start: int, end: int) -> bytes:
        mine = uploads.get(entry.file)
        chunk = mine[entry.start:entry.end] if mine is not None else b""
        if chunk and hashlib.sha256(chunk).hexdigest() == entry.sha256:
            return chunk
        return store.read_range(relative, start, end)

    return apply_contributions(tensors, head, module=module, fetch=fetch)
