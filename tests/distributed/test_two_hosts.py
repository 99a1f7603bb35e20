"""Two hosts on one machine: network namespaces joined by a veth pair, one torchrun agent in each.

Host A (192.0.2.1) hosts the rendezvous; host B (192.0.2.2) joins. After training passes a checkpoint,
every process of host B is killed (the host is lost); host B's agent is started again, as an operator
or a scheduler would, and the job resumes from the last complete checkpoint: its final parameters
equal those of an uninterrupted run. The addresses are TEST-NET-1 (RFC 5737) and exist only inside the
namespaces this test creates; nothing reaches any real network. Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardwise.bench.netns import (
    Host,
    kill_namespace,
    netns_unavailable,
    rank_env,
    torchrun_command,
    two_hosts,
)

SRC = Path(__file__).resolve().parents[2] / "src"
TRAIN = ["train", "--steps", "60", "--preset", "tiny", "--checkpoint-every", "5", "--eval-every", "20",
         "--set", "model.dropout=0.1", "--json"]  # fmt: skip


@pytest.fixture
def hosts() -> Iterator[dict[str, Host]]:
    """Two hosts (``shardwise.bench.netns``); everything in them is killed and removed afterwards."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with two_hosts() as made:
        yield made


# A lost host's agent is let go 4 s after its last heartbeat. torch's default, 3 missed heartbeats 5 s
# apart, kept host A's agent waiting idle about 12 s before a round could take the new host B in.
KEEP_ALIVE = {"keep_alive_interval": "1", "keep_alive_max_attempt": "4"}


def _agent(host: str, made: dict[str, Host], run_dir: Path, port: int, log: Path) -> Any:
    torchrun = torchrun_command(host, made, port, "two-hosts", max_restarts=3, rdzv_conf=KEEP_ALIVE)
    command = [*torchrun, "-m", "shardwise", *TRAIN, "--run-dir", str(run_dir)]
    return subprocess.Popen(
        command, env=rank_env(made[host]), stdout=subprocess.DEVNULL, stderr=log.open("w")
    )


def _last_step(metrics: Path) -> int:
    try:
        rows = metrics.read_text().splitlines()
        return json.loads(rows[-1])["step"] if rows else -1
    except (FileNotFoundError, ValueError):
        return -1


@pytest.mark.slow
def test_losing_a_host_resumes_from_the_last_checkpoint(tmp_path, hosts) -> None:
    run_dir = tmp_path / "run"
    agent_a = _agent("a", hosts, run_dir, 29400, tmp_path / "a.log")
    agent_b = _agent("b", hosts, run_dir, 29400, tmp_path / "b.log")
    deadline = time.monotonic() + 180
    while _last_step(run_dir / "metrics.jsonl") < 12:
        alive = time.monotonic() < deadline and agent_a.poll() is None
        assert alive, (tmp_path / "a.log").read_text()[-3000:]
        time.sleep(0.05)
    kill_namespace(hosts["b"].ns)  # host B is lost: its agent and its rank
    agent_b.wait(timeout=30)
    agent_b = _agent("b", hosts, run_dir, 29400, tmp_path / "b2.log")  # the host comes back
    try:
        assert agent_a.wait(timeout=240) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert agent_b.wait(timeout=60) == 0, (tmp_path / "b2.log").read_text()[-3000:]
    finally:
        for agent in (agent_a, agent_b):
            if agent.poll() is None:
                agent.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] >= 1
    assert (summary["checkpoint"]["resumed_at_step"] or 0) >= 10

    env = {**os.environ, "PYTHONPATH": str(SRC)}
    whole = subprocess.run(
        [sys.executable, "-m", "shardwise", *TRAIN, "--nproc", "2", "--run-dir", str(tmp_path / "whole")],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = json.loads(whole.stdout.strip().splitlines()[-1])
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["eval_losses"] == reference["eval_losses"]
