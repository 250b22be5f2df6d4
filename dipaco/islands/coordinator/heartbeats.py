"""Which islands are alive: each island's heartbeat as the coordinator last saw it change, and when.

An island whose `seq` has not changed for `resilience.heartbeat_timeout` seconds (coordinator clock)
is lost; one that came back as a new incarnation has lost its task (`TaskBoard.reassign_lost`). A heartbeat
file that is not a valid heartbeat of its island (`read_heartbeats`) is ignored, with a warning naming it once
per version of the file: its island, if any, is then lost as when it stops beating.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dipaco.store.heartbeat_files import HeartbeatCache, read_heartbeats
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Heartbeat

log = logging.getLogger(__name__)

MAX_STRETCH = 8.0  # an elastic island short of workers has its straggler cut delayed this many times at most


@dataclass(frozen=True)
class Seen:
    """An island's heartbeat as the coordinator last saw it change, and when (coordinator clock)."""

    beat: Heartbeat
    changed_at: float


class Liveness:
    def __init__(self, store: ModuleStore, *, timeout: float):
        self.store, self.timeout = store, timeout
        self.cache = HeartbeatCache()  # heartbeat files unchanged since the last read are not read again
        self.seen: dict[str, Seen] = {}
        self.first_beat: float | None = None  # when an island was first seen (goodput counts island time from here)

    def read(self, now: float) -> None:
        """Read the heartbeats (one listing; only the files that changed since are read)."""
        before = dict(self.cache.malformed)
        beats = read_heartbeats(self.store, cache=self.cache)
        for name, entry in self.cache.malformed.items():
            if before.get(name) != entry:  # a new version of the file (or a new reason): said once
                log.warning("ignored a heartbeat that is not valid (%s); the coordinator goes on without it", entry[1])
        for name, beat in beats.items():
            if self.first_beat is None:
                self.first_beat = now
            seen = self.seen.get(name)
            if seen is None or (seen.beat.incarnation, seen.beat.seq) != (beat.incarnation, beat.seq):
                self.seen[name] = Seen(beat=beat, changed_at=now)

    def capacity(self, island: str | None) -> float:
        """The share of `island`'s workers in its quorum as its last heartbeat says (world / workers; 1 for an
        island not seen), at least 1 / MAX_STRETCH: a heartbeat is untrusted, so it can delay its cut that much at most."""
        seen = self.seen.get(island) if island is not None else None
        if seen is None:
            return 1.0
        return max(seen.beat.world / seen.beat.workers, 1 / MAX_STRETCH)

    def alive(self, island: str, now: float) -> bool:
        seen = self.seen.get(island)
        return seen is not None and now - seen.changed_at < self.timeout
