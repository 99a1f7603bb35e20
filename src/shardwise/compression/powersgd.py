"""``powersgd:RANK``: low-rank compression by one step of power iteration (Vogels, Karimireddy and Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).

It does what PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` does at equal
settings (rank, ``min_compression_rate``, ``orthogonalization_epsilon``, random seed, warm start and error
feedback on, one tensor at a time): each tensor of the bucket is viewed as a matrix
``M = tensor.view(shape[0], -1)`` (n x m); it is compressed when ``(n + m) r * min_rate < n m`` with
``r = min(n, m, RANK)``, else (biases, small tensors, ZeRO padding) it is sent uncompressed. Per bucket:

1. ``P = M Q`` for every compressed matrix, with ``Q`` (m x r) from the last step (warm start) made
   orthonormal, or at the first compressed step drawn from N(0, 1) under a seed from one NumPy
   ``RandomState(seed)`` shared by every bucket (one draw per bucket, in the order buckets first
   compress, as torch does) and made orthonormal;
2. all-reduce (sum) the uncompressed elements and every ``P`` (two collectives in flight together);
3. make each summed ``P`` orthonormal (Gram-Schmidt for r <= 2, else QR, as torch), ``Q = M^T P``;
4. all-reduce (sum) every ``Q``; the sum over ranks is ``P Q^T``; ``Q / world`` is kept for step 1.

Error feedback as torch: the residual is this rank's bucket minus the decoded sum's equal share
(``sum / world``): the residuals of all ranks add up to exactly what the low-rank sum left out. Since
shardwise reduces sums where torch reduces means (each rank's gradient here is already its share of the
sum: ``x / world`` of torch's input at equal shares), every intermediate is torch's divided by ``world``
and the orthonormal ``P`` are the same, so the decoded sum equals torch's decoded mean.

Communication: three all-reduces per bucket (uncompressed part, P, Q); per compressed matrix
``(n + m) r`` elements instead of ``n m``. No point-to-point form: the workers must sum P among
themselves before Q can be computed, which a parameter server's workers do not do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from shardwise.collectives.api import Comm
from shardwise.compression.codec import AllOf, Codec, CodecState, Reduced, Rounds
from shardwise.device import HOST


@dataclass(frozen=True)
class _Matrix:
    offset: int
    rows: int
    cols: int
    rank: int


@dataclass(frozen=True)
class BucketPlan:
    """Which tensors of a bucket are compressed (in torch's order: grouped by shape) and which are not."""

    matrices: tuple[_Matrix, ...]
    plain: tuple[tuple[int, int], ...]  # [start, stop) ranges sent uncompressed (gaps included)
    p_numel: int
    q_numel: int


def should_compress(rows: int, cols: int, rank: int, min_rate: float) -> bool:
    """torch's ``_should_compress``: worth it when the low-rank form is ``min_rate`` times smaller."""
    return (rows + cols) * rank * min_rate < rows * cols


def make_plan(state: CodecState, rank: int, min_rate: float) -> BucketPlan:
    by_shape: dict[tuple[int, int], list[_Matrix]] = {}
    plain: list[tuple[int, int]] = []
    for seg in state.segments:
        if len(seg.shape) == 0:
            plain.append((seg.offset, seg.offset + 1))
            continue
        rows = seg.shape[0]
        cols = seg.numel // rows if rows else 0
        r = min(rows, cols, rank)
        if r > 0 and should_compress(rows, cols, r, min_rate):
            by_shape.setdefault((rows, cols), []).append(_Matrix(seg.offset, rows, cols, r))
        else:
            plain.append((seg.offset, seg.offset + seg.numel))
    plain.extend(state.gaps)
    matrices = tuple(m for group in by_shape.values() for m in group)
    return BucketPlan(
        matrices,
        tuple(sorted(plain)),
        sum(m.rows * m.rank for m in matrices),
        sum(m.cols * m.rank for m in matrices),
    )


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (1, rows, r) orthonormal in place, as torch's ``_orthogonalize``."""
    rank = matrix.shape[2]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        _gram_schmidt(matrix, epsilon)
    else:
        r = torch.empty(1, rank, rank, dtype=matrix.dtype, device=matrix.device)
        torch.linalg.qr(matrix, out=(matrix, r))


def _gram_schmidt(matrix: torch.Tensor, epsilon: float) -> None:
    for i in range(matrix.shape[2]):
        col = matrix[:, :, i : i + 1]
        # an all-zero column gives NaN with epsilon 0, as in torch (set comm.compress_epsilon)
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm + epsilon if epsilon else norm
        if i + 1 < matrix.shape[2]:
            rest = matrix[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGDCodec(Codec):
    name = "powersgd"
    exchange = "all_reduce x3 (uncompressed part, P, Q)"
    pushable = False

    def __init__(
        self, spec: str, rank: int, min_compression_rate: float = 2.0, epsilon: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__(spec)
        if rank < 1:
            raise ValueError(f"{spec}: the rank must be >= 1, got {rank}")
        self.rank, self.min_rate, self.epsilon = rank, min_compression_rate, epsilon
        # one stream of seeds for every bucket, drawn in the order buckets first compress (torch's rng)
        self.rng = np.random.RandomState(seed)

    def _views(
        self, plan: BucketPlan, x: torch.Tensor, p_mem: torch.Tensor, q_mem: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per compressed matrix: M (1, n, m) viewing ``x``; P (1, n, r), Q (1, m, r) viewing the memories."""
        p_at = q_at = 0
        for m in plan.matrices:
            matrix = x[m.offset : m.offset + m.rows * m.cols].view(1, m.rows, m.cols)
            p = p_mem[p_at : p_at + m.rows * m.rank].view(1, m.rows, m.rank)
            q = q_mem[q_at : q_at + m.cols * m.rank].view(1, m.cols, m.rank)
            p_at, q_at = p_at + m.rows * m.rank, q_at + m.cols * m.rank
            yield matrix, p, q

    def _start_q(self, plan: BucketPlan, state: CodecState, x: torch.Tensor) -> torch.Tensor:
        """Q for this step: last step's, made orthonormal; or, the first time, random and orthonormal."""
        q_mem = state.extra.get("q")
        if q_mem is not None:
            for _, _, q in self._views(plan, x, x.new_empty(plan.p_numel), q_mem):
                orthogonalize(q, self.epsilon)
            return q_mem
        q_mem = x.new_empty(plan.q_numel)
        generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        for _, _, q in self._views(plan, x, x.new_empty(plan.p_numel), q_mem):
            # drawn on the host (a CPU generator, as torch's hook): the same Q on any device
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=x.dtype, device=HOST))
            orthogonalize(q, self.epsilon)
        state.extra["q"] = q_mem
        return q_mem

    def rounds(self, x: torch.Tensor, state: CodecState, comm: Comm) -> Rounds:
        plan = state.extra.get("plan")
        if plan is None:
            plan = state.extra["plan"] = make_plan(state, self.rank, self.min_rate)
        q_mem = self._start_q(plan, state, x)
        p_mem = x.new_empty(plan.p_numel)  # (sum of n r,) every P, one all-reduce
        views = list(self._views(plan, x, p_mem, q_mem))
        for matrix, p, q in views:
            torch.bmm(matrix, q, out=p)
        # (plain elements,) the uncompressed part, one all-reduce
        plain = torch.cat([x[a:b] for a, b in plan.plain]) if plan.plain else x.new_empty(0)
        yield AllOf(*(comm.all_reduce(t, "sum", async_op=True) for t in (plain, p_mem) if t.numel()))
        for matrix, p, q in views:
            orthogonalize(p, self.epsilon)
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        if q_mem.numel():
            yield comm.all_reduce(q_mem, "sum", async_op=True)
        total = torch.empty_like(x)
        at = 0
        for a, b in plan.plain:
            total[a:b] = plain[at : at + b - a]
            at += b - a
        for (_, p, q), m in zip(views, plan.matrices, strict=True):
            out = total[m.offset : m.offset + m.rows * m.cols].view(1, m.rows, m.cols)
            torch.bmm(p, q.transpose(1, 2), out=out)
        q_mem.div_(comm.world_size)  # torch keeps the mean Q for the warm start
        return Reduced(total, total / comm.world_size)
