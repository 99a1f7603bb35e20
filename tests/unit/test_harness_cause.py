"""The test harness names the rank that caused a failure, not a peer that only lost its connection."""

from __future__ import annotations

import queue

from shardwise.testing.harness import _root_cause

GONE = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:63699."


def test_a_lost_peer_gives_way_to_the_error_that_caused_it() -> None:
    results: queue.Queue = queue.Queue()
    results.put((1, False, "RuntimeError: parameters b.weight received no gradient"))
    assert _root_cause(results, 0, GONE) == (1, "RuntimeError: parameters b.weight received no gradient")


def test_a_failure_of_its_own_is_reported_as_it_is() -> None:
    results: queue.Queue = queue.Queue()
    results.put((1, False, "RuntimeError: something else"))
    assert _root_cause(results, 0, "ValueError: bad input") == (0, "ValueError: bad input")
    assert results.qsize() == 1  # not even read


def test_with_no_other_failure_the_lost_peer_is_what_is_said(monkeypatch) -> None:
    import shardwise.testing.harness as harness

    monkeypatch.setattr(harness, "CAUSE_GRACE_S", 0.05)
    results: queue.Queue = queue.Queue()
    results.put((1, False, GONE))  # the other rank lost its peer too: nothing better to say
    assert _root_cause(results, 0, GONE) == (0, GONE)
