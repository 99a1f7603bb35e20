"""Failover: rank 1 killed with SIGKILL mid-training; the elastic agent restarts the ranks, they resume
from the last complete checkpoint, and the final parameters equal those of an uninterrupted run.

The kill comes from outside, as an operator's would: the test reads rank 1's pid from
``<run_dir>/pids/rank1.0`` once ``metrics.jsonl`` shows training past the first checkpoint. Both
launchers: ``shardwise train --nproc 2`` (our elastic agent) and plain ``torchrun``, whose restarted
ranks would otherwise read the keys of the attempt before (shardwise prefixes each attempt's store).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = ["train", "--steps", "60", "--preset", "tiny", "--checkpoint-every", "5",
        "--max-restarts", "2", "--eval-every", "20", "--set", "model.dropout=0.1", "--json"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(run_dir: Path, launcher: str = "shardwise") -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "shardwise", *ARGS, "--nproc", "2", "--run-dir", str(run_dir)]
    if launcher == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--max-restarts", "2", "--rdzv-backend", "c10d", "--monitor-interval", "0.1",
                    "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--local-addr", "127.0.0.1"]  # fmt: skip
        command = [*torchrun, "-m", "shardwise", *ARGS, "--run-dir", str(run_dir)]
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _summary(proc: subprocess.Popen[str], timeout_s: float = 240) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    lines = [x for x in out.splitlines() if x.strip()]
    return json.loads(lines[-1]), err


def _last_step(metrics: Path) -> int:
    try:
        rows = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return json.loads(rows[-1])["step"] if rows else -1


def _wait_for(predicate: Any, proc: subprocess.Popen[str], timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"gave up waiting for {what}; stderr:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.01)
    return time.monotonic()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    summary, _ = _summary(_start(tmp_path_factory.mktemp("whole")))
    assert summary["restarts"] == 0
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["shardwise", "torchrun"])
def test_kill_9_of_rank_1_resumes_by_itself_and_matches_uninterrupted(tmp_path, reference, launcher) -> None:
    killed_dir = tmp_path / "killed"
    proc = _start(killed_dir, launcher)
    try:
        _wait_for(lambda: _last_step(killed_dir / "metrics.jsonl") >= 12, proc, 180, "step 12")
        pid = int((killed_dir / "pids" / "rank1.0").read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        restarted = _wait_for(lambda: (killed_dir / "pids" / "rank1.1").exists(), proc, 120, "a restart")
        killed, _ = _summary(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    seconds = restarted - killed_at
    print(f"failover ({launcher}): new rank 1 running {seconds:.2f} s after the kill (noisy machine)")
    assert killed["restarts"] >= 1
    assert (killed["checkpoint"]["resumed_at_step"] or 0) >= 10
    rows = [json.loads(x)["step"] for x in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(60))

    assert killed["final_param_digest"] == reference["final_param_digest"]
    assert killed["eval_losses"] == reference["eval_losses"]
    assert killed["initial_loss"] == reference["initial_loss"]
