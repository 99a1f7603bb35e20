"""Two "hosts" on one machine: network namespaces joined by a veth pair, optionally rate-limited.

``two_hosts()`` creates namespaces ``a`` and ``b`` holding the two ends of one veth pair, with the
documentation addresses 192.0.2.1 and 192.0.2.2 (TEST-NET-1, RFC 5737: they exist only inside the
namespaces; nothing reaches a real network), and removes both on the way out, killing whatever still
runs in them (also on Ctrl-C or SIGTERM, which the command line turns into exceptions).
``shape(hosts, "1gbit")`` puts a token-bucket filter (``tc qdisc ... tbf``) at the root of BOTH veth
ends, so each direction carries at most that rate; ``unshape`` takes it off again.

Communication pattern: none of its own. Processes started in the namespaces (``torchrun_command``:
one torchrun agent per host, c10d rendezvous hosted by host ``a``) talk over the veth pair, so every
byte a collective sends crosses the shaped link. ``measure_gbit_s`` streams bytes from ``b`` to ``a``
over one TCP connection to check the rate the link really gives. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ADDR = {"a": "192.0.2.1", "b": "192.0.2.2"}
# tbf: 128 kB of burst (~1 ms at 1 Gbit/s; at least one 64 kB GSO packet) and a queue that holds
# 50 ms of traffic, so the sender is paced, not dropped
TBF_BURST, TBF_LATENCY = "128kb", "50ms"
SRC = str(Path(__file__).resolve().parents[2])  # the folder holding this ``shardwise`` package


@dataclass(frozen=True)
class Host:
    """One end of the link: its namespace, its veth interface and its address."""

    ns: str
    dev: str
    addr: str


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (no iproute2, not root, not permitted), or None."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed (scripts/setup.sh notes how to add it)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"swprobe{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
    except subprocess.CalledProcessError as err:
        return f"`ip netns add` is not permitted here: {err.stderr.strip()}"
    ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def two_hosts(rate: str | None = None) -> Iterator[dict[str, Host]]:
    """Hosts ``a`` and ``b`` joined by a veth pair (shaped to ``rate`` both ways when given)."""
    tag = secrets.token_hex(3)
    hosts = {h: Host(f"sw{h}{tag}", f"v{h}{tag}", ADDR[h]) for h in ADDR}
    try:
        for host in hosts.values():
            ip("netns", "add", host.ns)
        ip("link", "add", hosts["a"].dev, "type", "veth", "peer", "name", hosts["b"].dev)
        for host in hosts.values():
            ip("link", "set", host.dev, "netns", host.ns)
            ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            ip("-n", host.ns, "link", "set", host.dev, "up")
            ip("-n", host.ns, "link", "set", "lo", "up")
        if rate:
            shape(hosts, rate)
        yield hosts
    finally:
        for host in hosts.values():
            kill_namespace(host.ns)
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)


def _tc(host: Host, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", host.ns, "tc", *args], check=True, capture_output=True, text=True)


def shape(hosts: dict[str, Host], rate: str) -> None:
    """Each veth end sends at most ``rate`` (tc syntax: ``1gbit``, ``100mbit``): both directions."""
    for host in hosts.values():
        _tc(host, "qdisc", "replace", "dev", host.dev, "root", "tbf", "rate", rate,
            "burst", TBF_BURST, "latency", TBF_LATENCY)  # fmt: skip


def unshape(hosts: dict[str, Host]) -> None:
    for host in hosts.values():
        _tc(host, "qdisc", "del", "dev", host.dev, "root")


def qdiscs(hosts: dict[str, Host]) -> dict[str, str]:
    """``tc qdisc show`` of each veth end, as tc prints it."""
    return {
        name: subprocess.run(
            ["ip", "netns", "exec", host.ns, "tc", "qdisc", "show", "dev", host.dev],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name, host in hosts.items()
    }


def kill_namespace(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns``."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)


def rank_env(host: Host) -> dict[str, str]:
    """The environment of a torchrun agent on ``host``: gloo on the veth, this package importable."""
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": host.dev,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip


def torchrun_command(
    host: str,
    hosts: dict[str, Host],
    port: int,
    run_id: str,
    max_restarts: int = 0,
    rdzv_conf: dict[str, str] | None = None,
) -> list[str]:
    """``ip netns exec`` + torchrun for one of two single-rank hosts; append ``-m module args``.

    ``rdzv_conf``: more settings of the c10d rendezvous (``--rdzv-conf``), e.g. ``keep_alive_interval``
    (seconds between an agent's heartbeats; torch's default 5) and ``keep_alive_max_attempt`` (heartbeats
    missed before a node is dead; default 3): a lost host's agent is let go that long after its last."""
    me = hosts[host]
    conf = {"is_host": "true" if host == "a" else "false", **(rdzv_conf or {})}
    return ["ip", "netns", "exec", me.ns, sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts['a'].addr}:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()), "--local-addr", me.addr,
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]  # fmt: skip


_RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = server.accept()
got, start = 0, time.perf_counter()
while chunk := conn.recv(1 << 20):
    got += len(chunk)
print(got * 8 / (time.perf_counter() - start) / 1e9, flush=True)
"""
_SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    block = bytes(1 << 20)
    for _ in range(int(sys.argv[3])):
        conn.sendall(block)
"""


def measure_gbit_s(hosts: dict[str, Host], megabytes: int = 64, port: int = 29399) -> float:
    """Gbit/s of one TCP stream from host ``b`` to host ``a`` (timed by the receiver)."""
    a, b = hosts["a"], hosts["b"]
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", a.ns, sys.executable, "-c", _RECEIVE, a.addr, str(port)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert receiver.stdout is not None
        receiver.stdout.readline()  # "ready"
        subprocess.run(
            ["ip", "netns", "exec", b.ns, sys.executable, "-c", _SEND, a.addr, str(port), str(megabytes)],
            check=True, timeout=120,
        )  # fmt: skip
        return float(receiver.communicate(timeout=60)[0])
    finally:
        if receiver.poll() is None:
            receiver.kill()
