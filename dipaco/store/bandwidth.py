"""A per-process bandwidth limit on store traffic (fault emulation, `faults.store_bandwidth`): each read and
write of this process's store client takes its payload bytes / bandwidth seconds, each direction at the full
bandwidth (a full-duplex link).

    limit = BandwidthLimit(1e6)          # 1 MB/s each way
    limit.take("up", 250_000)            # sleeps 0.25 s
    store.limit_bandwidth(1e6)           # every primitive of a `files.StoreFiles` paced (`traffic.Traffic.add`)

A process's transfers are sequential in the thread that makes them (an island's task thread: its modules
down, its pseudo-gradient up), so that thread sees the link's rate. A transfer of another thread at the same
time (the heartbeat thread's few hundred bytes during an upload) is not queued behind it: it takes its own
bytes / bandwidth, as on a fair-shared link where so small a message passes at once. A FIFO queue would
hold the heartbeat for a whole upload and a slow link would read as a dead island. The real transfer's own
time is not subtracted (a local store's is small against any limit worth emulating); requests that move no
payload (listings, existence checks) are not paced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BandwidthLimit:
    """`bytes_per_second` each way; `sleep` is injectable for tests."""

    def __init__(self, bytes_per_second: float, *, sleep: Callable[[float], None] = time.sleep):
        if not bytes_per_second > 0:
            raise ValueError(f"a bandwidth limit needs bytes_per_second > 0, got {bytes_per_second}")
        self.bytes_per_second = float(bytes_per_second)
        self._sleep = sleep
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds slept so far, every thread and direction

    def take(self, direction: str, nbytes: int) -> float:
        """Hold the caller for `nbytes` / bandwidth seconds (`direction` is "up" or "down"); the seconds slept."""
        assert direction in ("up", "down"), direction
        if nbytes <= 0:
            return 0.0
        wait = nbytes / self.bytes_per_second
        self._sleep(wait)
        with self._lock:
            self.waited += wait
        return wait
