"""``int8[:CHUNK]``: 8-bit integers with one scale per chunk of ``CHUNK`` elements (default 512).

Chunks never cross a tensor's edge (``codec.chunks_for``), so a scale describes one tensor. What rounding
leaves out is kept as the error-feedback residual (Karimireddy et al. 2019).

Communication, between ranks (two all-reduces): the ranks first agree on each chunk's scale (an
all-reduce, max, of each chunk's largest magnitude: 4 bytes per chunk), then quantise with the agreed
scale and sum the int8 values on the wire (one all-reduce of one byte per element, a quarter of fp32's
bytes). Integer sums wrap around, so each rank keeps headroom: values are rounded to at most
``127 // world_size`` steps each side, so the sum of every rank's values still fits in an int8 (2 ranks:
63 steps, 4 ranks: 31, 16 ranks: 7; more than 16 ranks are refused).

Point to point (a parameter server, which decodes every push by itself): each message carries its own
scales, so it uses all 127 steps.
"""

from __future__ import annotations

import torch

from shardwise.collectives.api import Comm
from shardwise.compression.codec import (
    Codec,
    CodecState,
    Reduced,
    Rounds,
    chunks_for,
    concat_bytes,
    split_bytes,
    wire_float,
)

MAX_RANKS = 16  # 127 // 16 = 7 steps each side: below that the rounding error dominates


def chunk_absmax(x: torch.Tensor, state: CodecState, chunk: int) -> torch.Tensor:
    """(chunks,) the largest magnitude of each chunk of ``x`` (numel,), in the scales' dtype."""
    return chunks_for(state, chunk).absmax(x).to(wire_float(x.dtype))


def quantize(
    x: torch.Tensor, absmax: torch.Tensor, state: CodecState, chunk: int, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (numel,) rounded to ``steps`` levels each side of zero per chunk, given each chunk's
    ``absmax`` (chunks,). Returns the int8 values (numel,), the scales (chunks,) and the dequantised
    values (numel,)."""
    scale = absmax.to(x.dtype) / steps
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk: q = 0 anyway
    per_element = chunks_for(state, chunk).spread(scale)  # (numel,)
    q = torch.round(x / per_element).clamp_(-steps, steps)
    return q.to(torch.int8), scale, q * per_element


def dequantize(
    values: torch.Tensor, scale: torch.Tensor, state: CodecState, chunk: int, dtype: torch.dtype
) -> torch.Tensor:
    """int8 ``values`` (numel,) times their chunk's ``scale`` (chunks,), as (numel,) ``dtype``."""
    return values.to(dtype).mul_(chunks_for(state, chunk).spread(scale.to(dtype)))


class Int8Codec(Codec):
    name = "int8"
    exchange = "all_reduce (max of chunk scales, then int8 sum)"

    def __init__(self, spec: str, chunk: int = 512) -> None:
        super().__init__(spec)
        if chunk < 1:
            raise ValueError(f"int8 needs a chunk of at least 1 element, got {chunk}")
        self.chunk = chunk

    def rounds(self, x: torch.Tensor, state: CodecState, comm: Comm) -> Rounds:
        steps = 127 // comm.world_size
        if comm.world_size > MAX_RANKS:
            raise ValueError(
                f"int8 sums on the wire with {steps} steps per rank at {comm.world_size} ranks; it supports "
                f"at most {MAX_RANKS} ranks (use fp16, topk or powersgd)"
            )
        absmax = chunk_absmax(x, state, self.chunk)  # agreed over ranks, so everyone quantises alike
        yield comm.all_reduce(absmax, "max", async_op=True)
        values, scale, sent = quantize(x, absmax, state, self.chunk, steps)
        yield comm.all_reduce(values, "sum", async_op=True)  # |sum| <= world * steps <= 127: no wrap
        return Reduced(dequantize(values, scale, state, self.chunk, x.dtype), sent)

    # -- point to point: scales travel with the message --------------------------------------------
    def encode(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        values, scale, sent = quantize(x, chunk_absmax(x, state, self.chunk), state, self.chunk, 127)
        return concat_bytes(scale.to(wire_float(x.dtype)), values), sent  # scales first: aligned

    def wire_like(self, state: CodecState) -> torch.Tensor:
        chunks = chunks_for(state, self.chunk).count
        scale_bytes = chunks * wire_float(state.dtype).itemsize
        return torch.empty(scale_bytes + state.numel, dtype=torch.uint8, device="meta")

    def accumulate(self, total: torch.Tensor, wire: torch.Tensor, state: CodecState) -> None:
        chunks = chunks_for(state, self.chunk).count
        scale, values = split_bytes(wire, (chunks, wire_float(total.dtype)), (total.numel(), torch.int8))
        total.add_(dequantize(values, scale, state, self.chunk, total.dtype))
