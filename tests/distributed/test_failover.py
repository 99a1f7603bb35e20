"""Failover: rank 1 killed with SIGKILL mid-training; the elastic agent restarts the ranks, they resume
from the last complete checkpoint, and the final parameters equal those of an uninterrupted run.

The kill comes from outside, as an operator's would: the test reads rank 1's pid from
``<run_dir>/pids/rank1.0`` once ``metrics.jsonl`` shows training past the first checkpoint. Both
launchers: ``shardwise train --nproc 2`` (our elastic agent) and plain ``torchrun``, whose restarted
ranks would otherwise read the keys of the attempt before (shardwise prefixes each attempt's store).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from .cli_helpers import finished, free_port, last_step, metrics_steps, start, wait_for

ARGS = ["train", "--steps", "60", "--preset", "tiny", "--checkpoint-every", "5",
        "--max-restarts", "2", "--eval-every", "20", "--set", "model.dropout=0.1", "--json"]  # fmt: skip


def _start(run_dir: Path, launcher: str = "shardwise") -> subprocess.Popen[str]:
    if launcher == "torchrun":
        torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--max-restarts", "2", "--rdzv-backend", "c10d", "--monitor-interval", "0.1",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
                    "-m", "shardwise"]  # fmt: skip
        return start([*ARGS, "--run-dir", str(run_dir)], prefix=torchrun, env={"GLOO_SOCKET_IFNAME": "lo"})
    return start([*ARGS, "--nproc", "2", "--run-dir", str(run_dir)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    summary, _ = finished(_start(tmp_path_factory.mktemp("whole")))
    assert summary["restarts"] == 0
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["shardwise", "torchrun"])
def test_kill_9_of_rank_1_resumes_by_itself_and_matches_uninterrupted(tmp_path, reference, launcher) -> None:
    killed_dir = tmp_path / "killed"
    proc = _start(killed_dir, launcher)
    try:
        wait_for(lambda: last_step(killed_dir / "metrics.jsonl") >= 12, proc, 180, "step 12")
        pid = int((killed_dir / "pids" / "rank1.0").read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        restarted = wait_for(lambda: (killed_dir / "pids" / "rank1.1").exists(), proc, 120, "a restart")
        killed, _ = finished(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    seconds = restarted - killed_at
    print(f"failover ({launcher}): new rank 1 running {seconds:.2f} s after the kill (noisy machine)")
    assert killed["restarts"] >= 1
    assert (killed["checkpoint"]["resumed_at_step"] or 0) >= 10
    assert metrics_steps(killed_dir) == list(range(60))

    assert killed["final_param_digest"] == reference["final_param_digest"]
    assert killed["eval_losses"] == reference["eval_losses"]
    assert killed["initial_loss"] == reference["initial_loss"]
