"""Every byte that crosses the store boundary, counted where it crosses: by direction and kind.

Each store client (`files.StoreFiles`) owns one `Traffic`; each of its primitives adds to it the payload
bytes it moved and one request, in the cell (direction, kind) of the file it names:

- direction `up` = written to the store (a PUT, a conditional PUT, a DELETE), `down` = read from it (a GET,
  a ranged GET, the compare-read of a conditional write where this process does the compare);
- kind = `kind_of(store name)`, the one place that maps the store's layout to kinds (`KINDS`).

A metadata request (an existence check, a size, an `info` stamp, a listing, a delete) counts one request
and 0 bytes: its reply's names and sizes are not file bytes (an S3 LIST reply is about 300 bytes per name,
a HEAD a few hundred bytes of headers), so `bytes` are payload bytes and `requests` say how many round
trips there were. A refused conditional write counts its request and no bytes (on S3 its body did cross:
one lease or state file per refusal).

`Traffic.limit` (`dipaco.store.bandwidth`, `faults.store_bandwidth`) paces each counted transfer, so the
same call that counts a process's bytes makes them take bytes / bandwidth seconds.

    traffic = Traffic()
    traffic.add("up", "results/round-000001/path-0000.int8.safetensors", 1234)
    traffic.counts().bytes("up", "pseudo_gradient")   # 1234
    ByteCounts.from_json(obj, where="traffic/island-0.ab12.json")   # an island's report, validated
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dipaco.store.errors import StoreError

DIRECTIONS = ("up", "down")
# what crosses the wire, by what it is for (docs/islands.md#bytes-on-the-wire)
KINDS = (
    "pseudo_gradient",  # results/round-t/path-p.<codec>.safetensors: an island's compressed Δ
    "module",  # modules/round-t/<module>.safetensors: a whole module version (written by the coordinator, read by islands)
    "module_update",  # updates/round-t/<module><codec suffix>: a published per-module update (compression.download: update)
    "outer_state",  # outer/round-t/: the outer optimiser's momentum (the coordinator's)
    "inner_state",  # islands/: a path's carried state (optimizer moments, residual, drift) uploaded as a checkpoint, on its last task or a hand-off
    "manifests",  # rounds/ (round manifests), results' .json (result metadata), checksums.json, best.json
    "board",  # tasks.json, state.json, lease.json
    "heartbeats",  # heartbeats/ and traffic/ (each process's byte counts): the islands' reports
    "inputs",  # published.json and objects/: the run's config, tokenizer and shards
    "other",  # a name none of the above knows (a tiny run has none: tests/test_traffic.py)
)

_FOLDERS = {"modules": "module", "updates": "module_update", "outer": "outer_state", "islands": "inner_state",
            "rounds": "manifests", "heartbeats": "heartbeats", "traffic": "heartbeats", "objects": "inputs"}
_FILES = {"tasks.json": "board", "state.json": "board", "lease.json": "board", "best.json": "manifests",
          "published.json": "inputs"}


def kind_of(relative: str) -> str:
    """The kind (`KINDS`) of the store file or folder `relative` (a store name, e.g. `results/round-000002`)."""
    top, _, rest = relative.partition("/")
    if not rest:
        return _FILES.get(top) or _FOLDERS.get(top) or ("pseudo_gradient" if top == "results" else "other")
    name = rest.rsplit("/", 1)[-1]
    if top == "results":
        return "manifests" if name.endswith(".json") else "pseudo_gradient"
    if top == "modules" and name == "checksums.json":
        return "manifests"
    return _FOLDERS.get(top, "other")


@dataclass(frozen=True)
class ByteCounts:
    """Bytes and requests by direction and kind: `cells[(direction, kind)] = (bytes, requests)`."""

    cells: Mapping[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    def bytes(self, direction: str | None = None, kind: str | None = None) -> int:
        return sum(b for (d, k), (b, _) in self.cells.items() if direction in (None, d) and kind in (None, k))

    def requests(self, direction: str | None = None, kind: str | None = None) -> int:
        return sum(r for (d, k), (_, r) in self.cells.items() if direction in (None, d) and kind in (None, k))

    def __add__(self, other: ByteCounts) -> ByteCounts:
        cells = dict(self.cells)
        for key, (b, r) in other.cells.items():
            old = cells.get(key, (0, 0))
            cells[key] = (old[0] + b, old[1] + r)
        return ByteCounts(cells)

    def __sub__(self, other: ByteCounts) -> ByteCounts:
        """What was added since `other` (an earlier snapshot of the same counts)."""
        cells = {}
        for key, (b, r) in self.cells.items():
            old = other.cells.get(key, (0, 0))
            if (b - old[0], r - old[1]) != (0, 0):
                cells[key] = (b - old[0], r - old[1])
        return ByteCounts(cells)

    @classmethod
    def total(cls, counts: Iterable[ByteCounts]) -> ByteCounts:
        out = cls()
        for c in counts:
            out = out + c
        return out

    def to_json(self) -> dict[str, dict[str, dict[str, int]]]:
        """`{direction: {kind: {"bytes": n, "requests": m}}}`, every direction, only the kinds with traffic."""
        out: dict[str, dict[str, dict[str, int]]] = {d: {} for d in DIRECTIONS}
        for (d, k), (b, r) in sorted(self.cells.items()):
            out[d][k] = {"bytes": b, "requests": r}
        return out

    def summary(self) -> dict[str, Any]:
        """`to_json` plus each direction's totals (what train.json, eval.json and `dipaco status` show)."""
        return {"up_bytes": self.bytes("up"), "down_bytes": self.bytes("down"), "up_requests": self.requests("up"),
                "down_requests": self.requests("down"), "by_kind": self.to_json()}

    @classmethod
    def from_json(cls, obj: Any, *, where: str) -> ByteCounts:
        """`to_json`'s object, checked (known directions and kinds, counts non-negative integers below 2**62):
        a StoreError naming `where` and the bad entry otherwise (everything an island writes is untrusted)."""
        if not isinstance(obj, dict) or set(obj) - set(DIRECTIONS):
            raise StoreError(f"{where}: byte counts should be an object with keys {list(DIRECTIONS)}, got {str(obj)[:80]}")
        cells = {}
        for direction, kinds in obj.items():
            if not isinstance(kinds, dict):
                raise StoreError(f"{where}: {direction!r} should be an object of kinds, got {str(kinds)[:80]}")
            for kind, cell in kinds.items():
                if kind not in KINDS:
                    raise StoreError(f"{where}: {direction}.{kind!r} is not a kind of store traffic ({', '.join(KINDS)})")
                values = [cell.get(k) for k in ("bytes", "requests")] if isinstance(cell, dict) else None
                if (values is None or set(cell) != {"bytes", "requests"}
                        or not all(type(v) is int and 0 <= v < 2**62 for v in values)):
                    raise StoreError(f"{where}: {direction}.{kind} should be {{bytes, requests}} as non-negative "
                                     f"integers, got {str(cell)[:80]}")
                cells[(direction, kind)] = (values[0], values[1])
        return cls(cells)


