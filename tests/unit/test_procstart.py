"""A forked rank takes the launcher's environment, not the forkserver's; ranks are told apart."""

from __future__ import annotations

import os

import pytest

from shardwise import procstart


def test_adopt_environment_sets_removes_and_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SW_STALE", "from the forkserver's start")
    monkeypatch.setenv("SW_CHANGED", "old")
    monkeypatch.setenv("RANK", "3")  # what the rank's starter set for it alone
    launcher = {k: v for k, v in os.environ.items() if k not in ("SW_STALE", "RANK")}
    launcher.update(SW_CHANGED="new", SW_ADDED="1", RANK="0")
    procstart.adopt_environment(launcher, keep=lambda name: name == "RANK")
    assert "SW_STALE" not in os.environ
    assert (os.environ["SW_CHANGED"], os.environ["SW_ADDED"], os.environ["RANK"]) == ("new", "1", "3")


def test_ranks_are_the_forkservers_children_or_spawned_children() -> None:
    server = "python -c from multiprocessing.forkserver import main; main(5, 6, ['torch'])"
    assert procstart.is_rank_process(parent_pid=200, launcher_pid=100, cmdline=server)
    assert not procstart.is_rank_process(parent_pid=100, launcher_pid=100, cmdline=server)  # the server
    tracker = "python -c from multiprocessing.resource_tracker import main;main(7)"
    assert not procstart.is_rank_process(parent_pid=100, launcher_pid=100, cmdline=tracker)
    spawned = "python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=7)"
    assert procstart.is_rank_process(parent_pid=100, launcher_pid=100, cmdline=spawned)
