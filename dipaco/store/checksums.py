"""Each module version's `checksums.json`: the sha256 of every module file, written at the commit and
checked on every module read (a file changed after its commit is an error naming it, and so is a file its
version's checksums.json does not list; versions committed before checksums existed are read unchecked).

    sums = VersionChecksums(files)
    sums.wrote(3, "embeddings.safetensors", data); sums.commit(3)    # before state.json
    sums.verify(3, "embeddings.safetensors", data, where=...)        # raises StoreError on a mismatch
"""

from __future__ import annotations

import hashlib

from dipaco.store.errors import StoreError
from dipaco.store.files import StoreFiles

CHECKSUMS = "checksums.json"


class VersionChecksums:
    def __init__(self, files: StoreFiles):
        self.files = files
        self.written: dict[int, dict[str, str]] = {}  # round -> module file -> sha256, of this process's writes
        self.committed: dict[int, dict[str, str]] = {}  # round -> its checksums.json, once read

    def wrote(self, round: int, file: str, data: bytes) -> None:
        self.written.setdefault(round, {})[file] = hashlib.sha256(data).hexdigest()

    def commit(self, round: int, folder: str) -> None:
        """Write `folder`'s checksums.json: each module file's sha256, hashed as written, else read back."""
        written = self.written.pop(round, {})
        sums = {}
        for name in self.files.listdir(folder):
            if name.endswith(".safetensors"):
                sums[name] = written.get(name) or hashlib.sha256(self.files.read_bytes(f"{folder}/{name}")).hexdigest()
        if sums:
            self.files.write_json(f"{folder}/{CHECKSUMS}", sums)
            self.committed[round] = sums

    def verify(self, round: int, folder: str, file: str, data: bytes, *, where: str) -> None:
        sums = self._of(round, folder)
        if sums is None:  # a version committed before checksums existed (or not committed)
            return
        expected = sums.get(file)
        if expected is None:  # a checksums.json emptied or cut short would turn verification off unseen
            raise StoreError(f"store file {where} is not listed in version {round}'s {self.files.location(f'{folder}/{CHECKSUMS}')} "
                             f"(it lists {len(sums)} files): the checksums changed after the commit. Restore them, "
                             f"or delete the store's versions from {round} on and train again")
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise StoreError(f"store file {where} has sha256 {actual[:16]}..., but version "
                             f"{round}'s {CHECKSUMS} lists {expected[:16]}...: it changed after it was committed. "
                             f"Restore it, or delete the store's versions from {round} on and train again")

    def listed(self, round: int, folder: str, file: str) -> str | None:
        """The sha256 version `round`'s checksums.json lists for `file` (None: not listed, or no checksums)."""
        sums = self._of(round, folder)
        return None if sums is None else sums.get(file)

    def forget(self) -> None:
        """Files were deleted: read the checksums again when needed."""
        self.committed.clear()

    def _of(self, round: int, folder: str) -> dict[str, str] | None:
        """Version `round`'s checksums (None for an uncommitted version or one committed without them)."""
        if round not in self.committed:
            relative = f"{folder}/{CHECKSUMS}"
            if not self.files.exists(relative):
                return None
            sums = self.files.read_json(relative)
            if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
                raise StoreError(f"store file {self.files.location(relative)} is not a checksum list (file -> sha256)")
            self.committed[round] = sums
        return self.committed[round]
