"""``plot timeline``: the window holds the last N steps of every rank, each step's start marked."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.observe.plots import _window, step_marks


def _step(rank: int, step: int, ts: float) -> dict:
    return {"pid": rank, "cat": "step", "name": f"step {step}", "ts": ts, "dur": 900.0, "ph": "X"}


def test_the_window_counts_steps_not_spans_and_marks_each_start() -> None:
    events = [_step(rank, step, 1000.0 * step + 50 * rank) for step in range(5) for rank in range(2)]
    start, end = _window(events, 3)
    assert (start, end) == (2000.0, 4000.0 + 50 + 900)  # steps 2-4 on both ranks, not 1.5 steps
    rank_1 = [e for e in events if e["pid"] == 1 and start <= e["ts"] <= end]
    assert step_marks(rank_1, start) == [(0.05, "step 2"), (1.05, "step 3"), (2.05, "step 4")]


SPAN = '{"ph": "X", "pid": 0, "name": "fwd", "cat": "compute", "ts": 0, "dur": 5}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "trace.json is empty: nothing to draw"),
        ('{"traceEvents": [' + SPAN, "is not JSON (Expecting ',' delimiter at line 1"),  # cut short
        ("not json", "is not JSON (Expecting value at line 1 column 1)"),
        ("\xff\xfe", "is not JSON"),
        ('{"traceEvents": 5}', '"traceEvents" should be a list of events, got int'),
        ('{"traceEvents": []}', 'holds no spans (events with "ph": "X")'),
        ('{"other": 1}', '"traceEvents" should be a list of events, got NoneType'),
        ('{"traceEvents": [5, "x", {"ph": "B"}]}', "holds no spans"),
        ('{"traceEvents": [{"ph": "X", "pid": 0, "name": "a"}]}', "needs numbers ts and dur >= 0"),
        ('{"traceEvents": [{"ph": "X", "pid": "r0", "ts": 0, "dur": 1}]}', "has no integer pid (the rank)"),
        ('[{"ph": "X", "pid": 0, "ts": 0, "dur": 1, "args": {"kind": "Q"}}]', "pipeline action of kind 'Q'"),
    ],
)
def test_a_bad_trace_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    (tmp_path / "trace.json").write_bytes(text.encode("latin-1"))
    assert main(["plot", "timeline", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise plot: error: ") and message in err[0], err


def test_a_trace_that_is_a_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "trace.json").mkdir()
    assert main(["plot", "timeline", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trace.json cannot be read: Is a directory" in err[0], err


def test_a_bare_array_of_spans_is_a_trace_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Chrome's JSON Array Format: the events without the object around them."""
    pytest.importorskip("matplotlib")
    (tmp_path / "trace.json").write_text(f"[{SPAN}]")
    assert main(["plot", "timeline", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 0
