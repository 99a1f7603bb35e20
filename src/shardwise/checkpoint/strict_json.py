"""Strict readers of a parsed JSON value: the type each field must have, or one ``ManifestError`` line.

A manifest is parsed field by field through these, so damage (a float where an integer belongs, a
bool, a missing key) is named where it is rather than failing later. No communication happens here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.checkpoint.errors import ManifestError


def show(value: Any) -> str:
    """A value for a one-line message: its repr, cut short (repr escapes newlines)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_int(value: Any, where: str) -> int:
    # bool is an int in Python and a float would be silently rounded: both are damage here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{where}: expected an integer, got {show(value)}")
    return value


def as_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{where}: expected a string, got {show(value)}")
    return value


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{where}: expected a JSON list, got {show(value)}")
    return value


def as_obj(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: expected a JSON object, got {show(value)}")
    return value


def require(data: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ManifestError(f"{where}: missing {', '.join(missing)}")
