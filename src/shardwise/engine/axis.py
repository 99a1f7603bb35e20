"""One more mesh axis, as the engine sees it: what the axis adds to a data-parallel engine's answers.

A data-parallel engine (DDP, ZeRO) answers for what its rank holds, over its data-parallel group. Each
further axis the model is cut over is one ``Axis`` in ``engine.axes``: hybrid sharding's replicas
(``zero.hybrid``), tensor parallelism (``tensor_parallel.axis``), the pipeline (``pipeline.axis``).
The engine (``engine/base.py``, its update in ``engine/update.py``) asks every axis in turn,
innermost first (the data-parallel group's own, then tp, cp, ep, pp: the order ``parallelize``
applied them), one loop per question:

- ``after_grads(engine)``: after the gradient exchange, a sum of its own over this axis (under
  sequence parallelism, the gradients of the parameters every tp rank holds; over hybrid replicas,
  each gradient shard);
- ``norm_share(engine, share)`` and ``counts_norm``: its share of the squared gradient norm. An axis
  takes out of the rank's share what another rank of the axis counts (a parameter every tp rank
  holds counts on the first), or says the rank counts nothing (a replica: the first one counts). The
  engine then sums the shares in one all-reduce over every rank that steps;
- ``assemble(tensors)``: full-tensor assembly, the engine's ``{name: tensor}`` widened over the axis
  (tp: each shard at its global shape; pp: every stage's tensors on every stage);
- ``pieces(pieces)`` and ``reader(read)``: the checkpoint pieces of the engine's tensors as pieces of
  the global ones (or none, where another rank of the axis writes them), and the reader that gives the
  engine what it asks for from the global tensors; ``own_pieces()`` and ``read_own(read)``: state
  of the axis itself (tp's dropout streams), written by every rank and read back before the engine
  changes;
- ``reports_loss``: whether this rank reports the step's loss (every tp rank computes the same loss:
  the first reports it; a pipeline's loss is on its last stage);
- ``step_runner``: who runs the step's micro-batches, where the axis does (the pipeline's runtime).

Before any of that, ``apply(model)`` is the axis's step in ``parallelize`` (tp, cp, ep, pp in that
order): it cuts the model in place, and the axis is ``active`` where it holds part of it. The base
class is an axis of one rank: it applies and adds nothing. Communication: each axis's own, stated in
its module; none here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.errors import NotBuiltError

if TYPE_CHECKING:
    from shardwise.engine.base import Engine
    from shardwise.engine.state import StateReader
    from shardwise.engine.step import StepRunner


def _nothing() -> None:
    return None


class Axis:
    """A mesh axis joined to an engine; see the module docstring for the protocol."""

    name = "axis"
    comm: Comm  # this rank's group along the axis, once the axis holds part of the model
    step_runner: StepRunner | None = None  # the pipeline's runtime runs the micro-batches

    @property
    def active(self) -> bool:
        """Whether the axis cuts the model on this rank (an axis of one rank, or a parameter server's,
        does not: the engine never asks it)."""
        return True

    def apply(self, model: nn.Module) -> None:
        """Cut ``model`` over this axis, in place (``parallelize``'s step for the axis)."""
        return None

    # -- the step -----------------------------------------------------------------------------------
    def after_grads(self, engine: Engine) -> None:
        """After the data-parallel gradient exchange (and the axes before this one): sums of its own."""
        return None

    def norm_share(self, engine: Engine, share: torch.Tensor) -> torch.Tensor:
        """``share`` less what another rank of this axis counts."""
        return share

    @property
    def counts_norm(self) -> bool:
        """False where another rank of this axis counts this rank's whole share (a replica's)."""
        return True

    @property
    def reports_loss(self) -> bool:
        """Whether this rank reports the step's loss share."""
        return True

    # -- full tensors and checkpoints -----------------------------------------------------------------
    def assemble(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (by parameter name) widened over this axis."""
        return tensors

    def pieces(self, pieces: list[Piece]) -> list[Piece]:
        """The checkpoint pieces of the tensors this rank holds as pieces of the global ones; those
        another rank of this axis writes left out."""
        return pieces

    def reader(self, read: StateReader) -> StateReader:
        """A reader giving the engine its tensors as it holds them, from the global ones in ``read``."""
        return read

    def own_pieces(self) -> list[Piece]:
        """State of the axis itself, for the checkpoint."""
        return []

    def read_own(self, read: StateReader) -> Callable[[], None]:
        """Read the axis's own state from ``read`` now; the returned call puts it in place (after the
        engine loaded, so that a damaged file leaves everything as it was)."""
        return _nothing


NOT_BUILT = {"cp": "context parallelism", "ep": "expert parallelism"}  # in the axis table, not built yet


class NotBuiltAxis(Axis):
    """An axis of the table that is not built yet (``NOT_BUILT``): refused in one line above degree 1,
    nothing at 1."""

    def __init__(self, name: str, degree: int) -> None:
        if degree > 1:
            what = NOT_BUILT[name]
            raise NotBuiltError(f"{what} (--{name} {degree}) is not built yet; set parallel.{name} = 1")
        self.name = name

    @property
    def active(self) -> bool:
        return False
