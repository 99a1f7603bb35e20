"""A local run listens on loopback alone: ``shardwise train --nproc 2`` and a script's ``sw.launch``.

Each run is watched from outside while it trains: every TCP socket in LISTEN state held by the
launcher or any process under it (the agent's rendezvous store, the ranks' gloo pairs) must be bound to
127.0.0.1 or ::1. torch's own c10d rendezvous bound two stores to every interface (issue 27).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from .cli_helpers import _env

LOOPBACK = {"127.0.0.1", "::1"}

SCRIPT = """
import sys

import shardwise as sw


def main(run_dir):
    overrides = {"steps": "15", "model.preset": "tiny", "eval_every": "0", "run_dir": run_dir}
    sw.Trainer.build(sw.load_config(overrides=overrides)).fit(show_progress=False)


if __name__ == "__main__":
    sw.launch(main, 2, sys.argv[1])
"""


def _listeners_while_running(command: list[str], timeout_s: float = 120) -> dict[str, set[str]]:
    """Run ``command``; every address a process of its tree listened on (by "launcher" or "rank"),
    sampled until it exits, which it must do with 0."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    seen: dict[str, set[str]] = {"launcher": set(), "rank": set()}
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                root = psutil.Process(proc.pid)
                tree = [("launcher", root)] + [("rank", child) for child in root.children(recursive=True)]
            except psutil.Error:
                break
            for role, process in tree:
                try:
                    for conn in process.net_connections(kind="tcp"):
                        if conn.status == psutil.CONN_LISTEN:
                            seen[role].add(f"{conn.laddr.ip}:{conn.laddr.port}")
                except psutil.Error:  # it ended between the listing and the look
                    continue
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    return seen


def _assert_loopback_only(seen: dict[str, set[str]]) -> None:
    # something was seen on both sides, so the run was watched while it ran (else this proves nothing)
    assert seen["launcher"] and seen["rank"], seen
    exposed = [a for addresses in seen.values() for a in addresses if a.rsplit(":", 1)[0] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {seen})"


def test_shardwise_train_listens_on_loopback_only(tmp_path: Path) -> None:
    args = ["train", "--nproc", "2", "--preset", "tiny", "--steps", "15", "--eval-every", "0"]
    command = [sys.executable, "-m", "shardwise", *args, "--run-dir", str(tmp_path)]
    _assert_loopback_only(_listeners_while_running(command))


def test_sw_launch_listens_on_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    _assert_loopback_only(_listeners_while_running([sys.executable, str(script), str(tmp_path / "run")]))
