"""Each process's byte counts, published in the store, and their totals: the run's measured traffic.

Every process that trains (an island, the coordinator) counts what its store client moves
(`dipaco.store.traffic`) and publishes those counts as its own file, one per client session:

    traffic/<owner>.<session>.json    {"schema": 1, "owner": "island-0", "role": "island", "session": "ab12...",
                                       "time": ..., "counts": {"up": {"pseudo_gradient": {"bytes": n, "requests": m}}, ...}}

A file holds the counts up to its own write (its own bytes appear in the next one). Islands publish after
each task, every `IDLE_EVERY` heartbeats while idle and when they stop; the coordinator after each commit and
when it stops. Every session's file stays in the store (retention never deletes one), so the totals, the sum
over every file, survive a coordinator restart, and an island that starts again adds a new session instead
of overwriting the old one. What a process moved after its last file (a `kill -9`) is not counted.

Everything an island writes is untrusted: a report that is not valid JSON, has another schema, a name that
is not its file's, or counts that are not non-negative integers of known kinds is ignored, by name, with a
warning, and the totals say which files they left out.

    publish_counts(store, owner="island-0", role="island")
    ledger = Ledger(); ledger.read(store); ledger.summary()   # {"up_bytes": ..., "by_kind": ..., "by_owner": ...}
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from dipaco.store.board import ISLAND_NAME
from dipaco.store.errors import StoreError
from dipaco.store.files import StoreFiles
from dipaco.store.traffic import ByteCounts

log = logging.getLogger(__name__)

FOLDER = "traffic"
SCHEMA = 1
ROLES = ("island", "coordinator")
IDLE_EVERY = 10  # an idle island publishes its counts at most every this many heartbeat intervals
_SESSION = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class Report:
    """One process session's published counts."""

    owner: str
    role: str
    session: str
    time: float
    counts: ByteCounts


def report_file(owner: str, session: str) -> str:
    return f"{FOLDER}/{owner}.{session}.json"


def publish_counts(store: StoreFiles, *, owner: str, role: str) -> ByteCounts:
    """Write this client's counts so far to its session's file; returns the counts written."""
    if role not in ROLES or not ISLAND_NAME.fullmatch(owner):
        raise ValueError(f"a traffic report's owner must be an island name and its role one of {ROLES}, "
                         f"got {owner!r} / {role!r}")
    counts = store.traffic.counts()
    session = store.traffic.session
    store.write_json(report_file(owner, session), {"schema": SCHEMA, "owner": owner, "role": role,
                                                   "session": session, "time": time.time(),
                                                   "counts": counts.to_json()})
    return counts


def parse_report(obj: Any, *, name: str, where: str) -> Report:
    """A report read from `traffic/<name>`, checked (a StoreError naming `where` and what is wrong otherwise)."""
    if not isinstance(obj, dict) or set(obj) != {"schema", "owner", "role", "session", "time", "counts"}:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise StoreError(f"{where}: a traffic report has schema, owner, role, session, time and counts, got {keys}")
    if obj["schema"] != SCHEMA:
        raise StoreError(f"{where}: schema {obj['schema']!r}; this dipaco reads traffic reports of schema {SCHEMA}")
    owner, role, session, stamp = obj["owner"], obj["role"], obj["session"], obj["time"]
    if not (isinstance(owner, str) and ISLAND_NAME.fullmatch(owner) and isinstance(session, str)
            and _SESSION.fullmatch(session) and f"{owner}.{session}.json" == name):
        raise StoreError(f"{where}: owner {str(owner)[:40]!r} and session {str(session)[:20]!r} do not name this file")
    if role not in ROLES:
        raise StoreError(f"{where}: role {str(role)[:20]!r} is not one of {list(ROLES)}")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise StoreError(f"{where}: time should be a number, got {str(stamp)[:20]!r}")
    return Report(owner=owner, role=role, session=session, time=float(stamp),
                  counts=ByteCounts.from_json(obj["counts"], where=f"{where}: counts"))


class Ledger:
    """The reports in a store, as last read: a file whose listing stamp did not change is not read again."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[tuple, Report | None]] = {}  # file name -> (stamp, report; None: ignored)

    def read(self, store: StoreFiles) -> None:
        """One listing of `traffic/`, then a read of each report that changed since (malformed ones ignored)."""
        stamps = store.listdir_stamped(FOLDER)
        for name in set(self._files) - set(stamps):
            del self._files[name]
        for name, stamp in stamps.items():
            if not name.endswith(".json"):
                continue  # a temporary file of a write in progress
            known = self._files.get(name)
            if known is not None and known[0] == stamp and any(v is not None for v in stamp):
                continue
            relative = f"{FOLDER}/{name}"
            try:
                report: Report | None = parse_report(store.read_json(relative), name=name, where=store.location(relative))
            except StoreError as err:
                log.warning("traffic report ignored: %s", err)
                report = None
            self._files[name] = (stamp, report)

    @property
    def reports(self) -> list[Report]:
        return [report for _, report in self._files.values() if report is not None]

    @property
    def ignored(self) -> list[str]:
        """The report files left out (not valid)."""
        return sorted(name for name, (_, report) in self._files.items() if report is None)

    def total(self) -> ByteCounts:
        return ByteCounts.total(r.counts for r in self.reports)

    def summary(self) -> dict[str, Any]:
        """The totals (`ByteCounts.summary`), by role (islands, coordinator: `ByteCounts.to_json`), each owner's
        (role, sessions, bytes and requests each way), and the files ignored: what train.json's and eval.json's
        `traffic` and `dipaco status` hold."""
        owners: dict[str, dict[str, Any]] = {}
        for r in sorted(self.reports, key=lambda r: (r.owner, r.time)):
            entry = owners.setdefault(r.owner, {"role": r.role, "sessions": 0, "up_bytes": 0, "down_bytes": 0,
                                                "up_requests": 0, "down_requests": 0})
            entry["sessions"] += 1
            for d in ("up", "down"):
                entry[f"{d}_bytes"] += r.counts.bytes(d)
                entry[f"{d}_requests"] += r.counts.requests(d)
        by_role = {role: ByteCounts.total(r.counts for r in self.reports if r.role == role).to_json() for role in ROLES}
        return {**self.total().summary(), "by_role": by_role, "by_owner": owners, "ignored": self.ignored}


def read_summary(store: StoreFiles) -> dict[str, Any]:
    """`Ledger.summary` of every report in `store` (one listing and one read per report)."""
    ledger = Ledger()
    ledger.read(store)
    return ledger.summary()
