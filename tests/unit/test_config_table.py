"""docs/api.md's table of config keys is the one scripts/config_table.py generates from the dataclasses."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from shardwise.config import TrainConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "config_table.py"


def _script():
    spec = importlib.util.spec_from_file_location("config_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_keys(cls: type, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            keys |= _leaf_keys(type(f.default_factory()), f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def test_the_docs_table_is_current() -> None:
    table = _script()
    assert table.current_table() == table.render(), "run: python scripts/config_table.py --write"


def test_the_table_has_every_key_once_with_its_comment() -> None:
    rows = _script().rows()
    keys = [row[0].strip("`") for row in rows]
    assert sorted(keys) == sorted(_leaf_keys(TrainConfig))
    by_key = {row[0].strip("`"): row for row in rows}
    assert by_key["data.micro_batches"][5].startswith("gradient accumulation")  # a comment on its line
    assert by_key["hang_timeout_s"][5].startswith("a rank blocked in one call")  # comment lines above
    assert by_key["data.global_batch"][1] == "`--global-batch`" and by_key["data.global_batch"][3] == "`16`"
