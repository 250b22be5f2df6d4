"""The coordinator's lease: one coordinator per store at a time, and a deposed one cannot commit.

    lease = Lease.acquire(store, timeout=60.0)   # LeaseHeld names the holder and the lease's age
    lease.renew()                                # every tick (a write at most every timeout/4 seconds)
    lease.check()                                # before every write that matters: LeaseLost once taken over
    lease.release()                              # on a clean stop (a restart then needs no waiting)

`lease.json` in the store holds the holder (host, pid), when it started and was last renewed (wall-clock
seconds, so hosts' clocks must roughly agree) and the fencing token, which grows by one at every
takeover. A coordinator holds the lease while the file names its own token and nonce; one that finds
another token there has been deposed and stops before writing.

A lease is taken over when it has not been renewed for `timeout` seconds, when its holder is a process
of this host that no longer runs (a `kill -9`), when its holder is this very process (an earlier
coordinator object, deposed by the new token), or with `force`. Every read and write goes through the
store's fsspec filesystem: a local rename, or a single PUT on object stores. Two coordinators starting
in the same instant may both write the file; the read-back leaves one of them refused at once and the
other deposed at its first check, never both committing past it. See docs/islands.md#crash-safety.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dipaco.store.module_store import ModuleStore, StoreError

LEASE_FILE = "lease.json"

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another coordinator holds the store's lease."""


class LeaseLost(RuntimeError):
    """This coordinator's lease was taken over: it must not write to the store again."""


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
    if not store.exists(LEASE_FILE):
        return None
    return Holder.from_json(store.read_json(LEASE_FILE), file=store.location(LEASE_FILE))


class Lease:
    """A held lease (made by `acquire`)."""

    def __init__(self, store: ModuleStore, holder: Holder, *, timeout: float, wall: Callable[[], float]):
        self.store, self.holder, self.timeout, self.wall = store, holder, timeout, wall

    @classmethod
    def acquire(cls, store: ModuleStore, *, timeout: float, force: bool = False, host: str | None = None,
                pid: int | None = None, wall: Callable[[], float] = time.time) -> Lease:
        """Take the store's lease, or raise `LeaseHeld` naming the holder and the lease's age."""
        host, pid = host or socket.gethostname(), os.getpid() if pid is None else pid
        now = wall()
        old = read_holder(store)
        if old is not None:
            reason = "forced (--force)" if force else _takeover_reason(old, host=host, pid=pid, now=now, timeout=timeout)
            if reason is None:
                raise LeaseHeld(
                    f"another coordinator holds the store {store.url}: {old.describe(now)}; the lease expires "
                    f"{timeout - (now - old.renewed_at):.0f}s after its last renewal (resilience.lease_timeout={timeout:g}). "
                    f"Stop that coordinator, wait, or pass --force if you know it is gone")
            log.warning("taking over the coordinator lease of %s from %s: %s", store.url, old.describe(now), reason)
        mine = Holder(token=(old.token + 1) if old else 1, host=host, pid=pid, nonce=uuid.uuid4().hex,
                      started=now, renewed_at=now)
        store.write_json(LEASE_FILE, mine.to_json())
        lease = cls(store, mine, timeout=timeout, wall=wall)
        current = read_holder(store)
        if current is None or current.nonce != mine.nonce:  # another coordinator wrote it in the same instant
            raise LeaseHeld(f"another coordinator took the store {store.url} at the same time: "
                            f"{current.describe(now) if current else 'its lease vanished'}")
        return lease

    @property
    def token(self) -> int:
        return self.holder.token

    def check(self) -> None:
        """Raise `LeaseLost` unless the store's lease is still this one (the fencing check)."""
        current = read_holder(self.store)
        if current is None or current.nonce != self.holder.nonce:
            who = current.describe(self.wall()) if current else "nobody (the lease file was removed)"
            raise LeaseLost(f"this coordinator (token {self.token}) lost the lease of store {self.store.url} to "
                            f"{who}; it stops without writing")

    def renew(self) -> None:
        """Check, then write a new renewal time when a quarter of the timeout has passed."""
        now = self.wall()
        if now - self.holder.renewed_at < self.timeout / 4:
            return
        self.check()
        self.holder = Holder(**{**self.holder.to_json(), "renewed_at": now})
        self.store.write_json(LEASE_FILE, self.holder.to_json())

    def release(self) -> None:
        """Remove the lease file if it is still this one's."""
        current = read_holder(self.store)
        if current is not None and current.nonce == self.holder.nonce:
            self.store.remove(LEASE_FILE)


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
