"""Replay a recorded initialisation on any part of a tensor: equal values whatever part a rank holds.

Torch's CPU generator cannot skip ahead, and it draws in blocks, so a slice of one whole draw cannot
be reproduced alone. Instead every tensor is drawn on a fixed chunk grid that its global shape alone
sets (:func:`chunk_shape`: about ``CHUNK_ELEMENTS`` elements, at most ``CHUNK_WIDTH`` along the last
dim, so a tensor-parallel column shard and a ZeRO-3 row range both touch few chunks), each chunk from
its own generator seeded by (seed, tensor name, chunk index): a chunk starts at zero and the recorded
ops run on it in order (a draw fills the whole chunk and keeps its region's part; an elementwise op
applies to its region's part; computed values are copied in). :class:`RandomInit` is the
``WeightSource`` (:mod:`shardwise.checkpoint.source`): ``read_box`` makes only the chunks the box
meets, one at a time (the last one is kept, for the next read of a neighbouring range), and returns
the box in the dtype the tensor was built in; the caller casts. A tensor whose ops are not all
elementwise (``orthogonal_``, a region that is no box) is one chunk: drawn whole on each rank that
holds part of it. Draws run on the host, so a rank's device does not change its values, and one
process (``build_model``, ``verify``'s reference) reads the same values. No communication.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.boxes import Box, index_of, intersect
from shardwise.checkpoint.source import HeldWeights
from shardwise.config import ConfigError
from shardwise.device import HOST
from shardwise.models.init_record import InitRecord, Op, Recorder, TensorInit, record_of

CHUNK_ELEMENTS = 1 << 20  # about 4 MB of float32: one chunk is all a read holds besides its output
CHUNK_WIDTH = 1024  # along the last dim: a column shard touches only its own chunks


def chunk_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The grid's chunk for a tensor of ``shape``: at most ``CHUNK_WIDTH`` wide along the last dim,
    then as many rows of the dims before as fit in ``CHUNK_ELEMENTS``."""
    if not shape:
        return ()
    lengths = [1] * len(shape)
    lengths[-1] = max(1, min(shape[-1], CHUNK_WIDTH if len(shape) > 1 else CHUNK_ELEMENTS))
    room = max(1, CHUNK_ELEMENTS // lengths[-1])
    for d in range(len(shape) - 2, -1, -1):
        lengths[d] = max(1, min(shape[d], room))
        room = max(1, room // lengths[d])
    return tuple(lengths)


def chunks(shape: tuple[int, ...], chunk: tuple[int, ...], box: Box) -> Iterator[tuple[int, Box]]:
    """(index, chunk box) of every chunk of the grid that meets ``box``, in row-major order."""
    if box.volume == 0:
        return
    counts = [-(-n // c) for n, c in zip(shape, chunk, strict=True)]
    ranges = [
        range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(box.offsets, box.lengths, chunk, strict=True)
    ]
    for coords in itertools.product(*ranges):
        index = 0
        for i, count in zip(coords, counts, strict=True):
            index = index * count + i
        offsets = tuple(i * c for i, c in zip(coords, chunk, strict=True))
        lengths = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, offsets, strict=True))
        yield index, Box(offsets, lengths)


def chunk_seed(seed: int, name: str, index: int) -> int:
    """A generator seed from (seed, tensor name, chunk index): independent streams, same everywhere."""
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _takes_generator(fn: Callable[..., Any]) -> bool:
    try:
        return "generator" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _draw(op: Op, out: torch.Tensor, generator: torch.Generator) -> None:
    """Fill ``out`` by ``op``'s draw (a random in-place method, or a chunked ``nn.init`` call)."""
    kwargs = dict(op.kwargs)
    if op.fn is not None:
        op.fn(out, *op.args, generator=generator, **kwargs)
    else:
        getattr(out, op.name)(*op.args, generator=generator, **kwargs)


def _whole(op: Op, values: torch.Tensor, generator: torch.Generator) -> None:
    """``op`` on the exact view it was recorded on, in the whole tensor ``values``."""
    region = op.region
    assert region is not None
    view = values.as_strided(region.sizes, region.strides, region.offset)
    if op.kind == "whole":
        assert op.fn is not None
        kwargs = dict(op.kwargs)
        if _takes_generator(op.fn):
            kwargs["generator"] = generator
        with torch.no_grad():
            op.fn(view, *op.args, **kwargs)
    elif op.kind == "draw":
        drawn = torch.empty(region.sizes, dtype=values.dtype, device=HOST)
        _draw(op, drawn, generator)
        view.copy_(drawn)
    elif op.kind == "pointwise":
        getattr(view, op.name)(*op.args, **dict(op.kwargs))
    elif op.kind == "value":
        assert op.data is not None
        view.copy_(op.data.reshape(region.sizes))


def replay_chunk(init: TensorInit, chunk: Box, generator: torch.Generator) -> torch.Tensor:
    """The values of ``chunk`` of a tensor initialised by ``init`` (a whole tensor: its one chunk)."""
    values = torch.zeros(chunk.lengths, dtype=init.dtype, device=HOST)
    for op in init.ops:
        if init.whole:
            _whole(op, values, generator)
            continue
        assert op.box is not None
        part = intersect(op.box, chunk)
        if part is None:
            continue
        here = index_of(part, chunk)
        if op.kind == "draw":
            if part == chunk:
                _draw(op, values, generator)
            else:  # the whole chunk is drawn, so its stream does not depend on the region's shape
                drawn = torch.empty(chunk.lengths, dtype=init.dtype, device=HOST)
                _draw(op, drawn, generator)
                values[here] = drawn[here]
        elif op.kind == "pointwise":
            getattr(values[here], op.name)(*op.args, **dict(op.kwargs))
        else:  # value
            assert op.data is not None
            values[here] = op.data[index_of(part, op.box)]
    return values


class RandomInit:
    """A model's recorded initialisation as a ``WeightSource`` (see the module docstring)."""

    def __init__(self, record: InitRecord) -> None:
        if problems := record.problems():
            shown = "; ".join(problems[:2]) + (f" and {len(problems) - 2} more" if len(problems) > 2 else "")
            raise ConfigError(
                f"the model's initialisation cannot be replayed on parts of it ({shown}); build the model "
                "with its values and pass it in (each rank then starts from rank 0's), or set model.init_from"
            )
        self.record = record
        self._last: tuple[str, int, torch.Tensor] | None = None  # the chunk made last

    def has(self, name: str) -> bool:
        return self.record.aliases.get(name, name) in self.record.tensors

    def _chunk(self, name: str, init: TensorInit, index: int, chunk: Box) -> torch.Tensor:
        if self._last is not None and self._last[:2] == (name, index):
            return self._last[2]
        self._last = None  # one chunk alive at a time
        generator = torch.Generator(device=HOST).manual_seed(chunk_seed(self.record.seed, name, index))
        values = replay_chunk(init, chunk, generator)
        self._last = (name, index, values)
        return values

    def read_box(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        name = self.record.aliases.get(name, name)
        init = self.record.tensors[name]
        if out is None:
            out = torch.empty(box.lengths, dtype=init.dtype, device=HOST)
        grid = init.shape if init.whole else chunk_shape(init.shape)
        for index, chunk in chunks(init.shape, grid, box):
            part = intersect(chunk, box)
            assert part is not None
            out[index_of(part, box)] = self._chunk(name, init, index, chunk)[index_of(part, chunk)]
        return out

    def notes(self) -> list[str]:
        return self.record.notes()

    def close(self) -> None:
        self._last = None


def build_recorded(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` built on the meta device, its initialisation recorded (``init_record.record_of``)."""
    with Recorder().building() as recorder:
        model = make()
    recorder.finish(model)
    return model


def record_initialisation(model: nn.Module) -> InitRecord | None:
    """The record of ``model``: made when it was built (``build_recorded``), or now, for a model a user
    built on meta, by running each module's own ``reset_parameters`` (a Hugging Face model's
    ``initialize_weights``) under the recorder. None when it has no tensor on meta."""
    found = record_of(model)
    if found is not None or not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return found
    with Recorder().building() as recorder, torch.no_grad():
        initialize = getattr(model, "initialize_weights", None)
        if callable(initialize):
            initialize()
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and not callable(initialize):
                reset()
    record = recorder.finish(model)
    for init in record.tensors.values():
        if not init.ops and not init.problem:
            init.problem = "no reset_parameters of its modules writes it"
    return record


def materialize_whole(model: nn.Module) -> None:
    """Every meta tensor of ``model`` given its recorded initial values, whole, on the host (one
    process: the values every layout's ranks read parts of)."""
    record = record_initialisation(model)
    if record is not None:
        HeldWeights.of(RandomInit(record), model).load_whole(model)
