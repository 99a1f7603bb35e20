"""The parameter server's message layout, shared by its synchronous and asynchronous paths.

Messages are flat tensors in the parameters' dtype. A push is ``[grad shard..., used..., loss, version,
kind]``: used holds one flag per parameter of the shard, 1 when this worker's backward reached it, so a
parameter no worker used keeps ``grad = None`` on the server and the optimizer skips it, as in one
process; kind 0 = gradient, 1 = done, 2 = paused for a checkpoint (the steps done in the version slot).
A reply is ``[weights..., grad_norm, nonfinite, bad parameter, version, staleness, accepted,
loss_total]``, where ``grad_norm`` is the global gradient norm before clipping (sync), ``nonfinite`` is
0 (finite), 1 (skipped) or 2 (the run stops) and ``bad parameter`` the index, in the model's trainable
order, of the first parameter whose gradient was not finite (-1: none).
With ``comm.compress`` these dense layouts are what both ends see; what travels is a codec message
of the tensor part with the rest beside it (``ps_codec``). No communication here: only packing and
unpacking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.device import HOST

PUSH_EXTRA = 3  # loss, version, kind
REPLY_EXTRA = 7  # grad_norm, nonfinite, bad parameter, version, staleness, accepted, loss_total
KIND_GRAD, KIND_DONE, KIND_PAUSE = 0.0, 1.0, 2.0
FINITE, SKIPPED, STOPPED = 0, 1, 2  # a reply's nonfinite slot
MAX_ATTEMPTS = 3  # async: pushes of one batch before a worker gives it up (see ps_async)


def flatten(tensors: Sequence[torch.Tensor], extra: int) -> torch.Tensor:
    """One flat host buffer holding ``tensors`` followed by ``extra`` header slots (left zero)."""
    parts = [t.detach().reshape(-1) for t in tensors]
    dtype = tensors[0].dtype if tensors else torch.float64
    device = tensors[0].device if tensors else HOST
    return torch.cat([*parts, torch.zeros(extra, dtype=dtype, device=device)]).to(HOST)


def push_numel(params: Sequence[torch.Tensor]) -> int:
    """Elements of a push to the server holding ``params``: gradients, one flag each, the header."""
    return sum(p.numel() for p in params) + len(params) + PUSH_EXTRA


def pack_push(params: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A push of ``params``' gradients (zeros where None) and their used flags; the header left zero.
    Packed where the gradients are and copied to the host once (the message travels over gloo)."""
    device = params[0].device if params else HOST
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    used = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)
    parts = [g.detach().reshape(-1).to(dtype) for g in grads]
    return torch.cat([*parts, used, torch.zeros(PUSH_EXTRA, dtype=dtype, device=device)]).to(HOST)


def used_flags(message: torch.Tensor, params: Sequence[torch.Tensor]) -> list[bool]:
    """Which of ``params`` a push (or a sum of pushes) says got a gradient."""
    start = sum(p.numel() for p in params)
    return [bool(v != 0) for v in message[start : start + len(params)].tolist()]


def unflatten_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy the leading part of ``flat`` into ``targets`` in order (moved to their device once)."""
    if targets and flat.device != targets[0].device:
        flat = flat[: sum(t.numel() for t in targets)].to(targets[0].device)
    offset = 0
    for t in targets:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
