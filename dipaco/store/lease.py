"""The coordinator's lease: one coordinator per store at a time, and a deposed one cannot commit.

    lease = Lease.acquire(store, timeout=60.0)   # LeaseHeld names the holder and the lease's age
    lease.renew()                                # every tick (a write at most every timeout/4 seconds)
    lease.check()                                # before every write that matters: LeaseLost once taken over
    lease.release()                              # on a clean stop (a restart then needs no waiting)

`lease.json` in the store holds the holder (host, pid), when it started and was last renewed (wall-clock
seconds, so hosts' clocks must roughly agree) and the fencing token, which grows by one at every
takeover (and is above the token that fenced `state.json`, `ModuleStore.fence`, should lease.json have been
deleted). A coordinator holds the lease while the file names its own token and nonce; one that finds
another token there has been deposed and stops before writing.

A lease is taken over when it has not been renewed for `timeout` seconds, when its holder is a process
of this host that no longer runs (a `kill -9`), when its holder is this very process (an earlier
coordinator object, deposed by the new token), or with `force`; a released one is free. Every write of
`lease.json` is conditional (`conditional`): taking it creates the file only if there is none, or replaces
only the version that was read; a renewal replaces only the version this coordinator wrote; a release
marks it released the same way. On S3 (If-None-Match / If-Match) and GCS (generation preconditions) the
server decides, on a local or shared directory a lock does: of two coordinators starting in the same
instant exactly one gets the lease, and the write of a deposed one is refused. Where the filesystem
offers neither, the write is a plain one and the lease reads back what it wrote. See
docs/islands.md#crash-safety.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dipaco.store.errors import LeaseLost
from dipaco.store.module_store import ModuleStore, StoreError

LEASE_FILE = "lease.json"

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another coordinator holds the store's lease."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: its host and process, the fencing token and when it started and was renewed."""

    token: int
    host: str
    pid: int
    nonce: str
    started: float
    renewed_at: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, obj: Any, *, file: str) -> Holder:
        try:
            return cls(token=int(obj["token"]), host=str(obj["host"]), pid=int(obj["pid"]), nonce=str(obj["nonce"]),
                       started=float(obj["started"]), renewed_at=float(obj["renewed_at"]))
        except (KeyError, TypeError, ValueError) as err:
            raise StoreError(f"store file {file} is not a coordinator lease ({err!r}); delete it if no coordinator "
                             f"runs on this store") from None

    def describe(self, now: float) -> str:
        return (f"{self.host} pid {self.pid} (token {self.token}, started {now - self.started:.0f}s ago, "
                f"renewed {now - self.renewed_at:.0f}s ago)")


def read_holder(store: ModuleStore) -> Holder | None:
    """The lease's holder; None when no coordinator holds it (no lease file, or a released one)."""
    found = _read(store)
    return None if found is None or found[1] else found[0]


def _read(store: ModuleStore) -> tuple[Holder, bool, str] | None:
    """lease.json as (the holder it names, whether it was released, its version); None when absent."""
    found = store.read_versioned(LEASE_FILE)
    if found is None:
        return None
    data, version = found
    file = store.location(LEASE_FILE)
    try:
        obj = json.loads(data)
    except ValueError as err:
        raise StoreError(f"store file {file} is not a coordinator lease ({err}); delete it if no coordinator "
                         f"runs on this store") from None
    return Holder.from_json(obj, file=file), bool(isinstance(obj, dict) and obj.get("released")), version


def _encode(holder: Holder, *, released: bool = False) -> bytes:
    return json.dumps({**holder.to_json(), **({"released": True} if released else {})}, indent=1,
                      sort_keys=True).encode()


