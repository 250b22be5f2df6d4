"""A round's outer step as the policy plans it: per result a verdict, per module its contributions.

A result based on version b applied in round t is s = t − 1 − b versions stale for the shared modules;
for a path-private module, s = the results of its own path applied in rounds b+1 … t−1. Its factor is
`staleness_weight(s)`; a result whose shared staleness is past the limit is dropped whole. A result that
carries only some of its path's modules (`Result.modules`, outer.fragments) contributes to those alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dipaco.config import RoundsConfig
from dipaco.rounds.inputs import Grid, Result
from dipaco.rounds.staleness import staleness_weight


@dataclass(frozen=True)
class Verdict:
    """What a round does with one result: applied (factor = its shared modules' staleness weight) or
    dropped (factor None)."""

    key: str
    path: int
    base: int
    staleness: int  # of its shared modules (its private ones: `Contribution.staleness`)
    factor: float | None
    steps: int | None = None  # inner steps it trained (None: a whole task)


@dataclass(frozen=True)
class Contribution:
    """One result's part in one module's outer step: its weight (`dipaco.optim.weighting`) × factor."""

    key: str
    path: int
    tokens: int
    staleness: int
    factor: float


@dataclass(frozen=True)
class RoundPlan:
    """Round `round`'s outer step: per module the results it averages (none: the module is carried over
    unchanged) and the √ rescale's path count."""

    round: int
    verdicts: tuple[Verdict, ...]  # every pending result, by (path, base)
    modules: dict[str, tuple[Contribution, ...]]  # every module, in grid order
    paths_through: dict[str, int]  # |P(m)|

    @property
    def applied(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.factor is not None]

    @property
    def dropped(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.factor is None]


def plan_round(round: int, pending: Iterable[Result], *, grid: Grid, config: RoundsConfig,
               applied_rounds: dict[int, list[int]]) -> RoundPlan:
    """The plan of round `round` from the `pending` results; `applied_rounds`: path -> the rounds that
    applied its earlier results (a private module's staleness)."""
    verdicts, by_key = [], {}
    for result in sorted(pending, key=lambda r: (r.path, r.base, r.key)):
        staleness = round - 1 - result.base
        factor = staleness_weight(staleness, config=config)
        verdicts.append(Verdict(key=result.key, path=result.path, base=result.base, staleness=staleness, factor=factor,
                                steps=result.steps))
        by_key[result.key] = result
    modules: dict[str, tuple[Contribution, ...]] = {}
    for m, paths in grid.modules.items():
        contributions = []
        for verdict in verdicts:
            carried = by_key[verdict.key].modules
            if verdict.factor is None or verdict.path not in paths or (carried is not None and m not in carried):
                continue
            staleness, factor = verdict.staleness, verdict.factor
            if len(paths) == 1:  # private: stale only by its own path's results applied since
                staleness = sum(1 for r in applied_rounds[verdict.path] if r > verdict.base)
                factor = staleness_weight(staleness, config=config)
                if factor is None:  # sync cannot get here; async: newer own results already applied
                    continue
            contributions.append(Contribution(key=verdict.key, path=verdict.path,
                                              tokens=by_key[verdict.key].tokens, staleness=staleness, factor=factor))
        modules[m] = tuple(contributions)
    return RoundPlan(round=round, verdicts=tuple(verdicts), modules=modules,
                     paths_through={m: len(paths) for m, paths in grid.modules.items()})
