"""Two hosts on one machine: network namespaces joined by a veth pair, one torchrun agent in each.

Host A (192.0.2.1) hosts the rendezvous; host B (192.0.2.2) joins. After training passes a checkpoint,
every process of host B is killed (the host is lost); host B's agent is started again, as an operator
or a scheduler would, and the job resumes from the last complete checkpoint: its final parameters
equal those of an uninterrupted run. The addresses are TEST-NET-1 (RFC 5737) and exist only inside the
namespaces this test creates; nothing reaches any real network. Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
TRAIN = ["train", "--steps", "60", "--preset", "tiny", "--checkpoint-every", "5", "--eval-every", "20",
         "--set", "model.dropout=0.1", "--json"]  # fmt: skip
ADDR = {"a": "192.0.2.1", "b": "192.0.2.2"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (scripts/setup.sh notes how to add it)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"swprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as err:
        return f"`ip netns add` is not permitted here: {err.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def hosts() -> Iterator[dict[str, tuple[str, str]]]:
    """Namespace and interface name per host; everything in them is killed and removed afterwards."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    made = {h: (f"sw{h}{tag}", f"v{h}{tag}") for h in ("a", "b")}
    try:
        for ns, _ in made.values():
            _ip("netns", "add", ns)
        _ip("link", "add", made["a"][1], "type", "veth", "peer", "name", made["b"][1])
        for h, (ns, dev) in made.items():
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDR[h]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns, _ in made.values():
            _kill_namespace(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _kill_namespace(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)


def _agent(host: str, made: dict[str, tuple[str, str]], run_dir: Path, port: int, log: Path) -> Any:
    ns, dev = made[host]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": dev,
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR['a']}:{port}", "--rdzv-id", "two-hosts",
                "--rdzv-conf", f"is_host={'true' if host == 'a' else 'false'}", "--local-addr", ADDR[host],
                "--max-restarts", "3", "--monitor-interval", "0.1"]  # fmt: skip
    command = ["ip", "netns", "exec", ns, *torchrun, "-m", "shardwise", *TRAIN, "--run-dir", str(run_dir)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))


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
    _kill_namespace(hosts["b"][0])  # host B is lost: its agent and its rank
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
