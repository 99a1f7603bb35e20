"""Where a rank's initial values come from: one source of global tensors, each rank reading what it holds.

A :class:`WeightSource` answers ``read_box(name, box)``: the elements ``box`` of the global tensor
``name`` (the model's own name, as built, before any split), on the host, in the source's dtype. Three
implement it: the model's recorded random initialisation replayed on a chunk grid
(:mod:`shardwise.models.init_replay`), and (:mod:`shardwise.checkpoint.pretrained`) Hugging Face
safetensors and shardwise's own checkpoints, both read slice by slice.

:class:`HeldWeights` is one rank's view of a source once tensor parallelism and the pipeline split
have run on the meta device: each local tensor is one or more boxes of its global tensor
(:class:`~shardwise.checkpoint.boxes.Placement`: a tp shard, or the whole tensor), and a flat range of a
local tensor (a ZeRO-3 shard) is at most ``2*ndim-1`` boxes of it (``flat_segments``), so every read is
a handful of ``read_box`` calls and nothing outside the rank's part is read. Values are cast to the
tensor's dtype and put on the rank's device. DDP, ZeRO-1/2, the parameter server and DiLoCo take
whole local tensors (``load_whole``); ZeRO-3 takes flat ranges (``read``). No communication: every
rank reads what it holds from the same source.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from shardwise.checkpoint.boxes import Box, Placement, flat_segments, index_of
from shardwise.device import HOST  # where sources read to

META = torch.device("meta")


class WeightSource(Protocol):
    """Global tensors by name, any box of them (see the module docstring)."""

    def has(self, name: str) -> bool:
        """Whether the source holds ``name`` (any of a tied tensor's names)."""
        ...

    def read_box(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``box`` of global tensor ``name``, shape ``box.lengths``, on the host: into ``out``
        (cast to its dtype) when given, so that a read holds nothing of its own beyond the source's."""
        ...

    def notes(self) -> list[str]:
        """Lines to say once (rank 0): casts, tensors drawn whole, ..."""
        ...

    def close(self) -> None: ...


def materialize(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give a tensor on the meta device ``value``'s data, in place: the same Python object (ties,
    hooks and references to it stay valid), now real."""
    new: torch.Tensor
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(value, requires_grad=tensor.requires_grad)
    else:  # a plain leaf (a pipeline's copy of a tied weight) keeps whether it takes a gradient
        new = value.detach().requires_grad_(tensor.requires_grad)
    new.__dict__.update(tensor.__dict__)  # attributes libraries set on parameters survive the swap
    torch.utils.swap_tensors(tensor, new)


class HeldWeights:
    """One rank's reads from ``source``: local tensors by name, each a set of placements in its global
    tensor (default: the whole), cast to ``dtypes[name]`` and put on ``device``."""

    def __init__(
        self,
        source: WeightSource,
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, torch.dtype],
        placements: Mapping[str, tuple[Placement, ...]] | None = None,
        device: torch.device = HOST,
        overwrite: bool = False,
    ) -> None:
        self.source, self.shapes, self.dtypes, self.device = source, dict(shapes), dict(dtypes), device
        self.staging = META if device == META else HOST  # where reads land before the device
        self.placements = dict(placements or {})
        self.overwrite = overwrite  # a file replaces values a model already has; a replayed init does not

    @classmethod
    def of(
        cls,
        source: WeightSource,
        tensors: nn.Module | Iterable[tuple[str, torch.Tensor]],
        placements: Mapping[str, tuple[Placement, ...]] | None = None,
        device: torch.device = HOST,
        overwrite: bool = False,
    ) -> HeldWeights:
        """The ``tensors`` (a model's, as this rank holds them now) that ``source`` has: those on the
        meta device, or with ``overwrite`` every one."""
        if isinstance(tensors, nn.Module):
            tensors = [*tensors.named_parameters(), *tensors.named_buffers()]
        named = {n: t for n, t in tensors if source.has(n) and (overwrite or t.is_meta)}
        shapes = {n: tuple(t.shape) for n, t in named.items()}
        return cls(source, shapes, {n: t.dtype for n, t in named.items()}, placements, device, overwrite)

    def knows(self, name: str) -> bool:
        return name in self.shapes

    def _placements(self, name: str) -> tuple[Placement, ...]:
        return self.placements.get(name) or (Placement.whole(self.shapes[name]),)

    def read_local(self, name: str, local: Box, out: torch.Tensor) -> None:
        """Box ``local`` of this rank's tensor ``name`` into ``out`` (shape ``local.lengths``)."""
        for placement in self._placements(name):
            part = placement.global_part(local)
            if part is not None:
                global_box, local_part = part
                self.source.read_box(name, global_box, out[index_of(local_part, local)])

    def read(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the row-major flattening of this rank's tensor ``name`` (1-D,
        on the host, or into ``out``, cast to its dtype): only the boxes that range covers are read."""
        if out is None:
            out = torch.empty(stop - start, dtype=self.dtypes[name], device=self.staging)
        for box, at in flat_segments(self.shapes[name], start, stop):
            self.read_local(name, box, out[at : at + box.volume].view(box.lengths))
        return out

    def read_whole(self, name: str) -> torch.Tensor:
        """This rank's whole tensor ``name``, on the device."""
        shape = self.shapes[name]
        return self.read(name, 0, math.prod(shape)).reshape(shape).to(self.device)

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        """Give ``tensor`` (this rank's ``name``) its values: materialised from meta, or overwritten."""
        with torch.no_grad():
            value = self.read_whole(name)
            if tensor.is_meta:
                materialize(tensor, value)
            else:
                tensor.copy_(value)

    def load_whole(self, model: nn.Module, skip: Collection[int] = ()) -> None:
        """Every tensor of ``model`` this view knows, whole, except those whose ``id`` is in ``skip``."""
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if id(tensor) not in skip and self.knows(name) and (self.overwrite or tensor.is_meta):
                self.fill(name, tensor)

    def close(self) -> None:
        self.source.close()


class NoValues:
    """A source without values: every tensor it is asked for stays on the meta device, so that a
    rank's whole build and step run with no memory held (``shardwise plan --dry-run``)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = set(names)

    def has(self, name: str) -> bool:
        return name in self.names

    def read_box(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return out if out is not None else torch.empty(box.lengths, device=META)

    def notes(self) -> list[str]:
        return []

    def close(self) -> None:
        return None

