"""``topk:RATIO`` and ``dgc:RATIO``: send only the largest-magnitude fraction of each bucket.

``topk`` keeps, of each tensor in the bucket, the ``ceil(RATIO * numel)`` elements of largest magnitude
(layer by layer, as DGC selects: one bucket-wide top-k would starve tensors whose gradients are
small) and accumulates the rest locally (error feedback: the residual is the bucket with the sent
elements zeroed, added to the next step's bucket), as in Aji and Heafield 2017 and Stich et al. 2018.
``dgc`` adds the three fixes of Deep Gradient Compression (Lin et al., ICLR 2018):

- momentum correction: the codec keeps a velocity ``u = m u + g`` (``comm.compress_momentum``) and
  accumulates and sends ``u`` rather than ``g``; where an element is sent its velocity is cleared too
  (momentum factor masking). It is built for plain SGD: the momentum lives in the codec, so pair it
  with ``--optimizer sgd --set optim.momentum=0`` (with Adam the sent values are velocities);
- local gradient clipping: with ``optim.clip_grad_norm = C`` each rank clips its bucket to
  ``C / sqrt(world)`` before accumulating (the paper's N^-1/2 rule, applied per bucket here);
- sparsity warm-up: over the first ``comm.compress_warmup_steps`` compressed reductions the density
  falls exponentially, 25%, 6.25%, 1.56%, 0.39% (four equal stages), never below ``RATIO``.
  (``topk`` takes the warm-up too when it is set.)

Communication: one all-gather of every rank's packed (values, indices) message: values in the bucket's
dtype, indices as int32 (int64 past 2^31 elements); each rank adds the messages in rank order
(``index_add_``), so all get bit-identical sums. Per rank that is ``(world - 1) k (4 + 4)`` bytes against
``2 (world - 1) / world * 4 numel`` for an fp32 ring all-reduce: ``world * RATIO`` of it, 0.02 for 1% at 2
ranks. The selection is ``torch.topk`` (exact), not DGC's sampled threshold.
"""

from __future__ import annotations

import math

import torch

from shardwise.collectives.api import Comm
from shardwise.compression.codec import CodecState, MessageCodec, concat_bytes, split_bytes

WARMUP_STAGES = 4  # DGC: 75%, 93.75%, 98.4375%, 99.6% sparsity, then the target


class TopKCodec(MessageCodec):
    exchange = "all_gather (index, value)"

    def __init__(
        self,
        spec: str,
        ratio: float,
        *,
        dgc: bool = False,
        momentum: float = 0.9,
        clip_norm: float = 0.0,
        warmup_steps: int = 0,
        start_step: int = 0,
    ) -> None:
        super().__init__(spec)
        if not 0 < ratio <= 1:
            raise ValueError(f"{spec}: the ratio must be in (0, 1], got {ratio}")
        self.name = "dgc" if dgc else "topk"
        self.ratio = ratio
        self.momentum = momentum if dgc else 0.0
        self.clip_norm = clip_norm if dgc else 0.0
        self.warmup_steps = warmup_steps
        self.start_step = start_step  # reductions sent uncompressed first: the warm-up starts after them
        self.fixed_size = warmup_steps == 0

    def density(self, state: CodecState) -> float:
        """The fraction sent at this reduction (DGC's exponential warm-up, then ``ratio``)."""
        t = state.reductions - self.start_step
        if 0 <= t < self.warmup_steps:
            stage = WARMUP_STAGES * t // self.warmup_steps
            return max(self.ratio, 0.25 ** (stage + 1))
        return self.ratio

    def count(self, numel: int, density: float) -> int:
        return min(numel, max(1, math.ceil(density * numel)))

    def prepare(self, grad: torch.Tensor, state: CodecState, comm: Comm) -> torch.Tensor:
        """DGC: clip this rank's bucket, then fold it into the velocity that is accumulated and sent."""
        if self.clip_norm > 0:  # decided on the gradient's device, in float64 (no read on the host)
            threshold = self.clip_norm / math.sqrt(comm.world_size)
            norm = grad.norm().double()
            grad = grad * torch.where(norm > threshold, threshold / (norm + 1e-6), 1.0)
        if self.momentum <= 0:
            return grad
        velocity = state.extra.get("velocity")
        if velocity is None:
            velocity = state.extra["velocity"] = grad.clone()
        else:
            velocity.mul_(self.momentum).add_(grad)
        return velocity

    def select(self, x: torch.Tensor, state: CodecState, density: float) -> torch.Tensor:
        """(k,) int64: each tensor's largest-magnitude ``density`` of its elements, tensor by tensor."""
        picked = []
        for seg in state.segments:
            if seg.numel:
                part = x[seg.offset : seg.offset + seg.numel].abs()
                top = torch.topk(part, self.count(seg.numel, density), sorted=False).indices
                picked.append(top + seg.offset)
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long, device=x.device)

    def encode(self, x: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.select(x, state, self.density(state))  # (k,) int64, distinct
        values = x[index]  # (k,)
        sent = torch.zeros_like(x)
        sent[index] = values
        velocity = state.extra.get("velocity")
        if velocity is not None:  # momentum factor masking: what is sent leaves the velocity too
            velocity[index] = 0
        return concat_bytes(values, index.to(self._index_dtype(x.numel()))), sent

    @staticmethod
    def _index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel < 2**31 else torch.int64

    def wire_like(self, state: CodecState) -> torch.Tensor:
        """The message size once the warm-up is over (a receiver preallocates it: no warm-up there)."""
        k = sum(self.count(seg.numel, self.ratio) for seg in state.segments if seg.numel)
        per = _itemsize(state.dtype) + _itemsize(self._index_dtype(state.numel))
        return torch.empty(k * per, dtype=torch.uint8, device="meta")

    def accumulate(self, total: torch.Tensor, wire: torch.Tensor, state: CodecState) -> None:
        index_dtype = self._index_dtype(total.numel())
        per = total.element_size() + _itemsize(index_dtype)
        k = wire.numel() // per
        values, index = split_bytes(wire, (k, total.dtype), (k, index_dtype))
        total.index_add_(0, index.long(), values)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
