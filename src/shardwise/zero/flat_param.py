"""The one shard arithmetic: flatten an ordered list of parameters, pad, and slice it over ranks.

ZeRO (stages 1-3), checkpoints and the planner all use this module, so a shard always means the same
thing: parameters laid end to end in a given order (a tied parameter once, frozen ones left out),
padded with zeros to a multiple of the world size, rank ``r`` holding elements
``[r * shard_size, (r + 1) * shard_size)``. No communication happens here; the layout is pure data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Overlap:
    """The part of one parameter that falls in a rank's shard.

    ``param_start:param_end`` indexes the flattened parameter; ``shard_start:shard_end`` the shard.
    """

    name: str
    param_start: int
    param_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    """Parameters end to end, padded to ``world_size * shard_size`` elements."""

    slots: tuple[ParamSlot, ...]
    world_size: int
    total_numel: int
    padded_numel: int
    shard_size: int

    def slot(self, name: str) -> ParamSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(f"{name!r} is not in this layout; it holds {[s.name for s in self.slots]}")

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The flat elements ``[start, end)`` held by ``rank`` (padding included)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def overlaps(self, rank: int) -> list[Overlap]:
        """The parameters overlapping ``rank``'s shard, in layout order (padding is in none)."""
        start, end = self.shard_range(rank)
        out = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                out.append(Overlap(slot.name, lo - slot.offset, hi - slot.offset, lo - start, hi - start))
        return out

    def padding(self) -> int:
        return self.padded_numel - self.total_numel


def build_layout(shapes: Sequence[tuple[str, tuple[int, ...]]], world_size: int) -> FlatLayout:
    """Lay out ``(name, shape)`` pairs in the given order for ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = [name for name, _ in shapes]
    if len(set(names)) != len(names):
        raise ValueError(f"parameter names repeat in the layout: {names}")
    slots, offset = [], 0
    for name, shape in shapes:
        numel = math.prod(shape)
        slots.append(ParamSlot(name, tuple(shape), offset, numel))
        offset += numel
    shard_size = -(-offset // world_size)  # ceil: every rank holds the same count
    return FlatLayout(tuple(slots), world_size, offset, shard_size * world_size, shard_size)


def unique_parameters(
    named: Iterable[tuple[str, nn.Parameter]], trainable_only: bool = True
) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters`` with each tensor once (first name wins) and frozen ones dropped."""
    seen: set[int] = set()
    out = []
    for name, param in named:
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        out.append((name, param))
    return out


def layout_of(named: Sequence[tuple[str, nn.Parameter]], world_size: int) -> FlatLayout:
    """The layout of already-deduplicated named parameters."""
    return build_layout([(name, tuple(p.shape)) for name, p in named], world_size)


def all_names(module: nn.Module) -> dict[str, str]:
    """Every parameter name (aliases of tied weights included) -> the first name of its tensor."""
    first: dict[int, str] = {}
    out = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(param), name)
    return out
