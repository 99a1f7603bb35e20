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
