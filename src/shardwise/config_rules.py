"""What a config field may hold: the rules each field declares beside its default.

A field with a rule is written ``checked(default, rule)`` (in ``shardwise.config``): ``Range`` (bounds,
always finite: NaN and inf refused unless listed in ``also``), ``OneOf`` (the strings allowed) or
``NonEmpty``. The rule rides in the field's metadata under ``RULE``; ``check_values``
(``shardwise.config_load``), called by ``TrainConfig.validate``, walks the fields and applies each one,
so the ranges live beside the defaults and nowhere else. Each rule raises a one-line ``ConfigError``
naming the key, what it allows and what it got. Pure. Communication: none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import ConfigError

RULE = "shardwise.rule"  # the dataclass-field metadata key holding a field's rule


@dataclass(frozen=True)
class Range:
    """Numbers a field allows (each item, for a tuple): bounds, always finite (NaN and inf refused).

    ``also`` lists values allowed outside the bounds, described by ``note`` (``parallel.dp = -1``).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[float, ...] = ()
    note: str = ""

    def allows(self, value: float) -> bool:
        if value in self.also:
            return True
        return math.isfinite(value) and not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self, integer: bool) -> str:
        """``an integer >= 1``, ``a finite number in [0, 1)``, ..."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            bounds = f" in {low}, {high}"
        elif low:
            bounds = f" {'>=' if self.ge is not None else '>'} {low[1:]}"
        elif high:
            bounds = f" {'<=' if self.le is not None else '<'} {high[:-1]}"
        else:
            bounds = ""
        what = "an integer" if integer else "a finite number"
        return what + bounds + (f", {self.note}" if self.note else "")

    def check(self, key: str, value: Any) -> None:
        items = value if isinstance(value, tuple) else (value,)
        if all(self.allows(v) for v in items):
            return
        integer = all(isinstance(v, int) for v in items)
        if isinstance(value, tuple):
            raise ConfigError(f"{key} entries must each be {self.describe(integer)}, got {list(value)}")
        raise ConfigError(f"{key} must be {self.describe(integer)}, got {value!r}")


@dataclass(frozen=True)
class OneOf:
    """The strings a field allows."""

    choices: tuple[str, ...]

    def check(self, key: str, value: Any) -> None:
        if value not in self.choices:
            raise ConfigError(f"{key} must be one of {', '.join(self.choices)}; got {value!r}")


@dataclass(frozen=True)
class NonEmpty:
    """A string that must not be empty (``what`` says what it names)."""

    what: str

    def check(self, key: str, value: Any) -> None:
        if not value:
            raise ConfigError(f"{key} must be {self.what}, got {value!r}")


Rule = Range | OneOf | NonEmpty


def checked(default: Any, rule: Rule) -> Any:
    """A dataclass field with a default whose values ``rule`` restricts (checked by ``validate``)."""
    return field(default=default, metadata={RULE: rule})
