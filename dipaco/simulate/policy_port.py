"""The simulator's one door to the real round policy (`dipaco.islands.rounds`): when a round may close
(`round_ready`, then the grace window), and with what weight each received result is applied or
whether it is dropped (`staleness_weight`). Nothing here decides anything itself: it holds the state
the policy reads (the committed version, the received results, when the quorum was first met) the way
the coordinator holds it, on the simulator's virtual clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dipaco.config import OuterConfig
from dipaco.islands.rounds import round_ready, staleness_weight
from dipaco.model.topology import Topology


@dataclass(frozen=True)
class Decision:
    """What a round close did with one received result."""

    path: int
    base: int
    staleness: int
    factor: float | None  # None: dropped


class PolicyPort:
    def __init__(self, topology: Topology, outer: OuterConfig) -> None:
        self.topology, self.outer = topology, outer
        self.committed = 0
        self.pending: list[tuple[int, int]] = []  # (path, base) received, not yet applied or dropped
        self.quorum_since: float | None = None

    def task_base(self, path: int) -> int:
        """The module version a task for `path` starts from now."""
        return self.committed

    def receive(self, path: int, base: int, now: float) -> None:
        self.pending.append((path, base))

    def close_due(self, now: float) -> bool:
        """Whether the round closes now (the coordinator's check on every tick)."""
        fresh = {path for path, base in self.pending if base == self.committed}
        all_in, quorum = round_ready(self.topology, fresh, config=self.outer)
        if not quorum:
            self.quorum_since = None
            return False
        if self.quorum_since is None:
            self.quorum_since = now
        return all_in or now - self.quorum_since >= self.outer.grace_seconds

    def wake_at(self) -> float | None:
        """When the round may close with no new result (its grace window ends); None when no timer runs."""
        return None if self.quorum_since is None else self.quorum_since + self.outer.grace_seconds

    def close(self, now: float) -> list[Decision]:
        """Close round `committed + 1`: each pending result applied with its factor or dropped."""
        round = self.committed + 1
        decisions = []
        for path, base in sorted(self.pending):
            staleness = round - 1 - base
            decisions.append(Decision(path=path, base=base, staleness=staleness,
                                      factor=staleness_weight(staleness, config=self.outer)))
        self.pending.clear()
        self.committed = round
        self.quorum_since = None
        return decisions
