"""Reading a config: TOML files, dotted-key overrides, coercion to each field's type, and the check
that every value has its field's type and obeys its declared rule.

``read_toml`` reads a TOML file (bounded in size, UTF-8, a regular file) into a dict; ``merge_table``
lays its tables over a config dataclass and ``set_key`` sets one dotted key (``"ddp.bucket_mb"``),
both through ``_coerce``, which turns a TOML value or a CLI string into the field's type or says why
not. ``check_values`` checks every field's type, then applies the rule it declares
(``shardwise.config_rules``). ``to_dict`` turns a config into plain data. All of it works on any
config dataclass; ``shardwise.config.load_config`` puts it together for ``TrainConfig``. Every
problem is a one-line ``ConfigError``. Communication: none.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from shardwise.config_rules import RULE
from shardwise.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

MAX_CONFIG_BYTES = 1 << 20  # a TOML config is a few kB; more is a wrong file, not a config


def check_values(config: Any, prefix: str = "") -> None:
    """Every field of ``config`` (tables too): its type, then the rule its field declares."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        key, value, hint = prefix + f.name, getattr(config, f.name), hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a table
            if type(value) is not hint:
                raise ConfigError(_table_message(key, value, hint))
            check_values(value, f"{key}.")
            continue
        _check_type(key, value, hint)
        rule = f.metadata.get(RULE)
        if rule is not None:
            rule.check(key, value)


def _check_type(key: str, value: Any, hint: Any) -> None:
    if typing.get_origin(hint) is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, tuple) or not all(_is_a(v, item) for v in value):
            raise ConfigError(f"{key} must be a list of {_type_name(item)}, got {value!r}")
    elif not _is_a(value, hint):
        raise ConfigError(f"{key} must be {_type_name(hint)}, got {value!r}")


def _is_a(value: Any, hint: Any) -> bool:
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _table_message(key: str, value: Any, table: Any) -> str:
    """What to say when a whole table is given one plain value (``--set model=gpt``)."""
    example = next(f for f in fields(table) if f.default not in ("", (), dataclasses.MISSING))
    default = str(example.default).lower() if isinstance(example.default, bool) else example.default
    return (
        f"{key} is a table, not a value (got {value!r}); set its keys, e.g. "
        f"--set {key}.{example.name}={default}, or {example.name} = ... under [{key}] in a TOML file"
    )



def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict, or a one-line ``ConfigError`` saying why it cannot be."""
    try:
        mode = os.stat(path).st_mode  # before opening: opening a pipe would wait for a writer
        if stat.S_ISDIR(mode):
            raise IsADirectoryError
        if not stat.S_ISREG(mode):  # /dev/zero, a pipe, a socket: no end, or no file to read
            raise ConfigError(f"--config {path} is not a regular file; give a TOML file")
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # a file that grows after the stat is cut too
    except FileNotFoundError:
        raise ConfigError(f"--config {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a folder; give a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--config {path} is over {MAX_CONFIG_BYTES} bytes (a config is a few kB); give a TOML file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config {path} is not a text file (byte {exc.start} is not UTF-8); give a TOML file"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        reason = " ".join(str(exc).split())  # one line, whatever the parser says
        raise ConfigError(f"--config {path} is not valid TOML: {reason}") from None


def set_key(config: Any, dotted: str, value: Any, _prefix: str = "") -> Any:
    """Return a copy of ``config`` with the field at ``dotted`` (e.g. ``"ddp.bucket_mb"``) replaced."""
    head, _, rest = dotted.partition(".")
    names = {f.name: f for f in fields(config)}
    if head not in names:
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown config key {_prefix + dotted!r}; known here: {known}")
    current = getattr(config, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"{_prefix + head!r} has no sub-keys (got {_prefix + dotted!r})")
        return replace(config, **{head: set_key(current, rest, value, f"{_prefix}{head}.")})
    if dataclasses.is_dataclass(current):
        raise ConfigError(_table_message(_prefix + head, value, type(current)))
    hint = typing.get_type_hints(type(config))[head]
    return replace(config, **{head: _coerce(_prefix + dotted, value, hint)})


def merge_table(config: Any, table: Mapping[str, Any], prefix: str) -> Any:
    """A copy of ``config`` with ``table`` (a TOML file's dict) laid over it; ``prefix`` names where
    ``table`` sits in the whole config ("" at the top), for the error messages."""
    for key, value in table.items():
        if isinstance(value, Mapping):
            sub = getattr(config, key, None)
            if not dataclasses.is_dataclass(sub):
                tables = ", ".join(_tables(config))
                raise ConfigError(f"unknown config table [{prefix}{key}]; known tables: {tables}")
            config = replace(config, **{key: merge_table(sub, value, prefix=f"{prefix}{key}.")})
        else:
            config = set_key(config, key, value, prefix)
    return config


def _tables(config: Any) -> list[str]:
    return [f.name for f in fields(config) if dataclasses.is_dataclass(getattr(config, f.name))]


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn a TOML value or a CLI string into the field's type, or say why not."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    try:
        if origin is tuple:
            (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
            if isinstance(value, str):
                value = _comma_items(name, value)
            if not isinstance(value, (list, tuple)):
                raise TypeError(value)
            return tuple(_coerce(name, v, item) for v in value)
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            if not isinstance(value, bool):  # TOML says true/false; 2 is not a yes
                raise TypeError(value)
            return value
        # TOML values must already be of the field's kind (a CLI string is parsed): true is no number
        if isinstance(value, bool) or (hint is str and not isinstance(value, str)):
            raise TypeError(value)
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return hint(value)
    except ConfigError:
        raise  # an item of a tuple, already named
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name} expects {_expected(hint)}, got {value!r}") from None


def _comma_items(name: str, value: str) -> list[str]:
    """The items of a comma-separated CLI list ("" is none); an empty item is refused, not dropped,
    since ``--pp-split ,,`` meant something and the default is not it."""
    if not value.strip():
        return []
    items = [v.strip() for v in value.split(",")]
    if "" in items:
        raise ConfigError(
            f"{name} has an empty item in {value!r} (item {items.index('') + 1} of {len(items)}); "
            "give comma-separated values with none empty, or '' for none"
        )
    return items


def _expected(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a comma-separated list of {_expected(items[0])}"
    if hint is bool:  # what a command line may say; a TOML file says true or false
        return "bool (true/false, yes/no or 1/0)"
    return str(getattr(hint, "__name__", hint))


def to_dict(config: Any) -> dict[str, Any]:
    """A plain, JSON-ready dict of a config (tuples become lists)."""
    return dataclasses.asdict(config)
