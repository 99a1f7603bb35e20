"""The communication thread: submitted work runs in the order submitted, and errors reach whoever waits."""

from __future__ import annotations

import pytest

from shardwise.collectives.comm_thread import CommThread


def test_work_runs_in_the_order_submitted_and_errors_reach_the_waiter() -> None:
    thread, seen = CommThread(), []
    done = [thread.submit(lambda i=i: seen.append(i)) for i in range(50)]

    def fail() -> None:
        raise ValueError("a message failed")

    failed = thread.submit(fail)
    assert all(p.wait() for p in done) and seen == list(range(50))
    with pytest.raises(ValueError, match="a message failed"):
        failed.wait()
    assert thread.idle()

