"""Naive collectives through one root: the baseline every other algorithm is measured against.

Communication pattern: a star. Every rank sends its whole tensor to the root, which combines them in
rank order and sends the whole result back to every rank. The root moves 2(p-1) n bytes one message at a
time, so time grows linearly with p, where ring and tree grow with (p-1)/p and log2 p.
"""

from __future__ import annotations

import torch

from shardwise.collectives.p2p import P2P, combine, combine_into, split_blocks, wait_all


def reduce(flat: torch.Tensor, p2p: P2P, op: str = "sum", root: int = 0) -> None:
    """Every rank sends ``flat`` to ``root``, which combines them (in rank order) into its ``flat``."""
    if p2p.rank != root:
        p2p.send(flat, root)
        return
    incoming = p2p.workspace(2, flat.numel(), flat)
    for src in range(p2p.world_size):
        if src != root:
            p2p.recv(incoming, src)
            combine(op, flat, incoming)


def broadcast(flat: torch.Tensor, p2p: P2P, root: int = 0) -> None:
    """``root`` sends ``flat`` to every other rank, one message each."""
    if p2p.rank != root:
        p2p.recv(flat, root)
        return
    wait_all([p2p.isend(flat, dst) for dst in range(p2p.world_size) if dst != root])


def all_reduce(flat: torch.Tensor, p2p: P2P, op: str = "sum") -> None:
    """Reduce to rank 0, then send the result to every rank."""
    reduce(flat, p2p, op, root=0)
    broadcast(flat, p2p, root=0)


def all_gather(output: torch.Tensor, shard: torch.Tensor, p2p: P2P) -> None:
    """Every rank sends its shard to rank 0, which assembles ``output`` and sends it to everyone."""
    blocks = split_blocks(output, p2p.world_size)
    if p2p.rank == 0:
        blocks[0].copy_(shard)
        wait_all([p2p.irecv(blocks[src], src) for src in range(1, p2p.world_size)])
    else:
        p2p.send(shard, 0)
    broadcast(output, p2p, root=0)


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, p2p: P2P, op: str = "sum") -> None:
    """Rank 0 reduces everyone's ``full`` (its own only read) and sends block q to rank q."""
    if p2p.rank != 0:
        p2p.send(full, 0)
        p2p.recv(shard, 0)
        return
    work, incoming = p2p.workspace(3, full.numel(), full), p2p.workspace(2, full.numel(), full)
    local = full
    for src in range(1, p2p.world_size):
        p2p.recv(incoming, src)
        combine_into(op, work, local, incoming)
        local = work
    blocks = split_blocks(work, p2p.world_size)
    wait_all([p2p.isend(blocks[dst], dst) for dst in range(1, p2p.world_size)])
    shard.copy_(blocks[0])
