"""The hang diagnosis on made-up states, and the monitor's bookkeeping (no processes)."""

from __future__ import annotations

import time

from shardwise.observe.monitor import Monitor
from shardwise.observe.watchdog import diagnose


def _state(step: int, phase: str, last: dict, blocked: dict | None = None, age: float = 0.5) -> dict:
    return {
        "step": step,
        "phase": phase,
        "phase_for_s": 12.0,
        "blocked": blocked,
        "blocked_for_s": 30.0 if blocked else 0.0,
        "last": last,
        "frame": "model.py:10 in forward",
        "age_s": age,
    }


WAIT = {"group": "dp", "op": "all_reduce", "seq": 7, "label": "bucket 2", "peer": None}


def _call(op: str, seq: int, group: str = "dp") -> dict:
    return {"group": group, "op": op, "seq": seq, "label": "", "peer": None}


def test_a_stopped_rank_is_named_with_where_it_was() -> None:
    me = _state(40, "gradient sync", {"dp": WAIT}, WAIT)
    states = {0: me, 1: _state(40, "backward", {"dp": _call("all_reduce", 6)}, age=30.0), 2: me}
    line = diagnose(0, me, states, stale_s=4.0)
    assert line.startswith("hang: rank 1 stopped responding 30 s ago")
    assert "in backward of step 40" in line and "all_reduce #7 on dp (bucket 2)" in line


def test_a_rank_behind_is_named_with_its_phase_and_frame() -> None:
    me = _state(40, "gradient sync", {"dp": WAIT}, WAIT)
    behind = _state(40, "forward", {"dp": _call("all_reduce", 6)})
    line = diagnose(0, me, {0: me, 1: me, 2: behind}, stale_s=4.0)
    assert line.startswith("hang: rank 2 has not entered all_reduce #7 on dp (bucket 2)")
    assert "in forward of step 40 since 12 s (at model.py:10 in forward)" in line


def test_mismatched_collectives_are_named() -> None:
    me = _state(40, "gradient sync", {"dp": WAIT}, WAIT)
    other = _call("broadcast", 7)
    line = diagnose(1, me, {0: me, 1: me, 2: _state(40, "metrics", {"dp": other}, other)}, stale_s=4.0)
    assert line.startswith("hang: mismatched collectives on dp: rank 1 is in all_reduce #7")
    assert "rank 2 in broadcast #7" in line


def test_a_rank_that_never_published_and_a_slow_network() -> None:
    me = _state(1, "gradient sync", {"dp": WAIT}, WAIT)
    assert "rank 1 never published" in diagnose(0, me, {0: me, 1: None}, stale_s=4.0)
    assert "every rank has entered" in diagnose(0, me, {0: me, 1: me}, stale_s=4.0)


def test_monitor_knows_the_call_waited_in_and_records_spans() -> None:
    monitor = Monitor()
    monitor.tracing = True
    monitor.set_phase("forward", 3)
    call = monitor.issue("dp", "all_reduce", 1, "bucket 0")
    monitor.wait_start(call)
    snap = monitor.snapshot()
    assert snap["blocked"]["op"] == "all_reduce" and snap["step"] == 3 and snap["phase"] == "forward"
    time.sleep(0.01)
    monitor.wait_end(call)
    monitor.set_phase("backward")
    assert monitor.snapshot()["blocked"] is None
    names = [s.name for s in monitor.spans]
    assert names == ["all_reduce #1 on dp (bucket 0)", "forward"]
    assert monitor.spans[0].duration >= 0.01


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


class _Blocked(Monitor):
    """A rank waiting in one all_reduce since it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.since = time.monotonic()

    def snapshot(self) -> dict:
        waited = time.monotonic() - self.since
        return {**_state(40, "gradient sync", {"dp": WAIT}, WAIT), "blocked_for_s": waited}


def test_a_stopped_ranks_age_counts_from_the_start_of_the_wait_not_from_the_report() -> None:
    """It said "stopped responding 5 s ago" after 25 s: the age was counted from the report on."""
    from shardwise.observe.watchdog import STALE_AFTER_INTERVALS, Watchdog

    store = _Store()
    store.set(
        "watchdog/rank1",
        '{"step": 40, "phase": "backward", "phase_for_s": 1.0, "blocked": null, '
        '"blocked_for_s": 0.0, "last": {}, "frame": ""}',
    )  # fmt: skip  (rank 1 published once, then stopped)
    reports: list = []
    interval, timeout = 0.05, 1.0
    dog = Watchdog(store, 0, 2, timeout, interval, _Blocked(), on_hang=lambda *a: reports.append(a))
    while not reports:
        dog.tick()
        time.sleep(interval)
    line, states, _ = reports[0]
    report_window = interval * (STALE_AFTER_INTERVALS + 1)
    assert states[1]["age_s"] > timeout > 3 * report_window, states[1]["age_s"]  # not just the report's
    assert line.startswith("hang: rank 1 stopped responding 1 s ago"), line
