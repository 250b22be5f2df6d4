"""Goodput by work (docs/islands.md#goodput): the tokens the committed rounds applied over what the
islands could have trained in the run's wall time at their failure-free speed; the time-based share
(applied results' inner-loop seconds over the islands' seconds) beside it.

    goodput(store, islands=8, seconds=600.0)                          # train.json's, from the manifests
    goodput(store, islands=8, seconds=600.0, tokens_per_second=512.0)  # an island's failure-free speed known
    by_work(tokens=..., seconds=..., islands=..., tokens_per_second=...)

    goodput = applied tokens / (seconds x islands x an island's failure-free tokens per second)

An island's failure-free speed is given where it is known (a paced benchmark: tokens per step / the
pace) and otherwise estimated as the median rate (tokens / inner-loop seconds) of the results trained:
a minority of stragglers does not move it, and their slow seconds then count as lost capacity, where
the time-based share counted them as useful.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from dipaco.store.board import read_manifest
from dipaco.store.module_store import ModuleStore


def median_rate(results: Iterable[tuple[int, float]]) -> float | None:
    """The median tokens per second of `results` ((tokens, inner-loop seconds) each; those without
    seconds are left out); None when there is none."""
    rates = [tokens / seconds for tokens, seconds in results if seconds > 0]
    return statistics.median(rates) if rates else None


def by_work(*, tokens: float, seconds: float, islands: int, tokens_per_second: float | None) -> float:
    """`tokens` applied / (`seconds` x `islands` x `tokens_per_second`, an island's failure-free speed);
    NaN when that capacity is unknown or zero."""
    capacity = seconds * islands * (tokens_per_second or 0.0)
    return tokens / capacity if capacity > 0 else math.nan


def goodput(store: ModuleStore, *, islands: int, seconds: float,
            tokens_per_second: float | None = None) -> dict[str, float | str]:
    """Goodput by work of the results every committed round applied, over `islands` x `seconds` (first
    heartbeat to last commit); `tokens_per_second`: an island's failure-free speed (None: the median
    applied result's). The time-based share beside it, labelled as such."""
    applied = []
    for r in range(1, store.current_round() + 1):
        manifest = read_manifest(store, r)
        if manifest is not None:
            applied += manifest.applied
    tokens = sum(e.tokens for e in applied)
    useful = sum(e.seconds for e in applied)
    nominal = "given" if tokens_per_second is not None else "median applied result"
    if tokens_per_second is None:
        tokens_per_second = median_rate((e.tokens, e.seconds) for e in applied)
    total = islands * seconds
    return {"goodput": by_work(tokens=tokens, seconds=seconds, islands=islands, tokens_per_second=tokens_per_second),
            "applied_tokens": tokens, "island_tokens_per_second": tokens_per_second or math.nan,
            "island_tokens_per_second_from": nominal,
            "goodput_by_time": useful / total if total else math.nan,
            "useful_island_seconds": useful, "island_seconds": total}
