"""The strategy interface: one training step's forward, backward, communication and update.

Every strategy (all-reduce DP, ZeRO, the parameter server, ...) is an ``Engine``. The train loop,
``shardwise verify`` and the benchmarks drive engines only through this interface, so a new strategy
plugs into all of them at once.

Loss convention (exact averaging over uneven shares): each rank's loss is the *sum* of its token
losses divided by the number of tokens in the *global* batch, and gradients are *summed* over ranks.
The sum over ranks then equals the mean loss of one process on the whole global batch, whatever
share of it each rank drew.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (batch, seq) long, targets (batch, seq) long


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (batch, L, vocab) against the last L target positions."""
    predicted = logits.size(1)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets[:, -predicted:].reshape(-1), reduction="sum"
    )


def predicted_tokens(model_kind: str, batch: int, seq_len: int) -> int:
    """Tokens that carry a loss in a batch: every position for GPT, the last one for the MLP."""
    return batch * (seq_len if model_kind == "gpt" else 1)


class Engine(ABC):
    """A model with a strategy applied. Subclasses own the communication and the optimizer."""

    name: str = "engine"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # -- the step ---------------------------------------------------------------------------------
    def forward_backward(self, micro_batches: Sequence[Batch], global_tokens: int) -> float:
        """Run forward and backward on this rank's micro-batches; on return, gradients are global.

        Returns this rank's share of the global mean loss (the shares sum to the global mean).
        """
        share = 0.0
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.no_sync() if i < last else nullcontext():
                loss = self.compute_loss(inputs, targets) / global_tokens
                loss.backward()
            share += float(loss.detach())
        self.finish_grads()
        return share

    def compute_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss of one micro-batch; strategies with mixed precision override this."""
        return loss_sum(self.model(inputs), targets)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without communicating (default: nothing to skip)."""
        yield

    @abstractmethod
    def finish_grads(self) -> None:
        """After the last backward of a step: complete gradient communication."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Apply the update and clear gradients for the next step."""

    # -- inspection (verify, checkpoints, digests) ----------------------------------------------------
    @abstractmethod
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at its global shape, by name, on every rank (a copy)."""

    @abstractmethod
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's global gradient, by name, between ``finish_grads`` and the step."""

    def metrics(self) -> dict[str, float]:
        """Strategy-specific figures for this rank's metrics (staleness, versions, ...)."""
        return {}

    def close(self) -> None:
        """Release hooks, threads and files (nothing to release by default)."""
        return None
