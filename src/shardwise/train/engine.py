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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.checkpoint.manager import Piece

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (batch, seq) long, targets (batch, seq) long
Span = tuple[int, int] | None  # a flat range [start, stop) of a global tensor; None: the whole tensor


class StateReader(Protocol):
    """What an engine reads its state through when a checkpoint is loaded (see ``Engine.load_state``).

    ``shapes`` lists every saved tensor with its global shape; calling the reader with
    ``{name: span}`` returns, per name, the whole tensor at its global shape (span None) or the flat
    range as a 1-D tensor, whichever layout wrote it. It raises ``CheckpointError`` when a file is
    damaged; the caller then falls back to an older checkpoint and calls ``load_state`` again.
    """

    shapes: Mapping[str, tuple[int, ...]]

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]: ...


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

    # -- checkpoints -------------------------------------------------------------------------------
    def state_pieces(self, rank: int, world_size: int) -> list[Piece]:
        """What this rank writes into a checkpoint: flat ranges of global tensors (``Piece``).

        Names and global shapes are the same for every strategy, so any layout loads any other:

        - ``model/<name>``: each parameter by its ``model.named_parameters()`` name at its global
          shape (tied weights once), and each floating-point or integer buffer by its
          ``named_buffers()`` name.
        - ``optim/<key>/<name>``: each per-parameter optimizer tensor (``exp_avg``, ``exp_avg_sq``,
          ``momentum_buffer``, ...) at the parameter's global shape, in the optimizer's dtype.
        - ``optim/step/<name>``: the parameter's step count, a scalar (shape ``()``).

        Every element of every tensor must be written by exactly one rank. Replicated engines (DDP)
        spread whole tensors over ranks (``checkpoint.spread_replicated``), so no rank writes it all.
        A sharded engine writes what it owns, as flat ranges of the global tensors: ZeRO, whose shard
        is a range of the concatenation of flattened parameters, emits for each parameter overlapping
        its shard the piece ``Piece("model/<name>", shape, a, b, shard_view)`` where ``[a, b)`` is the
        overlap in the parameter's own flat numbering (padding is never written), and the same ranges
        for each optimizer state; the scalar ``optim/step/<name>`` goes to the one rank holding the
        parameter's first element. A parameter server writes the ranges its shards hold; workers
        write nothing of the model. Optimizer state a parameter has not got yet (never stepped) is
        simply absent.
        """
        raise NotImplementedError(f"the {self.name} engine cannot save checkpoints yet")

    def load_state(self, read: StateReader) -> None:
        """Replace parameters, buffers and optimizer state with a checkpoint's, read through ``read``.

        The engine asks for exactly the ranges it holds (DDP: whole tensors; ZeRO: its flat shard's
        overlap with each parameter, as ``(a, b)`` spans; a parameter server: its shards), so a
        checkpoint written by any strategy and world size loads. Read everything first and only then
        change the engine, so that a damaged file (``read`` raises) leaves it as it was. Optimizer
        state absent from the checkpoint is cleared (as for a never-stepped parameter).
        """
        raise NotImplementedError(f"the {self.name} engine cannot load checkpoints yet")

    def close(self) -> None:
        """Release hooks, threads and files (nothing to release by default)."""
        return None
