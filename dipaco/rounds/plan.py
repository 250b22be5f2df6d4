"""A round's outer step as the policy plans it: per result a verdict, per module its contributions.

A result based on version b applied in round t is s = t − 1 − b versions stale for the shared modules.
For its path-private modules it is stale by the results of its own path applied in rounds b+1 … t−1
that its start does not hold: a chained task (async, `Result.chain`) starts from b plus its path's
earlier results, so those are the progress it continues, not updates it missed, and do not count. Each
staleness gives a factor `staleness_weight(s)` (the shared one `Verdict.factor`, the private one
`Verdict.private_factor`: the factors the manifest records are the ones applied); a result either of
whose stalenesses is past the limit is dropped whole. A result that carries only some of its path's
modules (`Result.modules`, outer.fragments) contributes to those alone.
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
    staleness: int  # of its shared modules
    factor: float | None
    steps: int | None = None  # inner steps it trained (None: a whole task)
    private_staleness: int = 0  # of its path-private modules: own results applied since its base, not in its chain
    private_factor: float | None = None  # their staleness weight (None: dropped, or its path has no private module)


@dataclass(frozen=True)
class Contribution:
    """One result's part in one module's outer step: its weight (`dipaco.optim.weighting`) × factor."""

    key: str
    path: int
    tokens: int
    staleness: int
    factor: float
    steps: int | None = None  # inner steps it trained (None: a whole task)


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
               applied: dict[int, list[tuple[int, str]]]) -> RoundPlan:
    """The plan of round `round` from the `pending` results; `applied`: path -> the (round, key) of its
    results committed rounds applied (a private module's staleness)."""
    private = {paths[0] for paths in grid.modules.values() if len(paths) == 1}  # the paths with a private module
    results = {r.key: r for r in sorted(pending, key=lambda r: (r.path, r.base, r.key))}
    verdicts = [_verdict(round, r, applied=applied[r.path], private=r.path in private, config=config)
                for r in results.values()]
    modules: dict[str, tuple[Contribution, ...]] = {}
    for m, paths in grid.modules.items():
        contributions = []
        for verdict in verdicts:
            carried = results[verdict.key].modules
            if verdict.factor is None or verdict.path not in paths or (carried is not None and m not in carried):
                continue
            own = len(paths) == 1
            factor = verdict.private_factor if own else verdict.factor
            assert factor is not None  # an applied result of a path with a private module has a private factor
            contributions.append(Contribution(key=verdict.key, path=verdict.path, tokens=results[verdict.key].tokens,
                                              staleness=verdict.private_staleness if own else verdict.staleness,
                                              factor=factor, steps=results[verdict.key].steps))
        modules[m] = tuple(contributions)
    return RoundPlan(round=round, verdicts=tuple(verdicts), modules=modules,
                     paths_through={m: len(paths) for m, paths in grid.modules.items()})


def _verdict(round: int, result: Result, *, applied: list[tuple[int, str]], private: bool,
             config: RoundsConfig) -> Verdict:
    """`result`'s verdict in round `round`; `applied`: the (round, key) of its path's applied results,
    `private`: its path has a private module."""
    staleness = round - 1 - result.base
    factor = staleness_weight(staleness, config=config)
    own = sum(1 for r, key in applied if r > result.base and key not in result.chain) if private else 0
    private_factor = staleness_weight(own, config=config) if private else None
    if private and private_factor is None:
        factor = None  # past the limit for its private modules: dropped whole, as for its shared ones
    return Verdict(key=result.key, path=result.path, base=result.base, staleness=staleness, factor=factor,
                   steps=result.steps, private_staleness=own,
                   private_factor=private_factor if factor is not None else None)
