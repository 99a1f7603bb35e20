"""Run ``python -m shardwise`` as a user would: to completion, or in the background to watch and kill.

``shardwise`` waits for the command and ``last_json`` reads its summary; ``start`` launches it in the
background (``finished`` then waits for the summary), and ``last_step`` / ``metrics_steps`` /
``wait_for`` follow a run through its ``metrics.jsonl`` so a test can strike at a chosen step. The
run's ``pids/rank<r>.<attempt>`` files name each rank's process. ``refusal`` runs a command line that
must be refused before any rank starts through ``cli.main`` in the test process (no process launch), and
``in_process`` runs a command that starts no rank (``plot``) the same way.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def shardwise(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shardwise", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=_env())


def last_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, f"no stdout; stderr:\n{result.stderr[-3000:]}"
    return json.loads(lines[-1])


def refusal(argv: Sequence[str], run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line ``python -m shardwise <argv> --run-dir <run_dir>`` refuses with, run as
    ``cli.main`` in this process: exit 2, exactly one line, and no rank started (no ``<run_dir>/pids``
    folder: every rank writes its pid there first)."""
    code = main([*argv, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert not (run_dir / "pids").exists(), f"a rank started: {err[-3000:]}"
    return lines[0]


def in_process(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and stderr of ``python -m shardwise <argv>`` for a command that starts no rank
    (``plot``, say), run as ``cli.main`` in this process: the code ``__main__`` runs, without the
    seconds a fresh interpreter takes to start and import torch."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    args: Sequence[str], prefix: Sequence[str] = ("-m", "shardwise"), env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``python <prefix> <args>`` in the background (``prefix``: another launcher, e.g. torchrun)."""
    return subprocess.Popen(
        [sys.executable, *prefix, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(), **(env or {})},
    )


def finished(proc: subprocess.Popen[str], timeout_s: float = 240) -> tuple[dict[str, Any], str]:
    """The summary (last stdout line) and stderr of a run that must exit 0."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    lines = [x for x in out.splitlines() if x.strip()]
    return json.loads(lines[-1]), err


def last_step(metrics: Path) -> int:
    """The newest step in ``metrics.jsonl`` (-1 before the first)."""
    try:
        rows = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return json.loads(rows[-1])["step"] if rows else -1


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for(
    predicate: Callable[[], Any],
    proc: subprocess.Popen[str],
    timeout_s: float,
    what: str,
    every_s: float = 0.01,
) -> float:
    """Poll ``predicate`` every ``every_s`` until true (then the time); kill the run if it ends first or
    if ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"gave up waiting for {what}; stderr:\n{proc.communicate()[1][-3000:]}")
        time.sleep(every_s)
    return time.monotonic()
