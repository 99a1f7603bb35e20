"""The one tensor-parallel shard arithmetic: which box of a global parameter a tp rank holds.

Pure data, no communication; the checkpoint's :class:`~shardwise.checkpoint.boxes.Box` is the unit. A
:class:`ShardedParam` knows its global name and shape and where its local tensor's elements come from:
one or more :class:`Placement` s, each a box of the global tensor and the box of the local tensor it
fills. A plain column or row split is one placement. A fused projection (``qkv``: queries, keys and
values stacked along the output dim) is split section by section, so each rank holds its own heads'
q, k and v: three placements whose local boxes stack to the local tensor. A replicated parameter has
one placement covering the whole tensor.

Splits are even or refused with the arithmetic (``hidden 10 is not divisible by tp 4``): Megatron pads
instead, which would change the model. Nothing else in ``tensor_parallel`` slices a parameter by hand:
layers call :meth:`ShardedParam.take`, tests and checkpoints assemble with :meth:`ShardedParam.put`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.checkpoint.boxes import Box, Placement
from shardwise.device import HOST


def even_share(size: int, tp: int, what: str) -> int:
    """``size / tp``, or a ``ValueError`` with the arithmetic (``what`` names the size: "hidden")."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if size % tp:
        raise ValueError(f"{what} {size} is not divisible by tp {tp}")
    return size // tp


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


@dataclass(frozen=True)
class ShardedParam:
    """One parameter as a tp rank holds it: global name and shape, local shape, placements."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def replicated(self) -> bool:
        """Every tp rank holds the whole tensor."""
        return self.local_shape == self.global_shape and len(self.placements) == 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the ``full`` global one (a fresh, contiguous copy)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"{self.name}: got shape {tuple(full.shape)}, expected {self.global_shape}")
        local = full.new_empty(self.local_shape)
        for p in self.placements:
            local[_index(p.local_box)] = full[_index(p.global_box)]
        return local

    def put(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write ``local`` (this rank's tensor, or its gradient) into its places in ``full``."""
        if tuple(local.shape) != self.local_shape:
            raise ValueError(
                f"{self.name}: got local shape {tuple(local.shape)}, expected {self.local_shape}"
            )
        for p in self.placements:
            full[_index(p.global_box)] = local[_index(p.local_box)]


def replicated(name: str, shape: Sequence[int]) -> ShardedParam:
    """A parameter every tp rank holds whole (norms, row-parallel biases)."""
    whole = Box.full(tuple(shape))
    return ShardedParam(name, tuple(shape), tuple(shape), (Placement(whole, whole),))


def split_sections(
    name: str,
    shape: Sequence[int],
    dim: int,
    sections: Sequence[int],
    tp: int,
    tp_rank: int,
    what: Sequence[str],
) -> ShardedParam:
    """Split ``dim`` of a parameter made of consecutive ``sections`` (q, k, v), each evenly over tp.

    Rank ``r`` holds slice ``r`` of every section, stacked in section order; ``what`` names each
    section for the error message (``"q width 10 is not divisible by tp 4"``).
    """
    shape = tuple(shape)
    if sum(sections) != shape[dim]:
        raise ValueError(f"{name}: sections {list(sections)} do not add up to dim {dim} of {shape}")
    placements, local_at, start = [], 0, 0
    for size, label in zip(sections, what, strict=True):
        share = even_share(size, tp, label)
        offsets = [0] * len(shape)
        lengths = list(shape)
        lengths[dim] = share
        offsets[dim] = start + tp_rank * share
        local_offsets = [0] * len(shape)
        local_offsets[dim] = local_at
        placements.append(
            Placement(Box(tuple(offsets), tuple(lengths)), Box(tuple(local_offsets), tuple(lengths)))
        )
        local_at += share
        start += size
    local_shape = list(shape)
    local_shape[dim] = local_at
    return ShardedParam(name, shape, tuple(local_shape), tuple(placements))


def split_dim(name: str, shape: Sequence[int], dim: int, tp: int, tp_rank: int, what: str) -> ShardedParam:
    """Split ``dim`` evenly: rank ``r`` holds elements ``[r * share, (r + 1) * share)`` along it."""
    return split_sections(name, shape, dim, [tuple(shape)[dim]], tp, tp_rank, [what])


def assemble(shards: Sequence[ShardedParam], locals_: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global tensor from every tp rank's record and local tensor (tests, full checkpoints).

    Checks that the ranks' boxes cover every element exactly once (replicated parameters: each rank's
    copy must be equal, and one of them is returned).
    """
    first = shards[0]
    full = locals_[0].new_empty(first.global_shape)
    count = torch.zeros(first.global_shape, dtype=torch.int64, device=HOST)  # a check, on the host
    for shard, local in zip(shards, locals_, strict=True):
        if shard.global_shape != first.global_shape:
            raise ValueError(f"{first.name}: ranks disagree on the global shape")
        if shard.replicated:
            full.copy_(local)
            return full
        shard.put(local, full)
        ones = torch.ones(shard.local_shape, dtype=torch.int64, device=HOST)
        for p in shard.placements:
            count[_index(p.global_box)] += ones[_index(p.local_box)]
    if not bool((count == 1).all()):
        raise ValueError(f"{first.name}: the ranks' boxes do not cover the tensor exactly once")
    return full
