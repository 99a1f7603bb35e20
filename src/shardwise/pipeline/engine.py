"""A data-parallel engine on one pipeline stage, made to answer for the whole model.

After ``pipeline.split`` a rank's model holds only its stages' parameters, and its engine (DDP, ZeRO-1,
-2 or -3 over the rank's dp group) knows only those. ``attach_pipeline`` sets the pipeline runtime as the
engine's step runner and widens, over the pp axis, what is global by contract (``engine/base.py``):

- ``grad_norm_sq``: the stage's share, summed over its dp group, then over the pp group: every element
  once over dp x pp (the tied weight is a parameter of the first stage only, so it counts once);
- ``full_parameters`` / ``full_gradients``: every stage's tensors gathered on every rank of the pp group
  (``all_gather_object``; names are the model's own, so verify compares them with one process);
- ``state_pieces``: each stage writes its own tensors, its dp group spreading them (the engine is
  asked with its dp rank and size, not the global ones); state that is not a parameter's or an
  optimizer's (the loss scale, a buffer every stage holds) is written by the first stage's ranks only.

Communication: one all-reduce of one number over pp per norm; an all-gather of objects over pp when
the full model is asked for (verify, the end of a run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.engine.base import Engine
from shardwise.pipeline.runtime import PipelineRunner


def gather_dicts(comm: Comm, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pp rank's ``{name: tensor}`` merged, on every rank (names are disjoint across stages)."""
    everyone: list[Any] = [None] * comm.world_size
    dist.all_gather_object(everyone, {n: t.detach().cpu() for n, t in mine.items()}, group=comm.group)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return merged


def attach_pipeline(engine: Engine, runner: PipelineRunner) -> None:
    """Make ``engine`` run ``runner``'s schedule and answer global questions over its pp axis too."""
    engine.runner = runner
    pp = runner.comm
    local_norm = engine.grad_norm_sq
    local_params, local_grads = engine.full_parameters, engine.full_gradients
    local_pieces = engine.state_pieces
    dp = engine.count_comm

    def grad_norm_sq() -> tuple[torch.Tensor, Comm | None]:
        share, comm = local_norm()
        if comm is not None:
            comm.all_reduce(share)
        return share, pp

    def state_pieces(rank: int, world_size: int) -> list[Piece]:
        dp_rank, dp_size = (dp.rank, dp.world_size) if dp is not None else (0, 1)
        pieces = local_pieces(dp_rank, dp_size)
        if pp.rank == 0:
            return pieces
        shared = runner.split.shared_buffers
        return [p for p in pieces if _stage_owned(p.name) and p.name.removeprefix("model/") not in shared]

    overrides: dict[str, Callable[..., Any]] = {
        "grad_norm_sq": grad_norm_sq,
        "full_parameters": lambda: gather_dicts(pp, local_params()),
        "full_gradients": lambda: gather_dicts(pp, local_grads()),
        "state_pieces": state_pieces,
    }
    engine.override(overrides)


def _stage_owned(name: str) -> bool:
    return name.startswith(("model/", "optim/"))
