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
# Added to every tag an algorithm uses, so its messages never pair with a caller's own send/recv on the
# same group (those use tag 0 unless told otherwise), even while it runs on the communication thread.
TAG_BASE = 1 << 20


class Work(Protocol):
    """Something under way that can be waited for (backend work, a message in flight)."""

    def wait(self) -> object: ...


class Done:
    """Work that is already complete (an empty message, or a call that ran synchronously)."""

    def wait(self) -> bool:
        return True


class P2P:
    """isend/irecv to group ranks of one process group, counting bytes into ``stats`` (if given)."""

    def __init__(self, group: dist.ProcessGroup | None = None, stats: object | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = stats  # anything with add(sent=..., received=...) (a CommStats)
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
        return dist.isend(tensor, self._global(dst), group=self.group, tag=TAG_BASE + tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        if tensor.numel() == 0:
            return Done()
        if self.stats is not None:
            self.stats.add(received=tensor.numel() * tensor.element_size())
        return dist.irecv(tensor, self._global(src), group=self.group, tag=TAG_BASE + tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Send ``send`` to ``peer`` while receiving ``recv`` from it (both sides call this)."""
        requests = [self.irecv(recv, peer, tag), self.isend(send, peer, tag)]
        for request in requests:
            request.wait()


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
