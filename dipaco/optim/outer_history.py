"""The outer steps a run took, round by round, as spans: train.json's `outer_steps` and the line that says them.

    spans = outer_spans(rounds)          # train.json's rows (RoundStats) -> [OuterSpan(first=1, last=10, ...)]
    describe_outer_steps(spans)          # "rounds 1-10: plain average (lr 1, momentum 0) in the inner lr's decay"

Each row's `outer` is the step `apply_round` took (its manifest's record of the config it applied), so
the spans say what ran, not what the config asked for: with `outer.decay: average` every round that
reaches the inner lr's decay is a plain average whatever `outer.lr` and `outer.momentum` say
(docs/outer-step.md). A row written before the settings were recorded has only its name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dipaco.store.records import OuterStep, RoundStats


@dataclass(frozen=True)
class OuterSpan:
    """Consecutive rounds `first`..`last` that took the same outer step."""

    first: int
    last: int
    name: str  # "configured" or "average" (RoundStats.outer_step)
    step: OuterStep | None  # None: rows written before the settings were recorded

    def to_json(self) -> dict[str, Any]:
        settings = self.step.to_json() if self.step else {}
        return {"rounds": [self.first, self.last], "outer_step": self.name, **settings}


def outer_spans(rounds: Iterable[RoundStats]) -> list[OuterSpan]:
    """The rows grouped into runs of consecutive rounds with the same name and settings."""
    spans: list[OuterSpan] = []
    for row in sorted(rounds, key=lambda r: r.round):
        last = spans[-1] if spans else None
        if last and last.last + 1 == row.round and (last.name, last.step) == (row.outer_step, row.outer):
            spans[-1] = OuterSpan(first=last.first, last=row.round, name=last.name, step=last.step)
        else:
            spans.append(OuterSpan(first=row.round, last=row.round, name=row.outer_step, step=row.outer))
    return spans


def describe_step(step: OuterStep | None, name: str) -> str:
    """One step in words: "plain average (lr 1, momentum 0)", "Nesterov SGD lr 0.7, momentum 0.9", ..."""
    if step is None:
        return f"{'plain average' if name == 'average' else 'the configured step'} (settings not recorded)"
    if step.momentum == 0 and step.lr == 1 and not step.rescale_by_paths:
        return "plain average (lr 1, momentum 0)"
    kind = "Nesterov SGD" if step.nesterov and step.momentum > 0 else "SGD"
    return f"{kind} lr {step.lr:g}, momentum {step.momentum:g}" + (", sqrt(paths) rescale" if step.rescale_by_paths else "")


def describe_outer_steps(spans: list[OuterSpan]) -> str:
    """The spans in one line: "rounds 1-5: Nesterov SGD lr 0.7, momentum 0.9; rounds 6-10: plain average
    (lr 1, momentum 0) in the inner lr's decay"."""
    if not spans:
        return "no rounds"
    parts = []
    for s in spans:
        rounds = f"rounds {s.first}-{s.last}" if s.last > s.first else f"round {s.first}"
        decay = " in the inner lr's decay" if s.name == "average" else ""
        parts.append(f"{rounds}: {describe_step(s.step, s.name)}{decay}")
    return "; ".join(parts)


def describe_rows(rows: list[dict[str, Any]], *, file: str) -> str:
    """`describe_outer_steps` of train.json's rows as JSON objects (read from `file`, named in errors)."""
    return describe_outer_steps(outer_spans(RoundStats.from_json(r, file=file, where=f"rounds[{i}]")
                                            for i, r in enumerate(rows)))
