"""The codec protocol: how one bucket of gradients is encoded, exchanged, decoded and combined.

A *bucket* is a flat 1-D tensor holding this rank's share of a sum (DDP's gradient bucket, a ZeRO flat
group's gradients, a parameter server's push, DiLoCo's pseudo-gradient). Every codec reduces it to the
*sum* over ranks, the quantity the uncompressed path computes (each rank's loss is already divided by the
global item count, see ``engine.base``), and says what its own message stood for (``Reduced.sent``), so
the driver (``compression.comm.CompressedComm``) can keep the error-feedback residual.

Communication pattern: a codec chooses its own exchange, it is not forced into one collective. A
``MessageCodec`` sends one message per rank: ``encode`` makes it, then either an all-reduce sums the
messages on the wire (identity, fp16/bf16, where the encoding is closed under addition) or an all-gather
brings every rank's message to every rank and ``accumulate`` decodes and adds them in rank order, so all
ranks get bit-identical sums (top-k's (index, value) pairs, packed signs). Codecs of several rounds
(int8: agree on scales, then sum; PowerSGD: P, then Q) write ``rounds`` themselves as a generator that
yields each collective's ``Work``; the driver resumes it when that work completes, so the first round
overlaps whatever the caller does before waiting (DDP: the rest of backward).

The protocol is the compress / exchange / decompress split of GRACE (Xu et al., "GRACE: A Compressed
Communication Framework for Distributed Machine Learning", ICDCS 2021), with multi-round codecs
(PowerSGD) as generators. Every message also has a point-to-point form (``encode`` -> ``pack``,
``unpack`` -> ``accumulate``) for a parameter server, which decodes each worker's message by itself;
codecs without one (PowerSGD needs its workers to all-reduce among themselves) say so (``pushable``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.collectives.api import Comm, Work
from shardwise.device import HOST

Rounds = Generator[Work, None, "Reduced"]


@dataclass(frozen=True)
class Segment:
    """One tensor inside a bucket: where it starts (in elements) and its shape (PowerSGD's matrices)."""

    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class CodecState:
    """What one bucket keeps between reductions: its layout, the error-feedback residual, the codec's own.

    ``gaps`` are ranges that belong to no tensor (ZeRO's padding): the driver keeps them zero.
    """

    numel: int
    dtype: torch.dtype
    segments: tuple[Segment, ...]
    gaps: tuple[tuple[int, int], ...] = ()
    residual: torch.Tensor | None = None  # (numel,) what earlier reductions left unsent
    previous: torch.Tensor | None = None  # the residual before the last pack (undone if it is refused)
    undoable: bool = False  # the last pack can still be taken back
    reductions: int = 0  # reductions of this bucket so far, uncompressed warm-up included
    extra: dict[str, Any] = field(default_factory=dict)  # the codec's own (DGC momentum, PowerSGD P/Q)


@dataclass
class Reduced:
    """The end of one reduction."""

    total: torch.Tensor  # (numel,) the decoded sum over ranks, identical on every rank
    sent: torch.Tensor  # (numel,) what this rank's contribution stood for; the residual is x - sent


def segments_of(shapes: list[tuple[int, ...]]) -> tuple[Segment, ...]:
    """Consecutive tensors of ``shapes`` laid out from offset 0 (a bucket built by concatenation)."""
    out, offset = [], 0
    for shape in shapes:
        out.append(Segment(offset, tuple(shape)))
        offset += out[-1].numel
    return tuple(out)


class AllOf:
    """Several collectives in flight at once, waited for as one (a round of two all-reduces, say)."""

    def __init__(self, *works: Work) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def gaps_of(numel: int, segments: Sequence[Segment]) -> tuple[tuple[int, int], ...]:
    """The ranges of ``[0, numel)`` that no segment covers."""
    out, cursor = [], 0
    for seg in sorted(segments, key=lambda s: s.offset):
        if seg.offset > cursor:
            out.append((cursor, seg.offset))
        cursor = max(cursor, seg.offset + seg.numel)
    if cursor < numel:
        out.append((cursor, numel))
    return tuple(out)


class Codec(ABC):
    """A gradient compressor: see the module docstring for the protocol."""

    name: str = "codec"
    exchange: str = "all_reduce"  # the collective(s) it uses, as the docs and the benchmark show them
    lossless: bool = False  # True: nothing is ever left unsent, so no residual is kept
    pushable: bool = True  # has a point-to-point form (parameter-server pushes)
    fixed_size: bool = True  # a message's size depends only on the bucket (a receiver can preallocate)

    def __init__(self, spec: str) -> None:
        self.spec = spec  # as the user wrote it, e.g. "topk:0.01"

    def prepare(self, grad: torch.Tensor, state: CodecState, comm: Comm) -> torch.Tensor:
        """Before error feedback: what this rank wants to send this step (DGC: its momentum)."""
        return grad

    @abstractmethod
    def rounds(self, x: torch.Tensor, state: CodecState, comm: Comm) -> Rounds:
        """Reduce ``x`` (numel,) to the sum over ``comm``'s ranks, yielding each collective's work."""

    # -- the point-to-point form: one self-contained message per rank ------------------------------
    def encode(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(wire, sent)``: the message for ``x`` and the dense tensor it stands for."""
        raise NotImplementedError(f"the {self.name} codec has no single-message form")

    def wire_like(self, state: CodecState) -> torch.Tensor:
        """The size and dtype of the message ``encode`` makes for the bucket of ``state``, as a tensor
        on the meta device (a description: no data)."""
        raise NotImplementedError(f"the {self.name} codec has no single-message form")

    def accumulate(self, total: torch.Tensor, wire: torch.Tensor, state: CodecState) -> None:
        """Add what one rank's message ``wire`` stands for into ``total`` (numel,); every rank's
        message for a bucket has the same layout, ``state``'s."""
        raise NotImplementedError(f"the {self.name} codec has no single-message form")

    def pack(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        """The point-to-point message as bytes (uint8) and what it stands for."""
        wire, sent = self.encode(x, state)
        return as_bytes(wire), sent

    def unpack(self, data: torch.Tensor, state: CodecState) -> torch.Tensor:
        """A received message (uint8) decoded to a dense (numel,) tensor of the bucket's dtype."""
        like = self.wire_like(state)
        total = torch.zeros(state.numel, dtype=state.dtype, device=data.device)
        self.accumulate(total, data.view(like.dtype).view(like.shape), state)
        return total

    def packed_bytes(self, state: CodecState) -> int:
        like = self.wire_like(state)
        return like.numel() * like.element_size()


class MessageCodec(Codec):
    """A codec of one message per rank, exchanged by one all-reduce (``exchange = "all_reduce"``: the
    encoding is summable on the wire) or one all-gather (each message decoded and added in rank order)."""

    def rounds(self, x: torch.Tensor, state: CodecState, comm: Comm) -> Rounds:
        wire, sent = self.encode(x, state)
        total = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
        if self.exchange == "all_reduce":
            yield comm.all_reduce(wire, "sum", async_op=True)
            self.accumulate(total, wire, state)
            return Reduced(total, sent)
        # (world * wire_numel,): every rank's message, in rank order
        gathered = wire.new_empty(comm.world_size * wire.numel())
        yield comm.all_gather(gathered, wire.reshape(-1), async_op=True)
        for row in gathered.view(comm.world_size, -1):
            self.accumulate(total, row.view(wire.shape), state)
        return Reduced(total, sent)


# -- byte packing: several tensors in one uint8 message (one collective instead of several) ---------


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def concat_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    """One flat uint8 message holding each tensor's bytes in turn."""
    return torch.cat([as_bytes(t) for t in tensors])


def split_bytes(data: torch.Tensor, *parts: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """The inverse of ``concat_bytes``: ``parts`` are (numel, dtype) in order; views where aligned."""
    out, offset = [], 0
    for numel, dtype in parts:
        itemsize = dtype.itemsize
        chunk = data[offset : offset + numel * itemsize]
        # a view needs an address aligned to the element size (a gathered row may not be): else copy
        out.append(chunk.view(dtype) if chunk.data_ptr() % itemsize == 0 else chunk.clone().view(dtype))
        offset += numel * itemsize
    return out


def wire_float(dtype: torch.dtype) -> torch.dtype:
    """The float dtype scales travel in: float64 buckets keep float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Chunks:
    """A bucket cut into chunks of at most ``size`` elements that never cross a tensor's edge (a scale
    per chunk then describes one tensor, not a LayerNorm weight and a matrix at once); gaps are chunks
    of their own. Chunks lie in order along the bucket; each range (a tensor or a gap) is ``full``
    chunks of ``size`` and maybe one shorter ``tail``, so per-chunk work is a reshape, not a gather."""

    size: int
    numel: int
    ranges: tuple[tuple[int, int, int], ...]  # (offset, full chunks, tail elements) per range
    count: int  # chunks in all
    rows: tuple[int, ...]  # chunks (rows) in each of ``_parts``' views, in order

    def absmax(self, x: torch.Tensor) -> torch.Tensor:
        """(count,) the largest magnitude in each chunk of ``x`` (numel,)."""
        return torch.cat([part.abs().amax(dim=1) for part in self._parts(x)])

    def abs_mean(self, x: torch.Tensor) -> torch.Tensor:
        """(count,) the mean magnitude in each chunk of ``x`` (numel,)."""
        return torch.cat([part.abs().mean(dim=1) for part in self._parts(x)])

    def spread(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """(numel,) each element's value of ``per_chunk`` (count,), i.e. ``per_chunk[ids()]``."""
        out = per_chunk.new_empty(self.numel)
        for part, values in zip(self._parts(out), per_chunk.split(self.rows), strict=True):
            part.copy_(values[:, None].expand_as(part))
        return out

    def _parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``x`` (numel,): (full, size) per range's full chunks and (1, tail) per tail."""
        out = []
        for offset, full, tail in self.ranges:
            if full:
                out.append(x[offset : offset + full * self.size].view(full, self.size))
            if tail:
                start = offset + full * self.size
                out.append(x[start : start + tail].view(1, tail))
        return out

    def ids(self) -> torch.Tensor:
        """(numel,) int64 each element's chunk (for inspection: the codecs never gather)."""
        return self.spread(torch.arange(self.count, device=HOST))


def chunks_for(state: CodecState, size: int) -> Chunks:
    """The ``Chunks`` of ``state``'s bucket for chunks of ``size`` elements (cached in the state)."""
    key = f"chunks{size}"
    cached = state.extra.get(key)
    if not isinstance(cached, Chunks):
        spans = [(s.offset, s.numel) for s in state.segments if s.numel]
        spans = sorted(spans + [(a, b - a) for a, b in state.gaps])
        ranges = tuple((offset, numel // size, numel % size) for offset, numel in spans)
        rows = tuple(n for _, full, tail in ranges for n in (full, int(tail > 0)) if n)
        cached = state.extra[key] = Chunks(size, state.numel, ranges, sum(rows), rows)
    return cached


def chunks_of(state: CodecState, size: int) -> tuple[torch.Tensor, int]:
    """Each element's chunk (numel,) int64 and the number of chunks, of ``chunks_for``."""
    chunks = chunks_for(state, size)
    return chunks.ids(), chunks.count
