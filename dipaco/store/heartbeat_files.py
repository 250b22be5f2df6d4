"""Heartbeat files: `heartbeats/<island>.json`, each written by its island alone (a `Heartbeat`), read by the
coordinator and `dipaco status`. A file that is not its island's valid heartbeat is refused by name and left out.

    write_heartbeat(store, beat); beats = read_heartbeats(store, cache=HeartbeatCache())
"""

from __future__ import annotations

import re

from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Heartbeat

ISLAND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_island_name(name: str) -> str:
    """`name`, when it can name an island's heartbeat file (`heartbeats/<name>.json`): letters, digits, `_`, `.`
    and `-`, not starting with `.` or `-`; otherwise a ValueError naming it (`a/b` wrote `heartbeats/a/b.json`,
    which the coordinator never lists: that island idled unseen)."""
    if not ISLAND_NAME.fullmatch(name):
        raise ValueError(f"island name {name!r} cannot name a heartbeat file: use letters, digits, '_', '.' "
                         f"and '-' (no '/'), not starting with '.' or '-'")
    return name


def _heartbeat_file(island: str) -> str:
    return f"heartbeats/{check_island_name(island)}.json"


# --- heartbeats ------------------------------------------------------------------------------------
def write_heartbeat(store: ModuleStore, beat: Heartbeat) -> None:
    store.write_json(_heartbeat_file(beat.island), beat.to_json())


def read_heartbeats(store: ModuleStore, *, cache: HeartbeatCache | None = None,
                    malformed: dict[str, str] | None = None) -> dict[str, Heartbeat]:
    """Every island's latest heartbeat, by island name. With a `cache` (a coordinator polling every tick),
    a heartbeat file whose listing stamp (size, modification time, inode / ETag) is the one it had when
    last read is not read again: one listing per poll, plus one read per island that beat since.

    An island writes its heartbeat, so it is untrusted: a file that is not a valid heartbeat of the island its
    name names (not JSON, not a `Heartbeat`, another island's name) is left out, its reason put in `malformed`
    (`{store file: reason}`) when given, and kept in the cache as such (`HeartbeatCache.malformed`)."""
    beats = {}
    stamps = store.listdir_stamped("heartbeats") if cache is not None else dict.fromkeys(store.listdir("heartbeats"))
    for name, stamp in stamps.items():
        if not name.endswith(".json"):
            continue  # a temporary file of a write in progress
        relative = f"heartbeats/{name}"
        known = cache.known(name, stamp) if cache is not None else None
        if known is None:
            try:
                known = _read_heartbeat(store, relative, island=name.removesuffix(".json"))
            except StoreError as err:
                if not store.exists(relative):
                    continue  # removed since the listing
                known = str(err)
            if cache is not None:
                cache.keep(name, stamp, known)
        if isinstance(known, Heartbeat):
            beats[known.island] = known
        elif malformed is not None:
            malformed[store.location(relative)] = known
    if cache is not None:
        cache.drop(set(stamps))
    return beats


def _read_heartbeat(store: ModuleStore, relative: str, *, island: str) -> Heartbeat:
    """The heartbeat in `relative`, which must be island `island`'s own; a StoreError naming the file otherwise."""
    beat = Heartbeat.from_json(store.read_json(relative), file=store.location(relative))
    if beat.island != island or not ISLAND_NAME.fullmatch(island):
        raise StoreError(f"{store.location(relative)}: the heartbeat of island {beat.island[:80]!r} in another "
                         f"island's file (an island writes only heartbeats/<its name>.json)")
    return beat


class HeartbeatCache:
    """The heartbeat files `read_heartbeats` last read, each with its listing stamp then (a stamp with no
    field set, as some stores list, never matches: such a file is read every poll)."""

    def __init__(self) -> None:
        self.beats: dict[str, tuple[tuple, Heartbeat]] = {}  # file name -> (stamp, heartbeat)
        self.malformed: dict[str, tuple[tuple, str]] = {}  # file name -> (stamp, why it is not a heartbeat)
        self.reads = 0  # files read so far (the others were unchanged)

    def known(self, name: str, stamp: tuple | None) -> Heartbeat | str | None:
        """What file `name` held when last read, if its `stamp` is unchanged since (else None: read it)."""
        if stamp is None or not any(v is not None for v in stamp):
            return None
        for entries in (self.beats, self.malformed):
            if name in entries and entries[name][0] == stamp:
                return entries[name][1]
        return None

    def keep(self, name: str, stamp: tuple | None, read: Heartbeat | str) -> None:
        """File `name` as just read: a heartbeat, or why it is not one."""
        self.reads += 1
        self.beats.pop(name, None)
        self.malformed.pop(name, None)
        if isinstance(read, Heartbeat):
            self.beats[name] = (stamp, read)
        else:
            self.malformed[name] = (stamp, read)

    def drop(self, listed: set[str]) -> None:
        """Forget the files no longer listed."""
        for entries in (self.beats, self.malformed):
            for gone in set(entries) - listed:
                del entries[gone]
