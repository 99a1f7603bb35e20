"""Failover: rank 1 killed with SIGKILL mid-training; the elastic agent restarts the ranks, they resume
from the last complete checkpoint, and the final parameters equal those of an uninterrupted run.

The kill comes from outside, as an operator's would: the test reads rank 1's pid from
``<run_dir>/pids/rank1.0`` once ``metrics.jsonl`` shows training past the first checkpoint. Both
launchers: ``shardwise train --nproc 2`` (our elastic agent) and plain ``torchrun``, whose restarted
ranks would otherwise read the keys of the attempt before (shardwise prefixes each attempt's store).
Three layouts of the 2 ranks: DDP over dp 2, tensor parallelism (tp 2: each rank writes its shards as
boxes, and the dropout masks of the split regions come from the tp RNG tracker, whose state resumes too)
and a pipeline (pp 2: each stage writes its own blocks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .cli_helpers import finished, free_port, last_step, metrics_steps, start, wait_for

ARGS = ["train", "--steps", "60", "--preset", "tiny", "--checkpoint-every", "5",
        "--max-restarts", "2", "--eval-every", "20", "--set", "model.dropout=0.1", "--json"]  # fmt: skip
LAYOUTS = {  # how the 2 ranks are used
    "dp2": [],
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2", "--micro-batches", "2"],
}


def _start(run_dir: Path, launcher: str = "shardwise", layout: str = "dp2") -> subprocess.Popen[str]:
    args = [*ARGS, *LAYOUTS[layout], "--run-dir", str(run_dir)]
    if launcher == "torchrun":
        torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--max-restarts", "2", "--rdzv-backend", "c10d", "--monitor-interval", "0.1",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
                    "-m", "shardwise"]  # fmt: skip
        return start(args, prefix=torchrun, env={"GLOO_SOCKET_IFNAME": "lo"})
    return start([*args, "--nproc", "2"])


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Callable[[str], dict[str, Any]]:
    """The uninterrupted run of a layout, run once per module."""
    done: dict[str, dict[str, Any]] = {}

    def reference(layout: str) -> dict[str, Any]:
        if layout not in done:
            summary, _ = finished(_start(tmp_path_factory.mktemp(f"whole-{layout}"), layout=layout))
            assert summary["restarts"] == 0
            done[layout] = summary
        return done[layout]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "layout"),
    [("shardwise", "dp2"), ("torchrun", "dp2"), ("shardwise", "tp2"), ("shardwise", "pp2")],
    ids=["shardwise", "torchrun", "shardwise-tp2", "shardwise-pp2"],
)
def test_kill_9_of_rank_1_resumes_by_itself_and_matches_uninterrupted(
    tmp_path, references, launcher, layout
) -> None:
    reference = references(layout)
    killed_dir = tmp_path / "killed"
    proc = _start(killed_dir, launcher, layout)
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
    print(f"failover ({launcher}, {layout}): rank 1 back {seconds:.2f} s after the kill (noisy machine)")
    assert killed["restarts"] >= 1
    assert (killed["checkpoint"]["resumed_at_step"] or 0) >= 10
    assert metrics_steps(killed_dir) == list(range(60))

    assert killed["final_param_digest"] == reference["final_param_digest"]
    assert killed["eval_losses"] == reference["eval_losses"]
    assert killed["initial_loss"] == reference["initial_loss"]
