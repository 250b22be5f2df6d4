"""Where an elastic island's worker spends its wall time, by kind of round, logged as one line a person and
bench/bench_islands.py both read.

    spent = WorkerTime()
    ...; spent.add("quorum")       # the seconds since the last `add` were a wait for a quorum
    log.info("%s", spent.line())   # "elastic worker time (s): quorum 1.20 heal 0.40 steps 80.00 ..."

Kinds (`KINDS`): `quorum` waiting for the lighthouse's quorum (its `start_quorum`); `heal` the quorums in which
this worker healed from a peer; `steps` an inner step's tries up to their all-reduce (compute, and the padding
to the pace); `sync` the all-reduce and commit of the tries that committed, beyond the part the pace covered (a try is
padded to the pace less the least all-reduce time of the worker's last few tries): a wait for a slower peer,
one healing or late; `idle` the all-reduce of a committed try in which this worker had no rows (the last try
of a shrunk island's step, e.g. 2 rows left for 3 workers); `failed` the all-reduce of the tries that did not
commit (a member died in them; the survivors keep the rows they computed) and the rounds a death cut short;
`between` the rounds between tasks (pushing a result, reading the board, waiting for work); `seal` computing
and checking a task's result; `down` the time away after an injected death, and the rejoin.
"""

from __future__ import annotations

import re
import time

KINDS = ("quorum", "heal", "steps", "sync", "idle", "failed", "between", "seal", "down")
PREFIX = "elastic worker time (s):"
_ENTRY = re.compile(r"(\w+) (\d+(?:\.\d+)?)")


class WorkerTime:
    """Seconds by kind (`KINDS`), summed since the worker started: each `add` counts the time since the last."""

    def __init__(self):
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.since = time.perf_counter()

    def add(self, kind: str, *, paced: float = 0.0) -> None:
        """Count the seconds since the last `add` (or the start) as `kind`, the first `paced` of them as `steps`
        (an all-reduce's time that the pace already covered: the step padded that much less)."""
        if kind not in self.seconds:
            raise ValueError(f"unknown kind of worker time {kind!r}: one of {KINDS}")
        now = time.perf_counter()
        covered = min(max(paced, 0.0), now - self.since)
        self.seconds["steps"] += covered
        self.seconds[kind] += now - self.since - covered
        self.since = now

    def line(self) -> str:
        return PREFIX + " " + " ".join(f"{kind} {self.seconds[kind]:.2f}" for kind in KINDS)


def parse_line(text: str) -> dict[str, float] | None:
    """The seconds by kind of the last `WorkerTime.line` in a worker's log `text` (None: there is none)."""
    at = text.rfind(PREFIX)
    if at < 0:
        return None
    line = text[at + len(PREFIX):].split("\n", 1)[0]
    return {kind: float(value) for kind, value in _ENTRY.findall(line) if kind in KINDS}
