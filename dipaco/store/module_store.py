"""The module store: the only medium between the coordinator and the islands, and the only code (with
the rest of `dipaco.store`) that knows its file names.

An fsspec URL (a local directory by default; `s3://…`, `gs://…` or a shared filesystem when islands
sit on different machines). Layout under the root:

    state.json                                     last completed round (written last: the commit point), the
                                                   lease token that wrote it and each version's staged name
    modules/round-000003.t4/<module>.safetensors   every module after round 3's outer step, staged by the
                                                   coordinator holding lease token 4 (`version_names`)
    modules/round-000003.t4/checksums.json         the sha256 of each of those files (written at the commit)
    outer/round-000003.t4/<module>.safetensors     the outer optimiser's momentum after round 3
    outer/round-000003.t4/<module>.residual.safetensors   the module's download residual after round 3
    updates/round-000003.t4/<module><codec suffix>  the update d from version 2 to 3, encoded by `compression.codec`
                                                   (`dipaco.codec.update`: version 3 := version 2 − d); none for a
                                                   module round 3 left unchanged, nor with compression.download: full
    modules/round-000000/...                       version 0, and every version of a store written before
                                                   fenced commits: no token in the name
    best.json                                      validation loss per path and version (dipaco.eval.early_stopping)
    tasks.json, rounds/, heartbeats/, results/, islands/   the task board (dipaco.store.board)
    lease.json                                     the coordinator's lease and fencing token (dipaco.store.lease)

Each file has one writer: the coordinator writes `state.json`, `modules/`, `outer/`, `updates/`, `best.json` and
the board's tasks, round manifests and `lease.json`; an island writes only its own heartbeat, results and inner
states. Writes are atomic (a temporary name then a rename on local disks, a single put on object
stores). Tensors are safetensors, never pickle. Every module read is checked against its version's
`checksums.json` (a file changed after its commit is an error naming it; versions committed before
checksums existed are read unchecked). Old versions are deleted by `dipaco.store.retention`.
Its raw-file methods (`files.StoreFiles`: `read_json`, `write_bytes`, `listdir`, ...) are for `dipaco.store`'s own modules.

Commits are fenced by the coordinator's lease token (`fence`): from then on this object stages versions under
the token's names, and every write of `state.json` is conditional on the version this object last wrote (S3
If-Match, GCS generation match, a compare-and-swap under the directory's lock), so once another coordinator
has fenced the store, this one's commit is refused (`LeaseLost`) and its staged files stay unread. Readers
resolve a committed version's name through `state.json` (`read_module(3, ...)` reads `round-000003.t4`).

    store = ModuleStore("runs/demo/store")
    store.write_module(0, "embeddings", {"model.embed_tokens.weight": w})
    store.commit(round=0, levels=[2, 2], modules=["embeddings", ...]); store.current_round()  # 0
    store.fence(lease.token)     # the coordinator, once it holds the lease
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any

from dipaco.store.checksums import CHECKSUMS, VersionChecksums
from dipaco.store.errors import LeaseLost, StoreError
from dipaco.store.files import StoreFiles
from dipaco.store.version_names import VersionNames, parse_version, version_dir

if TYPE_CHECKING:  # torch and safetensors load in the methods that handle tensors: `dipaco status` needs neither
    import torch

log = logging.getLogger(__name__)

STORE_VERSION = 2  # 2: versions staged under lease tokens (`version_names`); 1 (unsuffixed names) is still read
READS = (1, 2)
STATE = "state.json"
BEST_FILE = "best.json"
KINDS = ("modules", "outer", "updates")
RESIDUAL = ".residual"  # an outer-state file of a module's download residual: <module>.residual.safetensors


class ModuleStore(StoreFiles):
    def __init__(self, url: str):
        super().__init__(url)
        self.checksums = VersionChecksums(self)
        self.token = 0  # the lease token this object stages versions and commits under (`fence`); 0: none
        self._state_version: str | None = None  # state.json's version as this object last wrote it (fenced)
        self._names = VersionNames(committed=-1)  # from the last state.json this object read or wrote

    def remove(self, relative: str) -> bool:
        removed = super().remove(relative)
        if removed:
            self.checksums.forget()
        return removed

    # --- tensors ---------------------------------------------------------------------------------
    def write_tensors(self, relative: str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
        from safetensors.torch import save as save_safetensors

        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        self.write_bytes(relative, data)
        return len(data)

    def read_tensors(self, relative: str) -> dict[str, torch.Tensor]:
        return self._decode_tensors(self.read_bytes(relative), relative)

    def _decode_tensors(self, data: bytes, relative: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as load_safetensors

        try:
            return load_safetensors(data)
        except Exception as err:  # safetensors raises its own error types
            raise StoreError(f"store file {self._path(relative)} is not a valid safetensors file: {err}") from None

    # --- run state ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The committed state, or None for an empty store (read again only when state.json changed: `read_fresh`)."""
        data = self.read_fresh(STATE)
        if data is None:
            self._names = VersionNames(committed=-1)
            return None
        return self._parse_state(data)

    def _parse_state(self, data: bytes) -> dict[str, Any]:
        """state.json's bytes, checked (a run state of a store version this dipaco reads); remembers its names."""
        try:
            state = json.loads(data)
        except ValueError as err:
            raise StoreError(f"store file {self._path(STATE)} is not valid JSON: {err}") from None
        if not isinstance(state, dict) or not isinstance(state.get("round"), int):
            raise StoreError(f"store file {self._path(STATE)} is not a run state (a JSON object with the "
                             f"committed round), it holds {json.dumps(state)[:80]}; restore it, or use another store")
        if state.get("store_version") not in READS:
            raise StoreError(
                f"{self._path(STATE)} has store_version {state.get('store_version')!r}; "
                f"this dipaco reads versions {', '.join(map(str, READS))}"
            )
        self._names = VersionNames.from_state(state, file=self._path(STATE))
        return state

    def fenced_token(self) -> int:
        """The lease token state.json is fenced by (0: none, or an empty store)."""
        state = self.state()
        return int(state.get("lease_token", 0)) if state else 0

    def fence(self, token: int) -> None:
        """Stage versions under lease `token` from now on, and write `token` into state.json over the version
        read, so that a commit of an earlier token's (a deposed coordinator's) is refused from now on. Call it
        once the lease is held, before reading the committed state."""
        for _ in range(3):  # another coordinator's commit may land between the read and the write: read again
            found = self.read_versioned(STATE)
            self.token = token
            if found is None:  # an empty store: the first commit creates state.json (only if still absent)
                self._state_version = None
                return
            state = self._parse_state(found[0])
            if int(state.get("lease_token", 0)) > token:
                raise LeaseLost(f"store {self.url} is fenced by lease token {state['lease_token']}, newer than this "
                                f"coordinator's {token}; it stops without writing")
            body = {**state, "lease_token": token}
            if state.get("lease_token") == token:
                self._state_version = found[1]
                return
            written = self.write_if(STATE, _encode(body), version=found[1])
            if written is not None:
                self._state_version = written
                return
        raise LeaseLost(f"store {self.url}: state.json kept changing while lease token {token} fenced it")

    def commit(self, *, round: int, **meta: Any) -> None:
        """Mark `round` complete; written after every file of that round. A new version first gets its
        checksums.json: the sha256 of each of its module files (hashed as written, else read back). Once fenced
        (`fence`), state.json is replaced only if it is still the version this object wrote: else `LeaseLost`."""
        self.state()  # the committed versions' names, as they are now
        names = self._names
        if round > names.committed:
            self.checksums.commit(round, self._folder("modules", round, self.token))
            names = names.after_commit(round, self.token)
        body = {"store_version": STORE_VERSION, "round": round, **meta, "lease_token": self.token,
                "version_tokens": names.to_json()}
        self._write_state(body, round=round)

    def rewrite_state(self, state: dict[str, Any]) -> None:
        """Replace the committed state (same round and versions) as the commit does: fenced."""
        self._write_state(state, round=int(state["round"]))

    def _write_state(self, body: dict[str, Any], *, round: int) -> None:
        data = _encode(body)
        if not self.token:  # no lease (version 0, or a tool writing a store no coordinator runs on)
            self.write_bytes(STATE, data)
        else:
            written = self.write_if(STATE, data, version=self._state_version)
            if written is None:  # refused, unless our own write landed on a try whose answer was lost
                found = self.read_versioned(STATE)
                if found is None or found[0] != data:
                    now = json.loads(found[0]) if found else {}
                    raise LeaseLost(
                        f"store {self.url}: the commit of round {round} by lease token {self.token} was refused: "
                        f"state.json changed since this coordinator last wrote it (it now holds round "
                        f"{now.get('round')} of lease token {now.get('lease_token')}); another coordinator took the "
                        f"lease. Nothing of round {round} was committed; this coordinator stops")
                written = found[1]
            self._state_version = written
        self._names = VersionNames.from_state(body, file=self._path(STATE))

    def current_round(self) -> int:
        state = self.state()
        if state is None:
            if not self.shared:
                raise StoreError(f"store {self.url} is empty: a memory:// store lives in one process, so nothing "
                                 f"another dipaco command trained is in it; use a directory or a shared URL")
            raise StoreError(f"store {self.url} is empty: run `dipaco train` to initialise it")
        return int(state["round"])

    # --- version names (`version_names`) ----------------------------------------------------------------
    def version_name(self, round: int) -> str:
        """The name (folder or file stem) of version `round` as readers see it: the committed one's staged
        name; for a version not committed (yet), the name this object stages it under."""
        token = self._names.token_of(round)
        if token is None:
            self.state()  # committed since this object last looked?
            token = self._names.token_of(round)
        return version_dir(round, self.token if token is None else token)

    def staged_name(self, round: int) -> str:
        """The name this object writes version `round` under (its lease token's, `fence`)."""
        return version_dir(round, self.token)

    def _folder(self, kind: str, round: int, token: int | None = None) -> str:
        """`kind`'s folder of version `round`: the readers' (`version_name`), or `token`'s staging."""
        return f"{_kind(kind)}/{self.version_name(round) if token is None else version_dir(round, token)}"

    # --- modules and outer state -----------------------------------------------------------------
    def write_module(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Stage module `name` of version `round` (under this object's lease token: nothing a reader opens
        until the commit names it)."""
        from safetensors.torch import save as save_safetensors

        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
        self.write_bytes(f"{self._folder('modules', round, self.token)}/{name}.safetensors", data)
        self.checksums.wrote(round, f"{name}.safetensors", data)

    def read_module(self, round: int, name: str) -> dict[str, torch.Tensor]:
        """Module `name` of version `round`, verified against the version's checksums."""
        folder = self._folder("modules", round)
        relative = f"{folder}/{name}.safetensors"
        data = self.read_bytes(relative)
        self.checksums.verify(round, folder, f"{name}.safetensors", data, where=self._path(relative))
        return self._decode_tensors(data, relative)

    def read_modules(self, round: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Several modules of version `round`, e.g. every module of one path."""
        return {name: self.read_module(round, name) for name in names}

    def module_shapes(self, name: str) -> dict[str, tuple[list[int], str]]:
        """Each parameter's (shape, dtype) of module `name`, from the safetensors header of version 0 (of the
        newest version when 0 was pruned): shapes never change."""
        relative = f"{self._folder('modules', 0)}/{name}.safetensors"
        versions = self.versions("modules")
        if not self.exists(relative) and versions:
            relative = f"{self._folder('modules', versions[-1])}/{name}.safetensors"
        size = int.from_bytes(self.read_range(relative, 0, 8), "little")
        header = json.loads(self.read_range(relative, 8, 8 + size))
        return {param: (spec["shape"], spec["dtype"]) for param, spec in header.items() if param != "__metadata__"}

    def module_sizes(self, names: list[str]) -> dict[str, int]:
        """Each module's parameter count (`module_shapes`: headers only)."""
        return {name: sum(math.prod(shape) for shape, _ in self.module_shapes(name).values()) for name in names}

    def has_module(self, round: int, name: str) -> bool:
        return self.exists(f"{self._folder('modules', round)}/{name}.safetensors")

    def write_outer_state(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.write_tensors(f"{self._folder('outer', round, self.token)}/{name}.safetensors", tensors)

    def read_outer_state(self, round: int, name: str) -> dict[str, torch.Tensor] | None:
        relative = f"{self._folder('outer', round)}/{name}.safetensors"
        return self.read_tensors(relative) if self.exists(relative) else None

    def write_download_residual(self, round: int, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Stage module `name`'s download residual after version `round` (`dipaco.codec.update`), beside its outer state."""
        self.write_tensors(f"{self._folder('outer', round, self.token)}/{name}{RESIDUAL}.safetensors", tensors)

    def read_download_residual(self, round: int, name: str) -> dict[str, torch.Tensor]:
        """Module `name`'s download residual after version `round` (empty when none was kept)."""
        relative = f"{self._folder('outer', round)}/{name}{RESIDUAL}.safetensors"
        return self.read_tensors(relative) if self.exists(relative) else {}

    def write_update(self, round: int, name: str, data: bytes, *, suffix: str) -> None:
        """Stage module `name`'s update from version `round` − 1 to `round` (bytes a codec encoded; `suffix` its
        file suffix, `dipaco.codec.registry`)."""
        self.write_bytes(f"{self._folder('updates', round, self.token)}/{name}{suffix}", data)

    def read_update(self, round: int, name: str, *, suffixes: tuple[str, ...]) -> tuple[bytes, str] | None:
        """(the bytes, its suffix) of module `name`'s update to committed version `round`, the first of `suffixes`
        there is; None when there is none (the module did not change, or the update was pruned)."""
        found = self.update_file(round, name, suffixes=suffixes)
        return None if found is None else (self.read_bytes(found[0]), found[1])

    def update_file(self, round: int, name: str, *, suffixes: tuple[str, ...]) -> tuple[str, str] | None:
        """(the store name, its suffix) of module `name`'s update to committed version `round`, the first of
        `suffixes` there is (for ranged reads: `read_range`); None when there is none."""
        folder = self._folder("updates", round)
        for suffix in suffixes:
            relative = f"{folder}/{name}{suffix}"
            if self.exists(relative):
                return relative, suffix
        return None

    def module_checksum(self, round: int, name: str) -> str | None:
        """The sha256 module `name` has in committed version `round`'s checksums.json (None: not listed)."""
        return self.checksums.listed(round, self._folder("modules", round), f"{name}.safetensors")

    # --- versions, for retention (dipaco.store.retention) -----------------------------------------
    def versions(self, kind: str) -> list[int]:
        """The versions that have a folder of `kind` ("modules" or "outer") under the name readers see
        (`version_name`), ascending: another token's staging is not one."""
        self.state()
        found = [parsed for parsed in map(parse_version, self.listdir(_kind(kind))) if parsed is not None]
        return sorted(r for r, token in found if (self._names.token_of(r) if r <= self._names.committed
                                                    else self.token) == token)

    def orphans(self, kind: str) -> list[str]:
        """The staged folders of `kind` ("modules", "outer") or manifests ("rounds") no commit points to or will
        (`VersionNames.is_orphan`: a deposed coordinator's, or a crashed one's half-written version), as store names."""
        folder = kind if kind == "rounds" else _kind(kind)
        self.state()
        return [f"{folder}/{name}" for name in self.listdir(folder)
                if (parsed := parse_version(name)) is not None and (kind != "rounds" or name.endswith(".json"))
                and self._names.is_orphan(*parsed, writer=self.token)]

    def prune_version(self, kind: str, round: int, *, keep: set[str] = frozenset()) -> int:
        """Delete version `round` of `kind` except the files of the modules in `keep` (the whole folder
        when `keep` is empty); returns the bytes of the files kept."""
        folder = self._folder(kind, round)
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
    """The folder (or file stem) name of round `round` with no lease token: `round-000003` (results, inner
    states; module versions are named by `ModuleStore.version_name`)."""
    return version_dir(round)


def parse_round(name: str) -> int | None:
    """`round-000003` (or `round-000003.json`, `round-000003.t4`) → 3; None for any other name."""
    stem = name.split(".", 1)[0]
    if not stem.startswith("round-") or not stem[6:].isdigit():
        return None
    return int(stem[6:])


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"a store version is one of {KINDS}, not {kind!r}")
    return kind


def _encode(state: dict[str, Any]) -> bytes:
    return json.dumps(state, indent=1, sort_keys=True).encode()
