"""A result's weight by its age: (1 + s) ^ −rounds.staleness_power, or dropped (None).

    staleness_weight(2, config=RoundsConfig(mode="async", max_staleness=2, staleness_power=1.0))  # 1/3
"""

from __future__ import annotations

from dipaco.config import RoundsConfig


def staleness_weight(staleness: int, *, config: RoundsConfig) -> float | None:
    """Multiplier for a result `staleness` versions old; None when it is to be dropped (sync: anything
    stale; async: past rounds.max_staleness)."""
    if staleness < 0:
        raise ValueError(f"a result cannot start from a version newer than the one it is applied to (staleness {staleness})")
    if config.mode == "sync":
        return 1.0 if staleness == 0 else None
    if staleness > config.max_staleness:
        return None
    return (1.0 + staleness) ** -config.staleness_power
