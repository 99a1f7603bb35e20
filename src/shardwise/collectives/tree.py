"""Binomial-tree broadcast and reduce, tree all-reduce, and scatter + all-gather broadcast.

Communication pattern: ranks are renumbered relative to the root (v = (rank - root) mod p). In a
binomial tree, v receives from its parent v - lowbit(v) and sends to v + m for each power of two
m < lowbit(v) (the root: every m < p), so a broadcast takes ceil(log2 p) rounds, each moving the whole
message: latency-optimal. Reduce is the same tree run upwards, each node combining its children's
partial results in a fixed order. Tree all-reduce is reduce to rank 0 followed by broadcast from it.

For large messages the broadcast is instead a binomial *scatter* of p blocks followed by a ring
all-gather (van de Geijn; Thakur, Rabenseifner & Gropp, 2005): each rank then moves about 2n(p-1)/p
bytes instead of n log2 p.
"""

from __future__ import annotations

import torch

from shardwise.collectives import ring
from shardwise.collectives.p2p import P2P, block_bounds, combine

LARGE_BROADCAST_BYTES = 512 * 1024  # above this (and with p > 2), ``broadcast`` scatters + all-gathers


def _parent_mask(v: int, p: int) -> int:
    """The lowest set bit of v (v > 0), or the first power of two >= p for the root."""
    mask = 1
    while mask < p and not v & mask:
        mask <<= 1
    return mask


def broadcast_binomial(flat: torch.Tensor, p2p: P2P, root: int = 0) -> None:
    """Binomial-tree broadcast of ``flat`` from group rank ``root``."""
    p = p2p.world_size
    v = (p2p.rank - root) % p
    mask = _parent_mask(v, p)
    if v:
        p2p.recv(flat, (v - mask + root) % p)
    requests = []
    mask >>= 1
    while mask:
        if v + mask < p:
            requests.append(p2p.isend(flat, (v + mask + root) % p))
        mask >>= 1
    for request in requests:
        request.wait()


def reduce_binomial(flat: torch.Tensor, p2p: P2P, op: str = "sum", root: int = 0) -> None:
    """Binomial-tree reduce into ``flat`` on ``root``; other ranks' ``flat`` is used as scratch."""
    p = p2p.world_size
    v = (p2p.rank - root) % p
    incoming = p2p.workspace(2, flat.numel(), flat)
    mask = 1
    while mask < p:
        if v & mask:
            p2p.send(flat, (v - mask + root) % p)
            return
        if v + mask < p:
            p2p.recv(incoming, (v + mask + root) % p)
            combine(op, flat, incoming)
        mask <<= 1


def combines_into(rank: int, p: int, root: int) -> bool:
    """Whether ``reduce_binomial`` writes into this rank's tensor (it has a child to combine)."""
    v = (rank - root) % p
    return v % 2 == 0 and v + 1 < p


def all_reduce(flat: torch.Tensor, p2p: P2P, op: str = "sum") -> None:
    """Tree all-reduce in place: binomial reduce to rank 0, then binomial broadcast from rank 0."""
    reduce_binomial(flat, p2p, op, root=0)
    broadcast_binomial(flat, p2p, root=0)


def _scatter_binomial(flat: torch.Tensor, p2p: P2P, root: int) -> list[tuple[int, int]]:
    """Leave virtual block v (of p near-equal blocks) on each rank; return the blocks' bounds.

    A subtree rooted at v covers the virtual ranks [v, v + lowbit(v)), whose blocks are contiguous, so
    each message is one slice of ``flat``.
    """
    p = p2p.world_size
    v = (p2p.rank - root) % p
    bounds = block_bounds(flat.numel(), p)

    def span(first: int, count: int) -> slice:
        last = min(first + count, p) - 1
        return slice(bounds[first][0], bounds[last][1])

    mask = _parent_mask(v, p)
    if v:
        p2p.recv(flat[span(v, mask)], (v - mask + root) % p)
    requests = []
    mask >>= 1
    while mask:
        if v + mask < p:
            requests.append(p2p.isend(flat[span(v + mask, mask)], (v + mask + root) % p))
        mask >>= 1
    for request in requests:
        request.wait()
    return bounds


def broadcast_scatter_allgather(flat: torch.Tensor, p2p: P2P, root: int = 0) -> None:
    """Broadcast for large messages: binomial scatter of p blocks, then a ring all-gather."""
    p = p2p.world_size
    bounds = _scatter_binomial(flat, p2p, root)
    # The ring indexes blocks by real rank; real rank q holds virtual block (q - root) mod p.
    blocks = [flat[slice(*bounds[(q - root) % p])] for q in range(p)]
    ring.all_gather_blocks(blocks, p2p)


def broadcast(flat: torch.Tensor, p2p: P2P, root: int = 0, large_bytes: int = LARGE_BROADCAST_BYTES) -> None:
    """Binomial broadcast for small messages, scatter + all-gather above ``large_bytes`` (p > 2)."""
    if p2p.world_size > 2 and flat.numel() * flat.element_size() > large_bytes:
        broadcast_scatter_allgather(flat, p2p, root)
    else:
        broadcast_binomial(flat, p2p, root)
