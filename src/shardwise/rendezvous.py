"""Where a job's stores listen: loopback alone for a local run, the address the user gave otherwise.

torch's ``TCPStore`` server binds every interface whatever host it is given, and it has no
authentication: anyone who reaches the port can write into the rendezvous. The elastic agent's c10d
rendezvous makes two of them (its own store and the one it shares with the ranks). So a local run
(``launch_local``) uses this module's rendezvous instead: one store, shared by the agent and its ranks,
served from a socket bound here to ``127.0.0.1`` and handed to torch (libuv's ``master_listen_fd``),
so it listens there alone. It is torch's static rendezvous (one node, a fixed world, the same store for
every restart) on that store. A rank that hosts the job's store itself (multi-node jobs under
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) binds it to ``MASTER_ADDR``'s address the same way.

Communication: the store's own (key-value requests over TCP on the bound address).
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

LOOPBACK = "127.0.0.1"
LOOPBACK_BACKEND = "shardwise-loopback"  # the rendezvous backend name ``launch_local`` asks the agent for
DEFAULT_TIMEOUT_S = 60


def bound_store(host: str, port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host``'s address alone (port 0: a free one, read back from
    ``.port``); torch's own would listen on every interface."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        bound = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore(
        host,
        bound,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),  # the store owns (and closes) it from here on
        use_libuv=True,
    )


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (``localhost``, 127.0.0.0/8, ``::1``)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(str(info[4][0])).is_loopback for info in found)


class LoopbackRendezvous(StaticTCPRendezvous):
    """The elastic agent's rendezvous for one host: torch's static one over a store on loopback."""

    def __init__(self, run_id: str, timeout_s: int) -> None:
        store = bound_store(LOOPBACK, 0, timeout_s)
        super().__init__(LOOPBACK, store.port, rank=0, world_size=1, run_id=run_id, timeout=timeout_s)
        self._store = store  # the static rendezvous would make (and bind) its own when it has none

    def get_backend(self) -> str:
        return LOOPBACK_BACKEND

    def shutdown(self) -> bool:
        self._store = None  # the listener closes with the store
        return True


def _create_loopback(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {LOOPBACK_BACKEND} rendezvous runs one node, not {params.max_nodes}")
    return LoopbackRendezvous(params.run_id, int(params.config.get("timeout", DEFAULT_TIMEOUT_S)))


def register_loopback() -> str:
    """Make ``LoopbackRendezvous`` known to the agent (idempotent); returns its backend name."""
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_loopback)
    return LOOPBACK_BACKEND