class Pacer(Protocol):
    """What `Traffic.add` calls to pace a transfer (`bandwidth.BandwidthLimit`)."""

    def take(self, direction: str, nbytes: int) -> float: ...


class Traffic:
    """The running counts of one store client (thread-safe: an island's heartbeat thread writes too)."""

    def __init__(self) -> None:
        self.session = uuid.uuid4().hex[:12]  # names this client's counts file (`dipaco.store.ledger`)
        self._cells: dict[tuple[str, str], tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.limit: Pacer | None = None  # paces every transfer (`bandwidth.BandwidthLimit`); None = unlimited

    def add(self, direction: str, relative: str, nbytes: int, *, requests: int = 1) -> None:
        """Count `nbytes` payload bytes and `requests` requests moving `direction` for the store name `relative`."""
        assert direction in DIRECTIONS and nbytes >= 0, (direction, nbytes)
        key = (direction, kind_of(relative))
        with self._lock:
            old = self._cells.get(key, (0, 0))
            self._cells[key] = (old[0] + nbytes, old[1] + requests)
        if self.limit is not None:
            self.limit.take(direction, nbytes)  # outside the lock: the other threads keep counting

    def counts(self) -> ByteCounts:
        """A snapshot of the counts so far."""
        with self._lock:
            return ByteCounts(dict(self._cells))


def ring_allreduce_bytes(nbytes: float, workers: int) -> float:
    """What each of `workers` data-parallel workers sends, and as much receives, to all-reduce `nbytes` in a
    ring (reduce-scatter then all-gather): 2 (N − 1) / N × nbytes; 0 for one worker, which talks to nobody."""
    if workers < 1:
        raise ValueError(f"a ring all-reduce needs at least one worker, got {workers}")
    return 2 * (workers - 1) / workers * nbytes
