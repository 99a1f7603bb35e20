"""The pp axis joined to a data-parallel engine on one pipeline stage: the engine answers for the
whole model.

After ``pipeline.split`` a rank's model holds only its stages' parameters, and its engine (DDP, ZeRO-1,
-2 or -3 over the rank's dp group) knows only those. ``PipelineAxis`` (``engine/axis.py``) gives the
engine the pipeline runtime as its step runner and widens, over the pp axis, what is global by
contract (``engine/base.py``):

- the norm: each stage's share counts its own parameters (the tied weight is a parameter of the first
  stage only, so it counts once), summed with every other rank's in the engine's one all-reduce;
- full tensors: every stage's tensors gathered on every rank of the pp group (``all_gather_object``;
  names are the model's own, so verify compares them with one process);
- checkpoints: each stage writes its own tensors, its dp group spreading them; state that is not a
  parameter's or an optimizer's (the loss scale, a buffer every stage holds) is written by the first
  stage's ranks only;
- the loss: the last stage holds it, and reports it.

Communication: an all-gather of objects over pp when the full model is asked for (verify, the end of
a run); the runtime's own point-to-point messages (``pipeline.runtime``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.engine.axis import Axis
from shardwise.pipeline.runtime import PipelineRunner


def gather_dicts(comm: Comm, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pp rank's ``{name: tensor}`` merged, on every rank (names are disjoint across stages)."""
    everyone: list[Any] = [None] * comm.world_size
    dist.all_gather_object(everyone, {n: t.detach().cpu() for n, t in mine.items()}, group=comm.group)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return merged


class PipelineAxis(Axis):
    """The pp axis of ``runner`` (this rank's stages and the runtime that runs them)."""

    name = "pp"

    def __init__(self, runner: PipelineRunner) -> None:
        super().__init__(runner.comm)
        self.step_runner = runner
        self.split = runner.split
        self.holds_last = runner.last_stage in runner.split.stages

    @property
    def reports_loss(self) -> bool:
        return self.holds_last

    def assemble(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return gather_dicts(self.comm, tensors)

    def pieces(self, pieces: list[Piece]) -> list[Piece]:
        """Each stage its own tensors; the rest (a buffer every stage holds, the loss scale) the first
        stage's ranks only."""
        if self.comm.rank == 0:
            return pieces
        shared = self.split.shared_buffers
        return [p for p in pieces if _stage_owned(p.name) and p.name.removeprefix("model/") not in shared]


def _stage_owned(name: str) -> bool:
    return name.startswith(("model/", "optim/"))
