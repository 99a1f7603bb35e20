"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.

Communication pattern: rank r only ever sends to r+1 and receives from r-1 (mod p). The tensor is cut
into p near-equal blocks. Reduce-scatter takes p-1 steps; at step s rank r sends block (r-s-1) and
receives block (r-s-2), which it adds to its own copy, so after p-1 steps it holds block r fully reduced.
All-gather then circulates the finished blocks for p-1 more steps. Each rank sends 2(p-1)/p of the
tensor in total, which is bandwidth-optimal (Patarasuptong & Yuan, 2009).

Pipelining: every block is further cut into segments of ``segment_bytes``. A segment that has just been
received (and reduced) is forwarded at once, so the next step's sends start while this step is still
arriving, and the reduction of one segment overlaps the transfer of the next. Receives for the next
step are posted one step ahead, into a double-buffered scratch area. Each (step, segment) message has
its own tag. An all-gather step receives a block in place although this rank may still be sending
from that block's region; that is safe by causality: the fully reduced segment arriving there was
reduced by the ranks downstream after they had received what this rank sends from the very same
region, and a send from a region is complete once its receiver has all of it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from shardwise.collectives.p2p import P2P, Work, combine_into, split_blocks, wait_all

# measured on 2 ranks: 512 KB segments cost more in messages than they win, 4 MB overlap less at 16 MB
DEFAULT_SEGMENT_BYTES = 2 << 20

Step = tuple[int, bool]  # (block received at this step, whether it is reduced into the local copy)


def _segments(numel: int, segment_elems: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + segment_elems, numel)) for lo in range(0, numel, segment_elems)] or [(0, 0)]


class _RingRun:
    """One pass of a ring schedule over ``blocks``, with segment pipelining.

    A reducing step writes ``sources[block] (op) incoming`` into ``blocks[block]``; the first send
    reads ``sources`` too. By default the sources are the blocks themselves (in place); reduce-scatter
    passes its read-only input instead, so it never has to copy it.
    """

    def __init__(
        self,
        blocks: list[torch.Tensor],
        steps: list[Step],
        p2p: P2P,
        op: str,
        segment_bytes: int,
        sources: list[torch.Tensor] | None = None,
    ) -> None:
        self.blocks, self.steps, self.p2p, self.op = blocks, steps, p2p, op
        self.sources = sources if sources is not None else blocks
        self.right = (p2p.rank + 1) % p2p.world_size
        self.left = (p2p.rank - 1) % p2p.world_size
        largest = max(b.numel() for b in blocks)
        self.segment_elems = max(1, segment_bytes // blocks[0].element_size())
        self.tags_per_step = max(1, -(-largest // self.segment_elems))
        needs_scratch = any(reduce for _, reduce in steps)
        self.scratch = [p2p.workspace(slot, largest if needs_scratch else 0, blocks[0]) for slot in (0, 1)]
        self.in_flight: dict[int, list[Work]] = defaultdict(list)  # block -> sends not yet complete

    def _tag(self, step: int, segment: int) -> int:
        return step * self.tags_per_step + segment

    def _send(self, block: int, step: int) -> None:
        """Send every segment of ``block``'s source to the right, as the messages of ``step``."""
        data = self.sources[block]
        for j, (lo, hi) in enumerate(_segments(data.numel(), self.segment_elems)):
            self.in_flight[block].append(self.p2p.isend(data[lo:hi], self.right, self._tag(step, j)))

    def _post(self, step: int) -> list[Work]:
        block, reduce = self.steps[step]
        # an all-gather step receives in place: see the module docstring on why that is safe
        target = self.scratch[step % 2][: self.blocks[block].numel()] if reduce else self.blocks[block]
        return [
            self.p2p.irecv(target[lo:hi], self.left, self._tag(step, j))
            for j, (lo, hi) in enumerate(_segments(target.numel(), self.segment_elems))
        ]

    def _finish(self, step: int, requests: list[Work]) -> None:
        """Wait for the segments of ``step``, reduce them, and forward each one as the next step's."""
        block, reduce = self.steps[step]
        data, local = self.blocks[block], self.sources[block]
        forward = step + 1 < len(self.steps)
        if reduce:
            wait_all(self.in_flight.pop(block, []))
        for j, ((lo, hi), request) in enumerate(
            zip(_segments(data.numel(), self.segment_elems), requests, strict=True)
        ):
            request.wait()
            if reduce and hi > lo:
                combine_into(self.op, data[lo:hi], local[lo:hi], self.scratch[step % 2][lo:hi])
            if forward:
                self.in_flight[block].append(self.p2p.isend(data[lo:hi], self.right, self._tag(step + 1, j)))

    def run(self, first_send: int) -> None:
        if not self.steps:
            return
        self._send(first_send, 0)
        pending = self._post(0)
        for step in range(len(self.steps)):
            following = self._post(step + 1) if step + 1 < len(self.steps) else []
            self._finish(step, pending)
            pending = following
        for requests in self.in_flight.values():
            wait_all(requests)


def _reduce_scatter_steps(rank: int, p: int) -> list[Step]:
    return [((rank - s - 2) % p, True) for s in range(p - 1)]


def _all_gather_steps(rank: int, p: int) -> list[Step]:
    return [((rank - t - 1) % p, False) for t in range(p - 1)]


def all_reduce(
    flat: torch.Tensor, p2p: P2P, op: str = "sum", segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> None:
    """Ring all-reduce of the 1-D contiguous ``flat`` in place: reduce-scatter then all-gather."""
    p, r = p2p.world_size, p2p.rank
    if p == 1:
        return
    steps = _reduce_scatter_steps(r, p) + _all_gather_steps(r, p)
    _RingRun(split_blocks(flat, p), steps, p2p, op, segment_bytes).run(first_send=(r - 1) % p)


def reduce_scatter(
    shard: torch.Tensor,
    full: torch.Tensor,
    p2p: P2P,
    op: str = "sum",
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> None:
    """Reduce the 1-D ``full`` (p equal blocks) over the ring; leave block ``rank`` in ``shard``.

    ``full`` is only read: partial sums go to a scratch buffer, and the last one straight to ``shard``.
    """
    p, r = p2p.world_size, p2p.rank
    if p == 1:
        shard.copy_(full)
        return
    blocks = split_blocks(p2p.workspace(3, full.numel(), full), p)
    blocks[r] = shard  # block r is reduced at the last step
    steps = _reduce_scatter_steps(r, p)
    _RingRun(blocks, steps, p2p, op, segment_bytes, sources=split_blocks(full, p)).run(first_send=(r - 1) % p)


def all_gather_blocks(
    blocks: list[torch.Tensor], p2p: P2P, segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> None:
    """Every rank holds ``blocks[rank]`` filled; afterwards every rank holds all of them."""
    p, r = p2p.world_size, p2p.rank
    if p > 1:
        _RingRun(blocks, _all_gather_steps(r, p), p2p, "sum", segment_bytes).run(first_send=r)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, p2p: P2P, segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> None:
    """Ring all-gather of equal ``shard``s into the 1-D ``output`` (p blocks, in rank order)."""
    blocks = split_blocks(output, p2p.world_size)
    blocks[p2p.rank].copy_(shard)
    all_gather_blocks(blocks, p2p, segment_bytes)
