"""Ranks forked from the long-lived forkserver get the launch's environment and output, not its start's."""

from __future__ import annotations

import os
import sys

import pytest

from shardwise import procstart
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


def _say(rank: int, *_: object) -> None:
    print(f"rank {rank} writes to the launch's output", flush=True)
    print(f"rank {rank} writes to the launch's error", file=sys.stderr, flush=True)


def test_ranks_write_where_the_launch_writes(capfd: pytest.CaptureFixture[str]) -> None:
    with capfd.disabled():  # the forkserver (if not already running) starts outside this capture
        procstart.start_early()
    run_on_ranks(_say, 2)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"rank {rank} writes to the launch's output" in out
        assert f"rank {rank} writes to the launch's error" in err
