"""An engine's whole-tensor views and its checkpoint state: what every strategy answers for the part
it holds, widened over every axis.

``Engine`` (``engine/base.py``) inherits this. A strategy answers for what its rank holds over its
data-parallel group (``held_parameters``, ``held_gradients``, ``held_pieces``, ``load_held``); the
public answers (``full_parameters``, ``full_gradients``, ``state_pieces``, ``load_state``) are final:
the strategy's, then one loop over ``axes`` (``engine/axis.py``). Communication: whatever the
strategy's answers and the axes' widening do (gathers over their groups); none here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol, final

import torch

from shardwise.checkpoint.boxes import Box
from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.engine.axis import Axis

# what a rank asks a checkpoint for: a flat range [start, stop) of a global tensor, an n-d Box of it,
# or None for the whole tensor
Span = tuple[int, int] | Box | None


class StateReader(Protocol):
    """What an engine reads its state through when a checkpoint is loaded (see ``Engine.load_state``).

    ``shapes`` lists every saved tensor with its global shape; calling the reader with
    ``{name: span}`` returns, per name, the whole tensor at its global shape (span None), a flat range
    as a 1-D tensor, or a ``Box`` at the box's shape, whichever layout wrote it. It raises
    ``CheckpointError`` when a file is damaged; the caller then falls back to an older checkpoint and
    calls ``load_state`` again.
    """

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]: ...


class EngineState(ABC):
    """The views and checkpoint state of an ``Engine`` (see the module docstring)."""

    name: str
    comm: Comm | None
    axes: list[Axis]

    # -- inspection (verify, checkpoints, digests) --------------------------------------------------
    @final
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at its global shape, by name, on every rank (a copy): the strategy's
        (``held_parameters``), widened over every axis (``Axis.assemble``)."""
        return self._assembled(self.held_parameters())

    @final
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's global gradient, by name, between ``finish_grads`` and the step."""
        return self._assembled(self.held_gradients())

    def _assembled(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for axis in self.axes:
            tensors = axis.assemble(tensors)
        return tensors

    @abstractmethod
    def held_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank's model holds, as the strategy makes it whole (gathered over its
        data-parallel group), by name (a copy)."""

    @abstractmethod
    def held_gradients(self) -> dict[str, torch.Tensor]:
        """The gradient of every trainable parameter this rank's model holds, as ``held_parameters``."""

    # -- checkpoints -------------------------------------------------------------------------------
    @final
    def state_pieces(self, rank: int, world_size: int) -> list[Piece]:
        """What this rank writes into a checkpoint, as rank ``rank`` of ``world_size`` writers: the
        strategy's pieces (``held_pieces``), made pieces of the global tensors by every axis
        (``Axis.pieces``), then each axis's own state (``Axis.own_pieces``). Under further axes, the
        ranks that write what this rank holds are its data-parallel group (the others hold other
        stages or shards): the strategy is asked at its place there."""
        if self.axes and self.comm is not None:
            rank, world_size = self.comm.rank, self.comm.world_size
        pieces = self.held_pieces(rank, world_size)
        for axis in self.axes:
            pieces = axis.pieces(pieces)
        for axis in self.axes:
            pieces += axis.own_pieces()
        return pieces

    @final
    def load_state(self, read: StateReader) -> None:
        """Replace parameters, buffers and optimizer state with a checkpoint's, read through ``read``:
        each axis's own state read first, then the strategy's (``load_held``) through every axis's
        reader (``Axis.reader``), then the axes' state put in place."""
        reader = read
        for axis in self.axes:
            reader = axis.reader(reader)
        put = [axis.read_own(read) for axis in self.axes]
        self.load_held(reader)
        for done in put:
            done()

    def held_pieces(self, rank: int, world_size: int) -> list[Piece]:
        """What this rank writes of what it holds, as rank ``rank`` of the ``world_size`` ranks that
        hold the same (``state_pieces``): flat ranges of global tensors (``Piece``).

        Names and global shapes are the same for every strategy, so any layout loads any other:

        - ``model/<name>``: each parameter by its ``model.named_parameters()`` name at its global
          shape (tied weights once), and each floating-point or integer buffer by its
          ``named_buffers()`` name.
        - ``optim/<key>/<name>``: each per-parameter optimizer tensor (``exp_avg``, ``exp_avg_sq``,
          ``momentum_buffer``, ...) at the parameter's global shape, in the optimizer's dtype.
        - ``optim/step/<name>``: the parameter's step count, a scalar (shape ``()``).
        - State only one strategy has goes under its own prefix, and other layouts ignore it:
          ``ps/version`` (each server's version), ``precision/loss_scale`` (fp16's loss scaler).
        - ``codec/<layout>/rank<r>/...``: with ``comm.compress``, each rank's own error-feedback state
          (``engine.codec_state``), loaded back only by a run of the same layout.
        - ``rng/<state>/rank<r>``: with tensor parallelism, each rank's private dropout stream
          (``tensor_parallel.axis``), beside the ``rng/torch/rank<r>`` the checkpoint writer adds for
          every rank.

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

    def load_held(self, read: StateReader) -> None:
        """Replace what this rank holds (parameters, buffers, optimizer state) with a checkpoint's.

        The engine asks for exactly the ranges it holds (DDP: whole tensors; ZeRO: its flat shard's
        overlap with each parameter, as ``(a, b)`` spans; a parameter server: its shards), so a
        checkpoint written by any strategy and world size loads. Read everything first and only then
        change the engine, so that a damaged file (``read`` raises) leaves it as it was. Optimizer
        state absent from the checkpoint is cleared (as for a never-stepped parameter).
        """
        raise NotImplementedError(f"the {self.name} engine cannot load checkpoints yet")
