"""Recursive halving-doubling all-reduce (Rabenseifner's algorithm), for any number of ranks.

Communication pattern, for p a power of two: reduce-scatter by recursive *halving* — in round k rank r
exchanges half of its current range with partner r xor (p / 2^(k+1)), keeps the other half and reduces
it — then all-gather by recursive *doubling*, the same exchanges in reverse order. That is 2 log2 p
messages per rank (latency) while still moving only 2n(p-1)/p bytes (bandwidth).

Any other p (Thakur, Rabenseifner & Gropp, 2005): with p' the largest power of two <= p and
rem = p - p', the first 2*rem ranks pair up before the main phase; each even one sends its whole vector
to the odd one after it and sits out. The p' remaining ranks run the algorithm above, and at the end the
odd ranks hand the result back to their even partners.
"""

from __future__ import annotations

import torch

from shardwise.collectives.p2p import P2P, Work, combine, wait_all


def _fold_in(flat: torch.Tensor, p2p: P2P, op: str, rem: int) -> int:
    """Fold the first 2*rem ranks in pairs; return this rank's rank among the p' that go on, or -1."""
    r = p2p.rank
    if r >= 2 * rem:
        return r - rem
    if r % 2 == 0:
        p2p.send(flat, r + 1)
        return -1
    incoming = p2p.workspace(2, flat.numel(), flat)
    p2p.recv(incoming, r - 1)
    combine(op, flat, incoming)
    return r // 2


def _real_rank(new_rank: int, rem: int) -> int:
    return 2 * new_rank + 1 if new_rank < rem else new_rank + rem


def all_reduce(flat: torch.Tensor, p2p: P2P, op: str = "sum") -> None:
    """Recursive halving-doubling all-reduce of the 1-D contiguous ``flat``, in place."""
    p = p2p.world_size
    if p == 1:
        return
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    new_rank = _fold_in(flat, p2p, op, rem)
    if new_rank >= 0:
        exchanges, posted = _halve(flat, p2p, op, new_rank, pof2, rem)
        for give, keep, partner in reversed(exchanges):  # recursive doubling: gather back
            incoming = posted if posted is not None else p2p.irecv(flat[give], partner)
            sent = p2p.isend(flat[keep], partner)
            wait_all([incoming, sent])
            posted = None
    if p2p.rank < 2 * rem:  # unfold: odd ranks return the result to the even rank they absorbed
        if p2p.rank % 2:
            p2p.send(flat, p2p.rank - 1)
        else:
            p2p.recv(flat, p2p.rank + 1)


def _halve(
    flat: torch.Tensor, p2p: P2P, op: str, new_rank: int, pof2: int, rem: int
) -> tuple[list[tuple[slice, slice, int]], Work | None]:
    """Reduce-scatter by recursive halving; return the (given, kept, partner) of each round, and the
    receive of the first doubling round, posted before the last reduction so the partner's reply
    lands in place as soon as it is sent (the region was given away, and that send is complete).

    Partners always share the same range (they agree on every higher bit), so both compute the same
    midpoint; the lower rank keeps the lower half.
    """
    lo, hi = 0, flat.numel()
    incoming = p2p.workspace(2, flat.numel(), flat)
    exchanges = []
    posted: Work | None = None
    distance = pof2 // 2
    while distance:
        partner = _real_rank(new_rank ^ distance, rem)
        mid = lo + (hi - lo) // 2
        if new_rank & distance:
            give, keep = slice(lo, mid), slice(mid, hi)
        else:
            give, keep = slice(mid, hi), slice(lo, mid)
        buffer = incoming[: keep.stop - keep.start]
        p2p.exchange(flat[give], buffer, partner)
        if distance == 1:
            posted = p2p.irecv(flat[give], partner)
        combine(op, flat[keep], buffer)
        exchanges.append((give, keep, partner))
        lo, hi = keep.start, keep.stop
        distance //= 2
    return exchanges, posted
