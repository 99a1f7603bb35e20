"""Legacy single-process data parallelism (the ``torch.nn.DataParallel`` pattern), kept for comparison.

One process drives every device. Each step it replicates the master module onto the other devices
(replica 0 is the master itself), scatters the batch along dim 0, runs the replicas, gathers their
outputs onto the first device, computes the loss there, and after backward reduces the replicas'
gradients into the master, whose optimizer steps; the next step replicates again. On a CPU the
"devices" are replicas in the same process, so the pattern, its copies and its bytes are real while the
parallel speed-up is not. This is the design that multi-process DDP replaced (one Python thread, a
replicate every step, everything funnelled through device 0); shardwise keeps it only to make that
comparison concrete (``shardwise bench dp-compare``), not for training.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.engine.base import Batch, Engine
from shardwise.engine.loss import logits_of, loss_sum
from shardwise.engine.update import NamedTensors, grad_sq_sum, trainable


class SingleProcessDPEngine(Engine):
    """``replicas`` copies of ``model`` in one process; ``devices`` (default: the model's) hosts them."""

    name = "single_process"

    def __init__(
        self,
        model: nn.Module,
        replicas: int,
        devices: Sequence[torch.device] | None = None,
    ) -> None:
        super().__init__(model)
        if replicas < 1:
            raise ValueError(f"single-process data parallelism needs at least one replica, got {replicas}")
        home = next(model.parameters()).device
        self.devices = list(devices) if devices is not None else [home] * replicas
        if len(self.devices) != replicas:
            raise ValueError(f"{replicas} replicas but {len(self.devices)} devices were given")
        self.replicas = replicas
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.bytes_copied = 0  # device-to-device bytes this step: replicate, scatter, gather, reduce
        self.copies = 0  # copy operations this step
        self._copies: list[nn.Module] = []

    def begin_step(self, micro_batches: Sequence[Any], global_count: float) -> float:
        self._replicate()
        return global_count

    def compute_loss(self, batch: Batch, forward: Callable[[], Any] | None = None) -> torch.Tensor:
        """(inputs, targets) batches only, scattered over the replicas; no pipeline stage runs here."""
        if forward is not None:
            raise ValueError("single-process DP runs the whole model on its replicas, not a pipeline stage")
        inputs, targets = batch
        chunks = [c for c in inputs.chunk(self.replicas, dim=0) if c.numel()]  # scatter
        outputs = [
            module(self._move(chunk, self.devices[i]))
            for i, (module, chunk) in enumerate(zip([self.model, *self._copies], chunks, strict=False))
        ]
        logits = torch.cat([self._move(logits_of(out), self.devices[0]) for out in outputs])  # gather
        return loss_sum(logits, targets.to(self.devices[0]))

    def _replicate(self) -> None:
        """Fresh copies of the master on devices 1..n-1 (DataParallel replicates on every forward)."""
        self.bytes_copied, self.copies = 0, 0
        self._copies = []
        for device in self.devices[1:]:
            replica = copy.deepcopy(self.model).to(device)
            replica.zero_grad(set_to_none=True)
            self._copies.append(replica)
            self.bytes_copied += self.param_bytes
            self.copies += 1

    def _move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device-to-device transfer (a copy even between CPU 'devices', as between GPUs)."""
        self.bytes_copied += tensor.numel() * tensor.element_size()
        self.copies += 1
        return tensor.to(device, copy=True)

    def exchange_grads(self) -> None:
        """Reduce every replica's gradients into the master (device 0), in replica order."""
        for replica in self._copies:
            for master, local in zip(self.model.parameters(), replica.parameters(), strict=True):
                if local.grad is None:
                    continue
                grad = self._move(local.grad, master.device)
                master.grad = grad if master.grad is None else master.grad.add_(grad)

    def optimizer_units(self) -> list[NamedTensors]:
        return [trainable(self.model)]  # the master's optimizer

    def held_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        return grad_sq_sum([p for _, p in trainable(self.model)], self.device), None

    def after_update(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self._copies = []

    def held_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def held_gradients(self) -> dict[str, torch.Tensor]:
        return {
            n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }
