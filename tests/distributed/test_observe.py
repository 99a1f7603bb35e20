"""Seeing inside a run: the hang watchdog on real ranks, the trace, plots and TensorBoard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.observe.watchdog import Watchdog
from shardwise.testing import run_on_ranks

from .cli_helpers import SRC, in_process, last_json, shardwise


def _start(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    command = [sys.executable, "-m", "shardwise", "train", "--run-dir", str(run_dir), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_rows(run_dir: Path, rows: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {rows} rows")


def _gone(pids: list[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return not alive


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_job_stops(tmp_path: Path) -> None:
    run = _start(tmp_path, "--nproc", "3", "--steps", "2000", "--preset", "tiny", "--hang-timeout-s", "8")
    seen: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: seen.extend((time.monotonic(), line) for line in run.stderr))
    try:
        _wait_rows(tmp_path, 5)
        victim = int((tmp_path / "pids" / "rank1.0").read_text())
        reader.start()
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        run.wait(timeout=90)
        reader.join(timeout=10)
    finally:
        if run.poll() is None:
            run.kill()
    hang = [(at, line) for at, line in seen if "hang:" in line]
    assert run.returncode != 0 and len(hang) == 1, seen[-5:]
    at, line = hang[0]
    assert "rank 1 stopped responding" in line and " #" in line and " on " in line
    assert at - stopped < 8 + 20, at - stopped  # the timeout, then a look at every rank's state
    pids = [int(p.read_text()) for p in (tmp_path / "pids").iterdir()]
    deadline = time.monotonic() + 15
    while not _gone(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pids), "rank processes outlived the job"


@pytest.mark.slow
def test_a_stopped_rank_recovers_under_max_restarts(tmp_path: Path) -> None:
    args = [
        "--nproc",
        "2",
        "--steps",
        "40",
        "--preset",
        "tiny",
        "--hang-timeout-s",
        "6",
        "--max-restarts",
        "1",
    ]
    run = _start(tmp_path, *args, "--checkpoint-every", "5", "--json")
    try:
        _wait_rows(tmp_path, 12)
        os.kill(int((tmp_path / "pids" / "rank1.0").read_text()), signal.SIGSTOP)
        stdout, stderr = run.communicate(timeout=150)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-2000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["restarts"] == 1 and summary["steps"] == 40
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(40))


def _mismatched(rank: int, world_size: int) -> str | None:
    """Every rank is blocked in call #3 on dp; rank 2's is a broadcast, the others' an all-reduce (as
    when a rank skipped a collective). The calls are only recorded, not sent: what is under test is the
    watchdogs publishing and reading each other's state through the job's store."""
    from shardwise.observe.monitor import MONITOR

    for seq in (1, 2):
        MONITOR.wait_end(MONITOR.issue("dp", "all_reduce", seq))
    call = MONITOR.issue("dp", "broadcast" if rank == 2 else "all_reduce", 3, "bucket 0")
    MONITOR.wait_start(call)
    seen: list[str | None] = []
    store = dist.distributed_c10d._get_default_store()
    watchdog = Watchdog(store, rank, world_size, timeout_s=2, interval_s=0.3)
    watchdog.on_hang = lambda line, states, stale: seen.append(line)  # type: ignore[assignment]
    watchdog.start()
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline:
        time.sleep(0.1)
    MONITOR.wait_end(call)
    dist.barrier()  # every rank has looked before any stops publishing
    watchdog.stop()
    return seen[0] if seen else "no report"


def test_a_rank_in_another_collective_is_named_with_the_mismatch() -> None:
    lines = run_on_ranks(_mismatched, 3, timeout_s=90)
    assert "no report" not in lines, lines
    reported = [line for line in lines if line]
    assert len(reported) == 1, lines  # one rank says it, once
    assert reported[0].startswith("hang: mismatched collectives on dp:")
    assert "broadcast #3" in reported[0] and "all_reduce #3" in reported[0]


# -- trace, plots, TensorBoard -----------------------------------------------------------------------
@pytest.mark.slow
def test_trace_plots_and_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = shardwise(
        "train", "--nproc", "2", "--steps", "30", "--preset", "tiny", "--eval-every", "10",
        "--trace", "--tensorboard", "--run-dir", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json(result)["steps"] == 30
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for event in events:
        assert {"ph", "ts", "dur", "pid", "tid"} <= set(event), event
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        steps = [e for e in spans if e["pid"] == rank and e["cat"] == "step"]
        assert len(steps) == 30
        phases = [e for e in spans if e["pid"] == rank and e["name"] in ("forward", "backward")]
        inside = [any(s["ts"] <= p["ts"] and p["ts"] + p["dur"] <= s["ts"] + s["dur"] + 1 for s in steps)
                  for p in phases]  # fmt: skip
        assert phases and all(inside)
        assert any(e["name"].startswith("block 0 backward") for e in spans if e["pid"] == rank)
        assert any(
            e["cat"] == "comm" and e["name"].startswith("all_reduce") for e in spans if e["pid"] == rank
        )
    plots, plots_err = in_process(["plot", str(tmp_path)], capsys)  # cli.main here: no rank starts
    timeline, timeline_err = in_process(["plot", "timeline", str(tmp_path)], capsys)
    assert plots == 0 and timeline == 0, plots_err + timeline_err
    for name in ("loss", "throughput", "ranks", "memory", "timeline"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def _wait_live_trace(run_dir: Path, run: subprocess.Popen[str], timeout_s: float = 90) -> list[dict]:
    """The spans of ``trace.json`` once it holds steps of both ranks, read while ``run`` still goes."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "trace.json"
    while time.monotonic() < deadline and run.poll() is None:
        if path.exists():
            spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
            if {e["pid"] for e in spans if e["cat"] == "step"} == {0, 1}:
                return spans
        time.sleep(0.2)
    raise AssertionError(f"no trace of both ranks in {path} while the run went (exit {run.poll()})")


@pytest.mark.slow
def test_plot_a_run_that_is_still_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Curves and the timeline: the trace is written every few seconds while the run goes."""
    args = ["--nproc", "2", "--steps", "100000", "--preset", "tiny", "--hang-timeout-s", "0", "--trace"]
    run = _start(tmp_path, *args, "--eval-every", "0")
    try:
        _wait_rows(tmp_path, 5)
        result, result_err = in_process(["plot", str(tmp_path)], capsys)
        _wait_live_trace(tmp_path, run)
        timeline, timeline_err = in_process(["plot", "timeline", str(tmp_path)], capsys)
        assert run.poll() is None, "the run ended before the plots were drawn"
    finally:
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=60)
    assert result == 0, result_err
    assert (tmp_path / "plots" / "loss.png").exists()
    assert timeline == 0, timeline_err
    assert (tmp_path / "plots" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = in_process(["plot", str(tmp_path)], capsys)
    assert code == 2 and "metrics.jsonl does not exist" in err
    code, err = in_process(["plot", "timeline", str(tmp_path)], capsys)
    assert code == 2 and "--trace" in err
