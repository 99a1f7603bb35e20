"""``int8[:CHUNK]``: 8-bit integers with one scale per chunk of ``CHUNK`` elements (default 512).

Communication, between ranks (two all-reduces): the ranks first agree on each chunk's scale (an
all-reduce, max, of each chunk's largest magnitude: 4 bytes per chunk), then quantise with the agreed
scale and sum the int8 values on the wire (one all-reduce of one byte per element, a quarter of fp32's
bytes). Integer sums wrap around, so each rank keeps headroom: values are rounded to at most
``127 // world_size`` steps each side, so the sum of every rank's values still fits in an int8 (2 ranks:
63 steps, 4 ranks: 31, 16 ranks: 7; more than 16 ranks are refused). What rounding leaves out is kept as
the error-feedback residual (Karimireddy et al. 2019).

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
    chunk_view,
    concat_bytes,
    n_chunks,
    split_bytes,
    wire_float,
)

MAX_RANKS = 16  # 127 // 16 = 7 steps each side: below that the rounding error dominates


def quantize(x: torch.Tensor, absmax: torch.Tensor, chunk: int, steps: int) -> tuple[torch.Tensor, ...]:
    """``x`` (numel,) rounded to ``steps`` levels each side of zero per chunk of ``chunk`` elements,
    given each chunk's ``absmax`` (chunks,). Returns the int8 values (numel,), the scales (chunks,) and
    the dequantised values (numel,)."""
    scale = absmax.to(x.dtype) / steps
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk: q = 0 anyway
    q = torch.round(chunk_view(x, chunk) / scale[:, None]).clamp_(-steps, steps)  # (chunks, chunk)
    values = q.to(torch.int8).reshape(-1)[: x.numel()]
    dequantised = (q * scale[:, None]).reshape(-1)[: x.numel()]
    return values, scale, dequantised


def dequantize(values: torch.Tensor, scale: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``values`` (numel,) times their chunk's ``scale`` (chunks,), as (numel,) ``dtype``."""
    return (chunk_view(values.to(dtype), chunk) * scale.to(dtype)[:, None]).reshape(-1)[: values.numel()]


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
        # (chunks,) each chunk's largest magnitude, agreed over ranks so everyone quantises alike
        absmax = chunk_view(x, self.chunk).abs().amax(dim=1).to(wire_float(x.dtype))
        yield comm.all_reduce(absmax, "max", async_op=True)
        values, scale, sent = quantize(x, absmax, self.chunk, steps)
        yield comm.all_reduce(values, "sum", async_op=True)  # |sum| <= world * steps <= 127: no wrap
        return Reduced(dequantize(values, scale, self.chunk, x.dtype), sent)

    # -- point to point: scales travel with the message --------------------------------------------
    def encode(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        absmax = chunk_view(x, self.chunk).abs().amax(dim=1).to(wire_float(x.dtype))
        values, scale, sent = quantize(x, absmax, self.chunk, 127)
        return concat_bytes(scale.to(wire_float(x.dtype)), values), sent  # scales first: aligned

    def wire_like(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        scale_bytes = n_chunks(numel, self.chunk) * torch.empty(0, dtype=wire_float(dtype)).element_size()
        return torch.empty(scale_bytes + numel, dtype=torch.uint8)

    def accumulate(self, total: torch.Tensor, wire: torch.Tensor) -> None:
        numel = total.numel()
        scale, values = split_bytes(
            wire, (n_chunks(numel, self.chunk), wire_float(total.dtype)), (numel, torch.int8)
        )
        total.add_(dequantize(values, scale, self.chunk, total.dtype))
