"""``bench compress --link``: the shaped link between two namespaces, its teardown, and a tiny run.

The link is ``shardwise.bench.netns``: two namespaces over a veth pair, a token-bucket filter on both
ends. Needs root and iproute2 (skipped otherwise, with the reason); nothing reaches a real network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.bench.netns import measure_gbit_s, netns_unavailable, qdiscs, shape, two_hosts

SRC = Path(__file__).resolve().parents[2] / "src"
ROW_FIELDS = {"time_to_target_s", "time_ratio", "reached", "steps_to_target", "evals", "bytes_per_step"}


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.slow
def test_both_directions_are_shaped_and_the_namespaces_go_away() -> None:
    with two_hosts() as hosts:
        shape(hosts, "200mbit")
        assert all("tbf" in q and "rate 200Mbit" in q for q in qdiscs(hosts).values())
        there = measure_gbit_s(hosts, 8)  # b -> a
        back = measure_gbit_s({"a": hosts["b"], "b": hosts["a"]}, 8)  # a -> b
        assert 0.1 < there <= 0.21 and 0.1 < back <= 0.21, (there, back)
    assert not any(host.ns in _namespaces() for host in hosts.values())
    with pytest.raises(RuntimeError), two_hosts() as hosts:
        raise RuntimeError("a failure inside")
    assert not any(host.ns in _namespaces() for host in hosts.values())


@pytest.mark.slow
def test_a_tiny_run_over_the_link_reports_time_to_target(tmp_path) -> None:
    before = set(_namespaces().split())  # a killed run elsewhere may have left its own behind
    command = [sys.executable, "-m", "shardwise", "bench", "compress", "--link", "1gbit", "--rows", "int8",
               "--preset", "tiny", "--steps", "24", "--eval-every", "4", "--json",
               "--out", str(tmp_path / "link.json")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "link.json").read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result
    assert result["link"]["rate"] == "1gbit" and result["link"]["measured_gbit_s"]["shaped"] <= 1.05
    assert result["link"]["tc_rate"] == "1000000000bit" and result["link"]["bytes_per_s"] == 1.25e8
    assert all("rate 1Gbit" in q for q in result["link"]["qdisc"].values())  # tc read our bits as bits
    assert {"unshaped", "shaped"} <= set(result["probe"])
    assert result["job"]["global_batch"] == 4 and result["job"]["max_steps"] == 48
    assert {"load_start", "load_end", "target_heldout_loss", "best", "goal_met"} <= set(result)
    base, (row,) = result["uncompressed"], result["rows"]
    assert set(base) >= ROW_FIELDS and set(row) >= ROW_FIELDS
    assert base["reached"] and base["time_ratio"] == 1.0
    assert row["label"] == "int8" and row["steps_run"] <= 48
    assert row["reached"] == (row["time_to_target_s"] is not None)
    left = {name for name in set(_namespaces().split()) - before if name.startswith("sw")}
    assert not left, left  # the bench's namespaces (sw<host><tag>) are gone
