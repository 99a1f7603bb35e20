"""Explicit collectives issued with async_op=True run on the communication thread and overlap the caller."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.collectives import Comm
from shardwise.testing import run_on_ranks


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _overlap_rank(rank: int, world_size: int) -> list[float]:
    """Rank 0 issues an asynchronous ring all-reduce and only then lets rank 1 issue its own. Had the
    call blocked until the collective was done, rank 0 would never get to say so: the run hangs and
    ``run_on_ranks`` fails it."""
    comm = Comm(algorithm="ring")
    x = torch.full((1000,), float(rank + 1))
    if rank == 0:
        work = comm.all_reduce(x, async_op=True)
        _store().set("issued", "1")
    else:
        _store().wait(["issued"])
        work = comm.all_reduce(x, async_op=True)
    work.wait()
    return x[:3].tolist()


def test_async_explicit_collective_returns_before_it_completes() -> None:
    for result in run_on_ranks(_overlap_rank, 2, timeout_s=60):
        assert result == [3.0, 3.0, 3.0]


def _ordered_rank(rank: int, world_size: int) -> dict[str, list[float]]:
    """Queued collectives of several algorithms, a caller's own send/recv on the same group meanwhile,
    then a synchronous call: all complete, in order, with what native gives."""
    comm = Comm()
    base = torch.arange(12, dtype=torch.float64) * (rank + 1)
    tensors = {name: base.clone() for name in ("ring", "tree", "halving_doubling", "naive")}
    works = [comm.all_reduce(t, async_op=True, algorithm=name) for name, t in tensors.items()]
    ping = torch.tensor([float(rank)])
    peer = (rank + 1) % world_size
    sent = comm.isend(ping, peer)
    got = torch.zeros(1)
    comm.recv(got, (rank - 1) % world_size)
    sent.wait()
    gathered = torch.zeros(12 * world_size, dtype=torch.float64)
    comm.all_gather(gathered, base, algorithm="ring")  # synchronous: runs after the queued ones
    for work in works:
        work.wait()
    expected = base.clone()
    dist.all_reduce(expected)
    out = {name: (t - expected).abs().max().item() for name, t in tensors.items()}
    out["ping"] = got.item() - (rank - 1) % world_size
    out["gather"] = (gathered.view(world_size, 12)[peer] - torch.arange(12) * (peer + 1)).abs().max().item()
    return out


def test_queued_collectives_keep_their_order_beside_point_to_point() -> None:
    for result in run_on_ranks(_ordered_rank, 3, timeout_s=60):
        assert all(value == 0.0 for value in result.values()), result
