"""Synchronous BatchNorm over the data-parallel ranks, through ``Comm`` (torch's refuses CPU tensors).

Under data parallelism a plain BatchNorm normalises each rank's share of the batch with that share's
own statistics, so N ranks differ from one process on the whole batch. Here every rank normalises with
the statistics of the global batch (Ioffe & Szegedy 2015; the synchronous form of Peng et al., MegDet,
2018). Communication per BatchNorm layer and step, over the ``dp`` axis:

- forward: one all-reduce (sum) of ``[count, sum over rows of x, sum of x^2]`` per channel, so
  mean = S / N and the biased variance Q / N - mean^2 are the global batch's, whatever each rank's
  share (an empty share sends zeros and still takes part);
- backward: one all-reduce (sum) of ``[sum dy, sum dy * x_hat]`` per channel, giving
  dx = w / sqrt(var + eps) * (dy - sum_dy / N - x_hat * sum_dy_xhat / N).

The weight and bias gradients stay local (``sum dy * x_hat``, ``sum dy``): data parallelism sums them
over ranks like any other gradient. Running statistics are updated from the global mean and the
unbiased global variance, identically on every rank. In eval mode it is a plain BatchNorm.

With gradient accumulation (micro-batches) the statistics are those of each pass, over all ranks: like
one process that accumulates, BatchNorm then no longer sees the whole batch at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from shardwise.collectives.api import Comm


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C) or (N, C, *) -> (rows, C): every element of a channel becomes one row."""
    return x.movedim(1, -1).reshape(-1, x.size(1))


class _SyncNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        comm: Comm,
        stats_out: list[torch.Tensor],
    ) -> torch.Tensor:
        rows = _channels_last(x)  # (rows, C)
        count = torch.full((1,), float(rows.size(0)), dtype=torch.float64, device=rows.device)
        sums = torch.cat([count, rows.sum(0).double(), rows.pow(2).sum(0).double()])
        comm.all_reduce(sums)  # [N, S (C), Q (C)] over the data-parallel ranks
        channels = x.size(1)
        total = sums[0].clamp(min=1.0)
        mean = sums[1 : 1 + channels] / total
        var = (sums[1 + channels :] / total - mean.pow(2)).clamp(min=0.0)
        invstd = (var + eps).rsqrt()
        shape = [1, channels] + [1] * (x.dim() - 2)
        x_hat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        ctx.save_for_backward(x_hat, weight, invstd.to(x.dtype), sums[:1])
        ctx.comm = comm  # type: ignore[attr-defined]
        stats_out.extend([mean, var, sums[0]])
        return x_hat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x_hat, weight, invstd, count = ctx.saved_tensors
        dy_rows, xhat_rows = _channels_last(dy), _channels_last(x_hat)
        grad_bias = dy_rows.sum(0)
        grad_weight = (dy_rows * xhat_rows).sum(0)
        sums = torch.cat([grad_bias, grad_weight]).double()
        ctx.comm.all_reduce(sums)  # global sum dy, sum dy * x_hat
        channels = dy.size(1)
        total = count.clamp(min=1.0)
        shape = [1, channels] + [1] * (dy.dim() - 2)
        mean_dy = (sums[:channels] / total).to(dy.dtype).view(shape)
        mean_dy_xhat = (sums[channels:] / total).to(dy.dtype).view(shape)
        dx = (weight * invstd).view(shape) * (dy - mean_dy - x_hat * mean_dy_xhat)
        return dx, grad_weight, grad_bias, None, None, None


class SyncBatchNorm(nn.Module):
    """A BatchNorm (1d, 2d, 3d alike) whose training statistics are those of the global batch."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm, comm: Comm) -> None:
        super().__init__()
        if not norm.affine or not norm.track_running_stats:
            raise ValueError("sync batchnorm supports affine BatchNorm with running statistics only")
        self.comm, self.eps, self.momentum = comm, norm.eps, norm.momentum
        self.weight, self.bias = norm.weight, norm.bias
        self.register_buffer("running_mean", norm.running_mean)
        self.register_buffer("running_var", norm.running_var)
        self.register_buffer("num_batches_tracked", norm.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        stats: list[torch.Tensor] = []
        y = _SyncNorm.apply(x, self.weight, self.bias, self.eps, self.comm, stats)
        self._update_running(*stats)
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        self.num_batches_tracked += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * count / (count - 1) if count > 1 else var
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)


def convert_sync_batchnorm(model: nn.Module, comm: Comm) -> int:
    """Replace every BatchNorm in ``model`` (in place) by a ``SyncBatchNorm`` over ``comm``, keeping its
    parameters, buffers and names; returns how many were replaced."""
    replaced = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, SyncBatchNorm(child, comm))
            replaced += 1
        else:
            replaced += convert_sync_batchnorm(child, comm)
    return replaced


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
