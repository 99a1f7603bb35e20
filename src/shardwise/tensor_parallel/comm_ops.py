"""Autograd-aware communication over the tensor-parallel axis, every byte through ``Comm``.

Megatron-LM's two conjugate operators (Shoeybi et al., 2019, "Megatron-LM", section 3):

- ``copy_to_tp`` (their *f*): identity forward, all-reduce (sum) backward. It sits where a replicated
  activation enters a column-parallel layer: each rank's input gradient is a partial sum over its
  output columns, and the all-reduce completes it.
- ``reduce_from_tp`` (their *g*): all-reduce forward, identity backward. It sits after a row-parallel
  layer, whose ranks each hold a partial sum of the output.

Sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2) replaces each all-reduce by a reduce-scatter plus an all-gather along the
sequence dim, so the norm and dropout regions hold ``seq / tp`` positions per rank:

- ``gather_from_sequence``: all-gather along the sequence forward, reduce-scatter backward (replaces f);
- ``reduce_scatter_to_sequence``: reduce-scatter forward, all-gather backward (replaces g);
- ``split_to_sequence``: this rank's slice forward, all-gather backward, for a replicated tensor entering
  the sequence-split region (the position embedding's output).

Per transformer block that is 2 all-reduces of ``batch * seq * hidden`` forward and 2 backward without
sequence parallelism, and 2 all-gathers plus 2 reduce-scatters of the same total each way with it.
``Comm`` gathers and scatters along dim 0; these functions move the sequence dim there and back (a copy
on the way, which the bytes counted do not include). With one rank every op is the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.collectives.api import Comm
from shardwise.config import ConfigError


def _all_reduce(x: torch.Tensor, comm: Comm, label: str) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce into a tensor autograd saved for someone else
    comm.all_reduce(out, label=label)
    return out


def sequence_length_share(length: int, comm: Comm) -> int:
    """``length / tp``, refused with the arithmetic when tp does not divide it: the batch's own width,
    seen where it is cut (every tp rank holds the same batch, so all refuse alike, before any transfer)."""
    if length % comm.world_size:
        raise ConfigError(
            f"sequence parallelism cuts the sequence over tp: a batch of sequence length {length} is not "
            f"divisible by tp {comm.world_size}; pad the batches to a multiple of {comm.world_size} "
            "positions, or set parallel.sequence_parallel = false"
        )
    return length // comm.world_size


def _all_gather(x: torch.Tensor, comm: Comm, dim: int, label: str) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()  # (share, ...) with the gathered dim first
    out = front.new_empty((front.size(0) * comm.world_size, *front.shape[1:]))
    comm.all_gather(out, front, label=label)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, comm: Comm, dim: int, label: str) -> torch.Tensor:
    share = sequence_length_share(x.size(dim), comm)
    front = x.movedim(dim, 0).contiguous()  # (length, ...)
    out = front.new_empty((share, *front.shape[1:]))
    comm.reduce_scatter(out, front, label=label)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    share = sequence_length_share(x.size(dim), comm)
    return x.narrow(dim, comm.rank * share, share).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm, "tp f backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return _all_reduce(x, comm, "tp g forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, "sp all-gather forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.comm, ctx.dim, "sp reduce-scatter backward"), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim, "sp reduce-scatter forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.comm, ctx.dim, "sp all-gather backward"), None, None


class _SplitToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _split(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.comm, ctx.dim, "sp all-gather backward"), None, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    if comm.world_size == 1:
        return x
    out: torch.Tensor = _CopyToTP.apply(x, comm)
    return out


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    if comm.world_size == 1:
        return x
    out: torch.Tensor = _ReduceFromTP.apply(x, comm)
    return out


def gather_from_sequence(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """All-gather along ``dim`` (the sequence) forward, reduce-scatter of the gradient backward."""
    if comm.world_size == 1:
        return x
    out: torch.Tensor = _GatherFromSequence.apply(x, comm, dim)
    return out


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along ``dim`` (the sequence) forward, all-gather of the gradient backward."""
    if comm.world_size == 1:
        return x
    out: torch.Tensor = _ReduceScatterToSequence.apply(x, comm, dim)
    return out


def split_to_sequence(x: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """This rank's ``1/tp`` slice along ``dim`` forward, all-gather of the gradient backward.

    For a tensor every rank holds whole (replicated) entering the sequence-split region: the gradient
    that comes back is whole on every rank, so the parameters behind it need no further reduction.
    """
    if comm.world_size == 1:
        return x
    out: torch.Tensor = _SplitToSequence.apply(x, comm, dim)
    return out