class Lease:
    """A held lease (made by `acquire`); `version` is lease.json's version as this coordinator last wrote it."""

    def __init__(self, store: ModuleStore, holder: Holder, *, timeout: float, wall: Callable[[], float],
                 version: str):
        self.store, self.holder, self.timeout, self.wall, self.version = store, holder, timeout, wall, version

    @classmethod
    def acquire(cls, store: ModuleStore, *, timeout: float, force: bool = False, host: str | None = None,
                pid: int | None = None, wall: Callable[[], float] = time.time) -> Lease:
        """Take the store's lease, or raise `LeaseHeld` naming the holder and the lease's age."""
        host, pid = host or socket.gethostname(), os.getpid() if pid is None else pid
        now = wall()
        found = _read(store)
        old, released, version = found if found is not None else (None, False, None)
        if old is not None and not released:
            reason = "forced (--force)" if force else _takeover_reason(old, host=host, pid=pid, now=now, timeout=timeout)
            if reason is None:
                raise LeaseHeld(
                    f"another coordinator holds the store {store.url}: {old.describe(now)}; the lease expires "
                    f"{timeout - (now - old.renewed_at):.0f}s after its last renewal (resilience.lease_timeout={timeout:g}). "
                    f"Stop that coordinator, wait, or pass --force if you know it is gone")
            log.warning("taking over the coordinator lease of %s from %s: %s", store.url, old.describe(now), reason)
        last = max(old.token if old else 0, store.fenced_token())  # a lease.json deleted by hand restarts no lower
        mine = Holder(token=last + 1, host=host, pid=pid, nonce=uuid.uuid4().hex, started=now, renewed_at=now)
        written = store.write_if(LEASE_FILE, _encode(mine), version=version)
        if written is None or not store.conditional_writes:  # refused, or a plain write: what is there now?
            current = _read(store)
            if current is None or current[1] or current[0].nonce != mine.nonce:  # another coordinator's
                who = current[0].describe(now) if current else "its lease vanished"
                raise LeaseHeld(f"another coordinator took the store {store.url} at the same time: {who}")
            written = current[2]  # read back ours (or our write landed on a try whose answer was lost)
        return cls(store, mine, timeout=timeout, wall=wall, version=written)

    @property
    def token(self) -> int:
        return self.holder.token

    def check(self) -> None:
        """Raise `LeaseLost` unless the store's lease is still this one (the fencing check)."""
        found = _read(self.store)
        if found is None or found[1] or found[0].nonce != self.holder.nonce:
            raise self._lost(found)
        self.version = found[2]

    def renew(self) -> None:
        """Write a new renewal time when a quarter of the timeout has passed, only over the version this
        coordinator wrote: once another coordinator took the lease, the write is refused (`LeaseLost`)."""
        now = self.wall()
        if now - self.holder.renewed_at < self.timeout / 4:
            return
        renewed = Holder(**{**self.holder.to_json(), "renewed_at": now})
        written = self.store.write_if(LEASE_FILE, _encode(renewed), version=self.version)
        if written is None:  # refused: another coordinator's write came first, unless ours landed on a lost try
            found = _read(self.store)
            if found is None or found[1] or found[0] != renewed:
                raise self._lost(found)
            written = found[2]
        self.holder, self.version = renewed, written

    def release(self) -> None:
        """Mark the lease released if it is still this one's (the token stays, so the next one is larger)."""
        found = _read(self.store)
        if found is not None and not found[1] and found[0].nonce == self.holder.nonce:
            self.store.write_if(LEASE_FILE, _encode(found[0], released=True), version=found[2])

    def _lost(self, found: tuple[Holder, bool, str] | None) -> LeaseLost:
        if found is None:
            who = "nobody (the lease file was removed)"
        else:
            who = found[0].describe(self.wall()) + (" (released)" if found[1] else "")
        return LeaseLost(f"this coordinator (token {self.token}) lost the lease of store {self.store.url} to "
                         f"{who}; it stops without writing")


def _takeover_reason(old: Holder, *, host: str, pid: int, now: float, timeout: float) -> str | None:
    """Why the lease `old` may be taken over (None: it may not)."""
    if now - old.renewed_at >= timeout:
        return "expired"
    if old.host == host and old.pid == pid:
        return "an earlier coordinator of this process"
    if old.host == host and not _process_alive(old.pid):
        return "its process is gone"
    return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
