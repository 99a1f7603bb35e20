"""Ranks forked from the long-lived forkserver see the environment of the launch, not of its start."""

from __future__ import annotations

import os

import pytest

from shardwise.launcher import launch_local
from shardwise.testing import run_on_ranks


def _read(*_: object) -> str | None:
    return os.environ.get("SW_PROCSTART_PROBE")


def _read_rank() -> tuple[str | None, str]:
    return os.environ.get("SW_PROCSTART_PROBE"), os.environ["RANK"]


def test_each_launch_passes_its_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SW_PROCSTART_PROBE", "first")
    assert run_on_ranks(_read, 2) == ["first", "first"]  # the forkserver starts (or already ran) here
    monkeypatch.setenv("SW_PROCSTART_PROBE", "second")
    assert run_on_ranks(_read, 2) == ["second", "second"]
    monkeypatch.delenv("SW_PROCSTART_PROBE")
    assert run_on_ranks(_read, 2) == [None, None]
    monkeypatch.setenv("SW_PROCSTART_PROBE", "launched")
    assert launch_local(_read_rank, (), 2) == {0: ("launched", "0"), 1: ("launched", "1")}
