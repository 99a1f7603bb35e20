"""The point-to-point interface every explicit algorithm is written against, and its small helpers.

An algorithm is a plain function ``fn(flat, p2p, op, ...)`` over a 1-D contiguous tensor and a ``P2P``:
it only ever calls ``p2p.isend`` / ``p2p.irecv`` to *group* ranks. ``P2P`` forwards them to
``torch.distributed`` and counts the bytes of every message, so the byte counts of the explicit
algorithms are exact (what was really sent and received, never a formula).

Empty messages are never sent: both ends of a message always know its length, so they skip it together.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

REDUCE_OPS = ("sum", "max", "min")  # "avg" is "sum" then a division, done by the caller
# Tags below TAG_BASE belong to callers' own send/recv. Every ``Comm`` on a process group gets its own
# slot of SLOT_TAGS tags above it (``tag_slot``), and its algorithms' tags are offset into that slot,
# so they never pair with a caller's messages nor with another ``Comm``'s on the same group, even
# while both run on their communication threads. gloo tags are 32-bit: 2047 slots fit.
TAG_BASE = 1 << 20
SLOT_TAGS = 1 << 20
MAX_SLOTS = (2**31 - TAG_BASE) // SLOT_TAGS


class Work(Protocol):
    """Something under way that can be waited for (backend work, a message in flight)."""

    def wait(self) -> object: ...


class Counter(Protocol):
    """Where message bytes are counted (a ``CommStats``)."""

    def add(self, sent: int = 0, received: int = 0, blocked_s: float = 0.0) -> None: ...


class Done:
    """Work that is already complete (an empty message, or a call that ran synchronously)."""

    def wait(self) -> bool:
        return True


class P2P:
    """isend/irecv to group ranks of one process group, counting bytes into ``stats`` (if given)."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, stats: Counter | None = None, tag_slot: int = 0
    ) -> None:
        if not 0 <= tag_slot < MAX_SLOTS:
            raise ValueError(f"tag_slot must be in [0, {MAX_SLOTS}), got {tag_slot}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = stats
        self.tag_base = TAG_BASE + tag_slot * SLOT_TAGS
        self._workspace: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def workspace(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A scratch buffer of ``numel`` elements, kept between calls.

        Receiving into freshly allocated memory pays the kernel's page faults and zeroing on every
        call (several ms for tens of MB), so the algorithms receive into these instead. The buffer
        only grows; it holds at most the largest request per (slot, dtype, device) of ``like``.
        """
        key = (slot, like.dtype, like.device)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = like.new_empty(numel)
            self._workspace[key] = buffer
        return buffer[:numel]

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        if tensor.numel() == 0:
            return Done()
        if self.stats is not None:
            self.stats.add(sent=tensor.numel() * tensor.element_size())
        return _work(dist.isend(tensor, self._global(dst), group=self.group, tag=self._tag(tag)))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        if tensor.numel() == 0:
            return Done()
        if self.stats is not None:
            self.stats.add(received=tensor.numel() * tensor.element_size())
        return _work(dist.irecv(tensor, self._global(src), group=self.group, tag=self._tag(tag)))

    def _tag(self, tag: int) -> int:
        if not 0 <= tag < SLOT_TAGS:
            raise ValueError(f"an algorithm's tag must be in [0, {SLOT_TAGS}), got {tag}")
        return self.tag_base + tag

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Send ``send`` to ``peer`` while receiving ``recv`` from it (both sides call this)."""
        requests = [self.irecv(recv, peer, tag), self.isend(send, peer, tag)]
        for request in requests:
            request.wait()


def _work(work: dist.Work | None) -> Work:
    """Point-to-point calls return work unless the rank is outside the group (never, here)."""
    if work is None:
        raise RuntimeError("a point-to-point call returned no work: this rank is not in the group")
    return work


def combine(op: str, acc: torch.Tensor, incoming: torch.Tensor) -> None:
    """``acc <- acc (op) incoming``, in place and in ``acc``'s own dtype."""
    combine_into(op, acc, acc, incoming)


def combine_into(op: str, out: torch.Tensor, local: torch.Tensor, incoming: torch.Tensor) -> None:
    """``out <- local (op) incoming``; ``out`` may be ``local`` itself."""
    if op == "sum":
        torch.add(local, incoming, out=out)
    elif op == "max":
        torch.maximum(local, incoming, out=out)
    elif op == "min":
        torch.minimum(local, incoming, out=out)
    else:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")


def block_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous blocks whose sizes differ by at most one.

    The first ``numel % parts`` blocks get the extra element (as ``torch.tensor_split``); blocks may be
    empty when ``numel < parts``.
    """
    base, extra = divmod(numel, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def split_blocks(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Views of ``flat`` (1-D) as ``parts`` near-equal contiguous blocks (see ``block_bounds``)."""
    return [flat[lo:hi] for lo, hi in block_bounds(flat.numel(), parts)]


def wait_all(requests: list[Work]) -> None:
    for request in requests:
        request.wait()
