"""The command line's signal handling: which exception, which exit code, what is left installed."""

from __future__ import annotations

import os
import signal

import pytest

from shardwise import signals


def test_exit_codes_follow_the_shell() -> None:
    assert signals.exit_code(signals.Interrupted(signal.SIGTERM)) == 143
    assert signals.exit_code(signals.Interrupted(signal.SIGINT)) == 130
    assert signals.exit_code(KeyboardInterrupt()) == 130
    assert signals.describe(signals.Interrupted(signal.SIGTERM)) == "interrupted (SIGTERM)"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_first_signal_unwinds_a_second_would_end_the_process(sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in signals.HANDLED}
    previous = signals.install()
    try:
        assert signals.install() == {}  # installed once; a nested install has nothing to restore
        with pytest.raises(signals.Interrupted) as info:
            os.kill(os.getpid(), sig)
        assert info.value.signum == sig
        assert all(signal.getsignal(s) is signal.SIG_DFL for s in signals.HANDLED)
    finally:
        signals.restore(previous)
    assert {s: signal.getsignal(s) for s in signals.HANDLED} == before


def _sleep() -> None:
    import time

    time.sleep(60)


def test_a_signal_to_the_launcher_ends_its_spawned_ranks_before_it_unwinds() -> None:
    """A rank still starting (spawned, in no list the agent cleans up) used to outlive the unwinding
    and print a traceback, or the resource tracker a leaked-semaphore warning, after the one line."""
    import multiprocessing

    import psutil

    from shardwise import launcher

    before = {s: signal.getsignal(s) for s in signals.HANDLED}
    rank = multiprocessing.get_context("spawn").Process(target=_sleep)
    rank.start()
    try:
        installed = launcher._install_launch_handlers()
        with pytest.raises(signals.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
        # ended by the handler itself, before the exception unwound anything
        assert not psutil.pid_exists(rank.pid) or psutil.Process(rank.pid).status() == psutil.STATUS_ZOMBIE
        assert all(signal.getsignal(s) is signal.SIG_DFL for s in signals.HANDLED)  # a second: at once
        assert set(installed) == set(signals.HANDLED)
    finally:
        rank.kill()
        rank.join()
        for s, handler in before.items():
            signal.signal(s, handler)


def _fake_forkserver_start() -> dict[str, object]:
    """A function named and filed as multiprocessing's forkserver ``Popen._launch``."""
    source = "def _launch(wait):\n    wait()\n"
    namespace: dict[str, object] = {}
    exec(compile(source, "/usr/lib/python3/multiprocessing/popen_forkserver.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("hold_s", [5.0, 0.0], ids=["held", "not-past-the-limit"])
def test_a_signal_while_a_rank_is_forked_lands_once_its_start_is_over(
    monkeypatch: pytest.MonkeyPatch, hold_s: float
) -> None:
    """The forkserver forks a rank after its start-up data is written: a signal landing in between
    used to unwind before the rank existed, which then started alone and printed a traceback (a
    semaphore already removed). The launcher holds it until the start returns, HOLD_S at most."""
    import time

    from shardwise import launcher

    monkeypatch.setattr(launcher, "HOLD_S", hold_s)
    start = _fake_forkserver_start()["_launch"]
    before = {s: signal.getsignal(s) for s in signals.HANDLED}
    started: list[str] = []

    def wait_for_the_pid() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the held signal comes back every 20 ms meanwhile
        started.append("rank")

    try:
        launcher._install_launch_handlers()
        with pytest.raises(signals.Interrupted):
            start(wait_for_the_pid)  # type: ignore[operator]
            time.sleep(5)
        assert started == (["rank"] if hold_s else [])
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
