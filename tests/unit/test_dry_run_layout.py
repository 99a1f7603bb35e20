"""``plan --dry-run`` runs one layout: the flags must name one strategy, one pp and one tp degree."""

from __future__ import annotations

import argparse

import pytest

from shardwise.commands.plan_dry_run import dry_run_layout
from shardwise.config import ConfigError


def _args(**given: object) -> argparse.Namespace:
    return argparse.Namespace(**{"devices": 8, "pp": None, "tp": None, **given})


def test_the_layout_the_flags_name() -> None:
    layout = dry_run_layout(_args(devices=512, pp="8", tp="8"), ["zero1"], micro_batches=8)
    assert (layout.strategy, layout.dp, layout.pp, layout.tp) == ("zero1", 8, 8, 8)
    assert dry_run_layout(_args(), ["zero3"], micro_batches=1).dp == 8  # pp and tp default to 1


@pytest.mark.parametrize(
    ("given", "strategies", "says"),
    [
        ({}, ["zero1", "zero2"], "give one strategy, got --strategies zero1,zero2"),
        ({"pp": "1,2"}, ["ddp"], "give one --pp degree"),
        ({"devices": 2048}, ["ddp"], "1 to 1024 devices (got --devices 2048)"),
        ({"devices": None}, ["ddp"], "none given"),
        ({"tp": "3"}, ["ddp"], "--devices 8 is not divisible by pp(1) x tp(3) = 3"),
    ],
)
def test_anything_else_is_one_line(given: dict, strategies: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")) as error:
        dry_run_layout(_args(**given), strategies, micro_batches=1)
    assert "\n" not in str(error.value)
