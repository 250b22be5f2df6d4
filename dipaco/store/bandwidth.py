"""A per-process bandwidth limit on store traffic (fault emulation, `faults.store_bandwidth`): a token bucket
with no burst, one per direction (a full-duplex link), that makes each read and write of this process's store
client take its payload bytes / bandwidth seconds.

    limit = BandwidthLimit(1e6)          # 1 MB/s each way
    limit.take("up", 250_000)            # sleeps 0.25 s (longer while earlier transfers still hold the link)
    store.limit_bandwidth(1e6)           # every primitive of a `files.StoreFiles` paced (`traffic.Traffic.add`)

Transfers on one direction queue behind each other (a heartbeat written while a result uploads waits for it),
as on one shared link; the real transfer's own time is not subtracted (a local store's is small against any
limit worth emulating). Requests that move no payload (listings, existence checks) are not paced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dipaco.store.traffic import DIRECTIONS


class BandwidthLimit:
    """`bytes_per_second` each way; `clock` and `sleep` are injectable for tests."""

    def __init__(self, bytes_per_second: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not bytes_per_second > 0:
            raise ValueError(f"a bandwidth limit needs bytes_per_second > 0, got {bytes_per_second}")
        self.bytes_per_second = float(bytes_per_second)
        self._clock, self._sleep = clock, sleep
        self._free_at = dict.fromkeys(DIRECTIONS, 0.0)  # when each direction's link is next idle
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds slept so far (both directions)

    def take(self, direction: str, nbytes: int) -> float:
        """Hold the caller until `nbytes` have crossed `direction` at the limit, after the transfers queued
        before them; the seconds it slept."""
        if nbytes <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            done = max(now, self._free_at[direction]) + nbytes / self.bytes_per_second
            self._free_at[direction] = done
        wait = done - now
        self._sleep(wait)
        with self._lock:
            self.waited += wait
        return wait
