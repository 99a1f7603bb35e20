"""Non-finite losses and gradients: the ranks that step agree, in the same step, to go on, skip or stop.

Communication: one all-reduce (min) of two integers over the ranks that step, between the gradient
exchange and the update, and only for engines whose optimizer runs on those ranks. The flags are read
on the host first (each engine stacks its per-tensor checks on the device and reads them once), so the
all-reduce is host bookkeeping, over gloo. (The per-step
metrics all-gather cannot carry it: it runs after the update so that it times the whole step, and the
verdict is needed before.) Each rank contributes whether its loss share is finite and the index of
the first parameter whose gradient, as it holds it, is not (``Engine.nonfinite_grad``); the minimum
over ranks is the same verdict everywhere. A parameter server's servers check the summed gradient
themselves and send their verdict with the weights (``Engine.servers_nonfinite``): no message more.
Under fp16 dynamic loss scaling the scaler owns overflows (it skips the step and lowers the scale),
until its scale reaches its floor.
"""

from __future__ import annotations

import math

import torch

from shardwise.collectives.api import Comm
from shardwise.device import HOST
from shardwise.engine.base import Engine, NonFinite, describe_nonfinite, trainable

_NONE_FOUND = 2**62  # no parameter index reaches it


def agree_nonfinite(comm: Comm, engine: Engine, loss_share: float, policy: str) -> NonFinite | None:
    """After ``finish_grads``: what any rank found not finite this step (the same on every rank), or None."""
    names = [name for name, _ in trainable(engine.model)]
    scaled = engine.scaler_owns_overflow()
    bad = None if scaled else engine.nonfinite_grad()
    loss_ok = scaled or math.isfinite(loss_share)
    # ranks may hold different parameters (pipeline stages): "none found" is one sentinel for all
    first = names.index(bad) if bad else _NONE_FOUND
    flags = torch.tensor([int(loss_ok), first], dtype=torch.int64, device=HOST)
    comm.all_reduce(flags, "min")
    loss_ok, first = bool(flags[0]), int(flags[1])
    if loss_ok and first == _NONE_FOUND:
        return None
    grad_name = None if first == _NONE_FOUND else names[first] if first < len(names) else bad or "a parameter"
    return NonFinite(describe_nonfinite(loss_ok, grad_name), stop=policy == "stop")

