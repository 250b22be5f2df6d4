"""Which name each module version has in the store: versions are staged under the lease token of the
coordinator that wrote them, and `state.json` says which staged name each committed version is.

A coordinator holding lease token 4 writes version 3 as `modules/round-000003.t4/`, `outer/round-000003.t4/`
and `rounds/round-000003.t4.json`; its commit (a conditional write of `state.json`, `ModuleStore.commit`)
records in `version_tokens` that versions from 3 on are token 4's, until a later coordinator's. A deposed
coordinator's outer step thus writes only names no commit points to, which readers never open and retention
deletes. Token 0 is the unsuffixed name (`round-000003`): version 0 (written before any lease) and every
version of a store written before fenced commits (`state.json` without `version_tokens`).

    names = VersionNames.from_state(state, file="s3://b/run/state.json")
    names.token_of(3)                          # 4; None when version 3 is not committed
    version_dir(3, 4)                           # "round-000003.t4"
    parse_version("round-000003.t4.json")       # (3, 4)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dipaco.store.errors import StoreError

_NAME = re.compile(r"round-(\d{6,})(?:\.t(\d+))?")


def version_dir(round: int, token: int = 0) -> str:
    """The folder (or file stem) of version `round` staged under lease token `token`: `round-000003.t4`
    (`round-000003` for token 0)."""
    return f"round-{round:06d}" + (f".t{token}" if token else "")


def parse_version(name: str) -> tuple[int, int] | None:
    """`round-000003.t4` or `round-000003.t4.json` → (3, 4); `round-000003` → (3, 0); None for any other name."""
    match = _NAME.fullmatch(name.removesuffix(".json"))
    return None if match is None else (int(match[1]), int(match[2] or 0))


@dataclass(frozen=True)
class VersionNames:
    """The committed round and, from `state.json`'s `version_tokens`, the token whose names each version has."""

    committed: int  # the last committed round; -1 for an empty store
    tokens: tuple[tuple[int, int], ...] = ((0, 0),)  # (first round, token), ascending: token from that round on

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, *, file: str) -> VersionNames:
        if state is None:
            return cls(committed=-1)
        raw = state.get("version_tokens", [[0, 0]])  # a store written before fenced commits: unsuffixed names
        ok = isinstance(raw, list) and raw and all(
            isinstance(e, list) and len(e) == 2 and all(type(x) is int and x >= 0 for x in e) for e in raw)
        tokens = tuple((e[0], e[1]) for e in raw) if ok else ()
        if not ok or tokens[0][0] != 0 or any(a >= b or s >= t for (a, s), (b, t) in zip(tokens, tokens[1:])):
            raise StoreError(f"store file {file}: version_tokens {str(raw)[:80]} is not a list of [first round, lease "
                             f"token] pairs from round 0 on, both ascending; restore it from a copy")
        return cls(committed=int(state["round"]), tokens=tokens)

    def token_of(self, round: int) -> int | None:
        """The lease token whose names committed version `round` has; None when it is not committed."""
        if round > self.committed or round < 0:
            return None
        return [token for first, token in self.tokens if first <= round][-1]

    def after_commit(self, round: int, token: int) -> VersionNames:
        """The names once version `round` (newer than `committed`), staged under `token`, is committed."""
        tokens = self.tokens if self.tokens[-1][1] == token else (*self.tokens, (round, token))
        return VersionNames(committed=round, tokens=tokens)

    def to_json(self) -> list[list[int]]:
        return [list(pair) for pair in self.tokens]

    def is_orphan(self, round: int, token: int, *, writer: int) -> bool:
        """Is a version folder staged as (`round`, `token`) one no commit points to or will: another token's
        name for a committed version, or a version beyond the committed one staged under a token older than
        `writer` (the coordinator now holding the lease; a newer token's staging is never touched)."""
        committed = self.token_of(round)
        return committed != token if committed is not None else token < writer
