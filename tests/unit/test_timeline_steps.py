"""``plot timeline``: the window holds the last N steps of every rank, each step's start marked."""

from __future__ import annotations

from shardwise.observe.plots import _window, step_marks


def _step(rank: int, step: int, ts: float) -> dict:
    return {"pid": rank, "cat": "step", "name": f"step {step}", "ts": ts, "dur": 900.0, "ph": "X"}


def test_the_window_counts_steps_not_spans_and_marks_each_start() -> None:
    events = [_step(rank, step, 1000.0 * step + 50 * rank) for step in range(5) for rank in range(2)]
    start, end = _window(events, 3)
    assert (start, end) == (2000.0, 4000.0 + 50 + 900)  # steps 2-4 on both ranks, not 1.5 steps
    rank_1 = [e for e in events if e["pid"] == 1 and start <= e["ts"] <= end]
    assert step_marks(rank_1, start) == [(0.05, "step 2"), (1.05, "step 3"), (2.05, "step 4")]
