"""N-d box arithmetic for checkpoint pieces and requests: pure functions, no I/O, no communication.

A :class:`Box` is a rectangular block of a global tensor, an offset and a length per dim; its
elements are stored (and returned) 1-D in the box's own row-major order. A flat range ``[start,
stop)`` of a row-major tensor is a union of at most ``2*ndim-1`` boxes, each one contiguous in the
flattening (:func:`flat_segments`), so any mix of flat and box pieces and requests reduces to
intersecting boxes. The reader copies an intersection between two storages through strided views
(:func:`strides`, :func:`flat_offset`) instead of per-element index tensors, and :func:`box_runs`
lists the contiguous runs a sub-box occupies in its outer box's storage (one start per run, not per
element), which the reader rounds out to whole checksum chunks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.device import HOST

Segment = tuple["Box", int]  # a box and where its row-major elements start in some 1-D storage


@dataclass(frozen=True)
class Box:
    """Elements ``offsets[d] <= i[d] < offsets[d] + lengths[d]`` of a global tensor, for every dim d.

    A request for a box returns a tensor of shape ``lengths``; a box piece stores its ``volume``
    elements 1-D in row-major order. A 0-d box (``Box((), ())``) is the one element of a scalar.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        # operator.index: an offset of 1.5 or "2" is a mistake to refuse, not a number to round.
        object.__setattr__(self, "offsets", tuple(operator.index(o) for o in self.offsets))
        object.__setattr__(self, "lengths", tuple(operator.index(n) for n in self.lengths))
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box has {len(self.offsets)} offsets but {len(self.lengths)} lengths")

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def volume(self) -> int:
        return math.prod(self.lengths)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def inside(self, shape: Sequence[int]) -> bool:
        """True when the box has ``shape``'s rank and lies within it."""
        return len(shape) == self.ndim and all(
            o >= 0 and n >= 0 and o + n <= s
            for o, n, s in zip(self.offsets, self.lengths, shape, strict=True)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths, strict=True)) + "]"


@dataclass(frozen=True)
class Placement:
    """Global elements ``global_box`` are held at local elements ``local_box`` (same lengths): how a
    tensor-parallel shard, or a whole tensor, sits in its global tensor."""

    global_box: Box
    local_box: Box

    def __post_init__(self) -> None:
        if self.global_box.lengths != self.local_box.lengths:
            raise ValueError(f"placement {self.global_box} -> {self.local_box}: the lengths differ")

    @staticmethod
    def whole(shape: Sequence[int]) -> Placement:
        box = Box.full(tuple(shape))
        return Placement(box, box)

    def global_part(self, local: Box) -> tuple[Box, Box] | None:
        """The part of local box ``local`` this placement holds: (its global box, its local box), or None."""
        part = intersect(local, self.local_box)
        if part is None:
            return None
        shift = [g - lo for g, lo in zip(self.global_box.offsets, self.local_box.offsets, strict=True)]
        return Box(tuple(o + d for o, d in zip(part.offsets, shift, strict=True)), part.lengths), part


def index_of(box: Box, within: Box | None = None) -> tuple[slice, ...]:
    """The slices that select ``box`` from a tensor holding ``within`` (default: the global tensor)."""
    base = within.offsets if within is not None else (0,) * box.ndim
    return tuple(slice(o - b, o - b + n) for o, b, n in zip(box.offsets, base, box.lengths, strict=True))


def strides(lengths: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a tensor (or box storage) of shape ``lengths``."""
    out, step = [], 1
    for n in reversed(lengths):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def flat_offset(box: Box, point: Sequence[int]) -> int:
    """Where global element ``point`` (inside ``box``) sits in the box's row-major storage."""
    return sum((p - o) * s for p, o, s in zip(point, box.offsets, strides(box.lengths), strict=True))


def unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinates of flat element ``index`` of a row-major tensor of ``shape``."""
    out = []
    for n in reversed(shape):
        index, rem = divmod(index, n) if n else (index, 0)
        out.append(rem)
    return tuple(reversed(out))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    hi = tuple(min(x, y) for x, y in zip(a.stops, b.stops, strict=True))
    if any(top <= bottom for bottom, top in zip(lo, hi, strict=True)):
        return None
    return Box(lo, tuple(top - bottom for bottom, top in zip(lo, hi, strict=True)))


def flat_segments(shape: Sequence[int], start: int, stop: int) -> list[Segment]:
    """Flat range ``[start, stop)`` of a row-major tensor as boxes, each contiguous in the flattening.

    Returns ``(box, offset)`` pairs in order, ``offset`` being where the box's elements begin inside
    the range (so the first is 0). At most ``2*ndim-1`` boxes: whole rows of ever larger blocks up to
    the widest aligned block, then ever smaller ones down to ``stop``.
    """
    ndim = len(shape)
    if start >= stop:
        return []
    if ndim == 0:
        return [(Box((), ()), 0)]
    step = strides(shape)
    out: list[Segment] = []
    pos = start
    while pos < stop:
        idx = unravel(pos, shape)
        # The widest block starting here: dims after k must all start at 0 to be taken whole.
        k = ndim - 1
        while k > 0 and idx[k] == 0:
            k -= 1
        # ... and not reach past stop: narrow to a finer dim while not even one block fits.
        while stop - pos < step[k]:
            k += 1
        count = min(shape[k] - idx[k], (stop - pos) // step[k])
        offsets = (*idx[: k + 1], *(0,) * (ndim - k - 1))
        lengths = (*(1,) * k, count, *shape[k + 1 :])
        out.append((Box(offsets, lengths), pos - start))
        pos += count * step[k]
    return out


def box_runs(outer: Box, inner: Box) -> tuple[torch.Tensor, int]:
    """The contiguous runs ``inner`` (inside ``outer``) occupies in ``outer``'s row-major storage.

    Returns the runs' start offsets (int64, ascending) and their common length. Trailing dims that
    ``inner`` spans whole merge into one run, so a box cut along dim 0 is a single run and a cut along
    the last dim is one run per row; the tensor holds one entry per run, never one per element.
    """
    if inner.volume == 0:
        return torch.zeros(0, dtype=torch.int64, device=HOST), 0  # host index arithmetic
    ndim = inner.ndim
    k = max(ndim - 1, 0)
    while k > 0 and inner.lengths[k] == outer.lengths[k]:
        k -= 1
    run = math.prod(inner.lengths[k:])
    step = strides(outer.lengths)
    starts = torch.tensor([flat_offset(outer, inner.offsets)], dtype=torch.int64, device=HOST)
    for d in range(k):
        steps = torch.arange(inner.lengths[d], dtype=torch.int64, device=HOST) * step[d]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts, run


def first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Indices ``(i, j)`` of two boxes that share an element, or None when all are disjoint.

    A sweep along dim 0 compares only boxes whose dim-0 ranges meet; boxes cut along another dim all
    meet on dim 0, so the worst case is quadratic in the number of boxes (pieces per tensor: few).
    """
    if not boxes:
        return None
    if boxes[0].ndim == 0:
        return (0, 1) if len(boxes) > 1 else None
    order = sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[0])
    active: list[int] = []
    for i in order:
        here = boxes[i].offsets[0]
        active = [j for j in active if boxes[j].stops[0] > here]
        for j in active:
            if intersect(boxes[i], boxes[j]) is not None:
                return (min(i, j), max(i, j))
        active.append(i)
    return None
