"""Stores listen where they are told: ``bound_store`` on the address given alone, a rank that hosts
the job's store on ``MASTER_ADDR``'s address, the local rendezvous on 127.0.0.1."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from shardwise.launcher import _job_store
from shardwise.rendezvous import (
    LOOPBACK_BACKEND,
    LoopbackRendezvous,
    bound_store,
    is_loopback,
    register_loopback,
)


def _listening_on(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_a_bound_store_listens_on_its_address_alone_and_serves() -> None:
    store = bound_store("127.0.0.1")
    assert _listening_on(store.port) == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_plain_torch_store_listens_everywhere() -> None:
    """Why ``bound_store`` exists: torch's server ignores the host it is given."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _listening_on(store.port) & {"::", "0.0.0.0"}


def test_a_rank_hosting_the_job_store_binds_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a free port, for the rank's store to take
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = _job_store(True, 2, timedelta(seconds=10))
    assert _listening_on(port) == {"127.0.0.1"}
    store.set("a", "1")


def test_loopback_names() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("192.0.2.1") and not is_loopback("no-such-host.invalid")


def test_the_local_rendezvous_shares_one_loopback_store() -> None:
    assert register_loopback() == register_loopback() == LOOPBACK_BACKEND  # idempotent
    handler = LoopbackRendezvous("run", 10)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert _listening_on(info.bootstrap_store_info.master_port) == {"127.0.0.1"}
    assert handler.next_rendezvous().bootstrap_store_info == info.bootstrap_store_info  # restarts reuse it
