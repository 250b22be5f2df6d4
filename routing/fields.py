"""Config fields that check themselves: a field's type says what it allows, one validator enforces it.

    from typing import Annotated, Literal
    from routing.fields import Range, Section

    @dataclass(kw_only=True)
    class InnerConfig(Section):
        section = "inner"
        steps: Annotated[int, Range(min=1)] = 10
        schedule: Literal["cosine", "wsd"] = "wsd"

`Section.__post_init__` runs `check_fields`: a `Literal` field must hold one of its values, a field
annotated with a `Range` (or a list of such values) must lie inside it, and no float may be NaN or
infinite. Each error names `section.key` and the bad value. Sections with rules that tie several fields
together extend `__post_init__`. This module is the bottom of the config stack, so `routing`,
`sharding` and `dipaco` all declare their sections with it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal


@dataclass(frozen=True)
class Range:
    """Inclusive bounds of a number (`above`/`below` make a bound exclusive); `off`: a value allowed besides
    the range that switches the feature off (usually 0)."""

    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None
    off: float | None = None

    def contains(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        return ((self.min is None or value >= self.min) and (self.max is None or value <= self.max)
                and (self.above is None or value > self.above) and (self.below is None or value < self.below))

    def describe(self) -> str:
        """The allowed values in words, e.g. `>= 1`, `in (0, 1]`, `0 (off) or > 1`."""
        low = f"[{_num(self.min)}" if self.min is not None else f"({_num(self.above)}" if self.above is not None else None
        high = f"{_num(self.max)}]" if self.max is not None else f"{_num(self.below)})" if self.below is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = (">= " if low[0] == "[" else "> ") + low[1:]
        elif high:
            text = ("<= " if high[-1] == "]" else "< ") + high[:-1]
        else:
            text = "any number"
        return f"{_num(self.off)} (off) or {text}" if self.off is not None else text


PositiveInt = Annotated[int, Range(min=1)]
Count = Annotated[int, Range(min=0)]  # 0 usually means "none" or "all": each field's doc says which
Positive = Annotated[float, Range(above=0)]
NonNegative = Annotated[float, Range(min=0)]
Seed = Annotated[int, Range(min=0)]


class Section:
    """Base of every config section: `section` is its name in YAML; `__post_init__` checks every field."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self, self.section)


def check_fields(obj: Any, section: str) -> None:
    """Check every field of the dataclass `obj` against its type: `Literal` choices, `Range` bounds (also of
    a list's items) and finite floats. Raises ValueError naming `section.key` and the value."""
    hints = field_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = hints[f.name]
        values = value if typing.get_origin(hint) is list and isinstance(value, list) else [value]
        item_hint = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
        for item in values:
            problem = _problem(item, item_hint)
            if problem:
                shown = repr(value) if item is value else f"{value!r} (the item {item!r})"
                raise ValueError(f"{section}.{f.name} must be {problem}, got {shown}")


def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type of each field of `cls`, `Annotated` metadata kept."""
    return typing.get_type_hints(cls, include_extras=True)


def choices(hint: Any) -> tuple | None:
    """The values a `Literal[...]` hint allows, else None."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def bounds(hint: Any) -> Range | None:
    """The `Range` an `Annotated[...]` hint carries, else None."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
    return None


def describe(hint: Any) -> str:
    """What a field allows, for the config reference: `cosine / wsd`, `>= 1`, `[] of >= 1`, ``."""
    if typing.get_origin(hint) is list:
        inner = describe(typing.get_args(hint)[0])
        return f"list of {inner}" if inner else ""
    allowed = choices(hint)
    if allowed is not None:
        return " / ".join(str(v) for v in allowed)
    limits = bounds(hint)
    return limits.describe() if limits else ""


def _problem(value: Any, hint: Any) -> str | None:
    allowed = choices(hint)
    if allowed is not None:
        return None if value in allowed and not isinstance(value, bool) else f"one of {list(allowed)}"
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number"
    limits = bounds(hint)
    if limits is not None and isinstance(value, (int, float)) and not limits.contains(value):
        return limits.describe()
    return None


def _num(x: float | None) -> str:
    return "" if x is None else (str(int(x)) if float(x).is_integer() else str(x))
