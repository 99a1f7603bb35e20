"""The identity codec (``none``) and the half-precision casts (``fp16``, ``bf16``).

Communication: one all-reduce (sum) of the message. The identity codec's message is the bucket itself,
in its own dtype, so ``none`` gives exactly what an uncompressed all-reduce gives (bit for bit): it exists
to prove that the codec path changes nothing by itself. The casts send every element in 16 bits (half
the bytes of fp32) and sum on the wire in that dtype; what the cast rounds away is kept as the
error-feedback residual and sent in a later step (the usual fix for biased compressors; Karimireddy
et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019).
"""

from __future__ import annotations

import torch

from shardwise.compression.codec import CodecState, MessageCodec


class IdentityCodec(MessageCodec):
    """``none``: the bucket as it is, through the same encode / exchange / decode path as the others."""

    name = "none"
    exchange = "all_reduce"
    lossless = True

    def encode(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), x  # the all-reduce sums the wire in place; x stays this rank's own

    def wire_like(self, state: CodecState) -> torch.Tensor:
        return torch.empty(state.numel, dtype=state.dtype, device="meta")

    def accumulate(self, total: torch.Tensor, wire: torch.Tensor, state: CodecState) -> None:
        total.add_(wire)  # total starts at zero: 0 + w == w exactly


class CastCodec(MessageCodec):
    """``fp16`` / ``bf16``: every element cast to 16 bits, summed in that dtype on the wire."""

    exchange = "all_reduce"

    def __init__(self, spec: str, dtype: torch.dtype) -> None:
        super().__init__(spec)
        self.wire_dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def encode(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        wire = x.to(self.wire_dtype)  # (numel,) 16-bit
        return wire, wire.to(x.dtype)

    def wire_like(self, state: CodecState) -> torch.Tensor:
        return torch.empty(state.numel, dtype=self.wire_dtype, device="meta")

    def accumulate(self, total: torch.Tensor, wire: torch.Tensor, state: CodecState) -> None:
        total.add_(wire.view(self.wire_dtype).to(total.dtype))
