"""Amounts with units, read one way by every flag that takes one: memory (``plan --device-memory``,
``--overhead``) in bytes, and a link (``plan --link``, ``bench compress --link``) in bytes per second.

Case decides what a unit counts: ``B`` (or ``byte``) is a byte, ``b`` (or ``bit``) a bit, as in
networking's ``Gb/s`` and ``GB/s``. So ``400Gb/s``, ``400Gbps`` and ``400Gbit`` are 5e10 bytes per
second, and so are ``50GB/s`` and ``50GBps``. Prefixes are decimal in either case (``k``/``K`` 1e3,
``m``/``M`` 1e6, ``g``/``G`` 1e9, ``t``/``T`` 1e12, ``p``/``P`` 1e15) or binary with an ``i``
(``KiB``, ``GiB``, ``Gibit``: powers of 1024). A rate may end in ``/s`` or ``ps``; an amount of memory
may not, and may not be in bits. A unit is always required: a bare ``80`` meant as GB would otherwise
plan for 80 bytes.

This is not tc's syntax, where ``gbps`` means gigaBYTES per second: here a lower-case ``b`` is a bit
wherever it stands, so ``1gbps`` is 1 Gbit/s (``bench compress --link`` hands tc the rate in bits).
No communication: arithmetic on strings.
"""

from __future__ import annotations

import math
import re

from shardwise.config import ConfigError

_NUMBER = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*")
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_WORDS = {"bytes": 1, "byte": 1, "bits": 8, "bit": 8}  # spelled out, in any case: bits per unit
MEMORY_EXAMPLE = "80GB or 80GiB"
RATE_EXAMPLE = "400Gbit, 400Gb/s or 50GB/s"


def _split(text: str) -> tuple[float, str, bool] | None:
    """(number, the unit without a rate suffix, whether it had one), or None if ``text`` is no amount."""
    match = _NUMBER.fullmatch(text)
    if not match:
        return None
    unit = match.group(2)
    per_second = unit.endswith("/s") or unit.lower().endswith("ps")
    unit = unit[:-2] if per_second else unit
    return float(match.group(1)), unit, per_second


def _scale(unit: str) -> tuple[float, int] | None:
    """(the prefix's factor, 1 for bytes or 8 for bits) of ``GB``, ``Gb``, ``Gibit``...; None if not one."""
    word = next((w for w in _WORDS if unit.lower().endswith(w)), None)
    if word is not None:
        prefix, per = unit[: -len(word)], _WORDS[word]
    elif unit and unit[-1] in "Bb":
        prefix, per = unit[:-1], 1 if unit[-1] == "B" else 8
    else:
        return None
    binary = prefix.lower().endswith("i") and len(prefix) == 2
    power = _PREFIX.get(prefix[:-1].lower() if binary else prefix.lower())
    if power is None:
        return None
    return (1024.0**power if binary else 1000.0**power), per


def _amount(text: str, flag: str, example: str, rate: bool, zero_ok: bool = False) -> float:
    split = _split(text)
    scale = _scale(split[1]) if split else None
    if split is None or scale is None:
        raise ConfigError(
            f"{flag} {text!r}: give a number with a unit, e.g. {example} (B: bytes, b or bit: bits)"
        )
    number, _, per_second = split
    if per_second and not rate:
        raise ConfigError(f"{flag} {text!r} is a rate; give an amount of memory, e.g. {example}")
    factor, per = scale
    if per == 8 and not rate:
        raise ConfigError(
            f"{flag} {text!r} is in bits (b); memory is counted in bytes (B), e.g. {example}"
        )
    value = number * factor / per
    if not (value >= 0 if zero_ok else value > 0) or value == math.inf:
        raise ConfigError(f"{flag} must be a finite amount {'>=' if zero_ok else '>'} 0, got {text!r}")
    return value


def parse_bytes(text: str, flag: str = "--device-memory", zero_ok: bool = False) -> float:
    """Bytes of memory: ``80GB`` (8e10), ``80GiB`` (80 x 2**30) or ``512B``; bits are refused, and so
    is 0 unless ``zero_ok``."""
    return _amount(text, flag, MEMORY_EXAMPLE, rate=False, zero_ok=zero_ok)


def parse_rate(text: str, flag: str = "--link") -> float:
    """A link in bytes per second: ``400Gbit``, ``400Gb/s`` or ``400Gbps`` (bits: 5e10), ``50GB/s`` or
    ``50GBps`` (bytes: 5e10)."""
    return _amount(text, flag, RATE_EXAMPLE, rate=True)


def describe_rate(bytes_per_s: float) -> str:
    """``50 GB/s (400 Gbit/s)``: a link in both units, so a reader sees how a flag was read."""
    return f"{_decimal(bytes_per_s)}B/s ({_decimal(bytes_per_s * 8)}bit/s)"


def _decimal(value: float) -> str:
    """``value`` with the largest decimal prefix that keeps it >= 1: ``50 G``, ``1.25 M``."""
    for prefix, power in (("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3)):
        if value >= 10**power:
            return f"{value / 10**power:g} {prefix}"
    return f"{value:g} "
