"""The pp axis: this rank's pipeline stages kept (step 4 of ``parallelize``), then joined to the
data-parallel engine on them, so that the engine answers for the whole model.

``PipelineAxis.apply`` keeps this rank's stages (``pipeline.split``) and makes the runtime that runs
them (``pipeline.runtime``); the config's refusals are ``check_pipeline``. After the split a rank's
model holds only its stages' parameters, and its engine (DDP, ZeRO-1,
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
from torch import nn

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.engine.axis import Axis
from shardwise.errors import ConfigError, NotBuiltError
from shardwise.mesh import Mesh
from shardwise.models import build_model
from shardwise.models.adapters import config_blocks
from shardwise.pipeline.runtime import PipelineRunner
from shardwise.pipeline.schedules import SCHEDULES, ScheduleConfigError, stage_placement
from shardwise.pipeline.schedules import build as build_schedule
from shardwise.pipeline.schedules import check as check_schedule
from shardwise.pipeline.split import plan_stages, split_model
from shardwise.pipeline.stages import FEWER_STAGES

# the data-parallel engines a pipeline stage runs under
PIPELINE_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PIPELINE_REFUSED = ("ps", "diloco")
DEFAULT_SCHEDULE = ParallelConfig().schedule  # what a config without a pipeline holds


def gather_dicts(comm: Comm, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pp rank's ``{name: tensor}`` merged, on every rank (names are disjoint across stages)."""
    everyone: list[Any] = [None] * comm.world_size
    dist.all_gather_object(everyone, {n: t.detach().cpu() for n, t in mine.items()}, group=comm.group)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return merged


class PipelineAxis(Axis):
    """The pp axis: ``apply`` keeps this rank's stages and makes the runtime that runs them."""

    name = "pp"

    def __init__(self, mesh: Mesh, config: TrainConfig) -> None:
        check_pipeline(config, config_model=False)  # the model checked is the one ``apply`` gets
        self.mesh, self.parallel = mesh, config.parallel
        self.runner: PipelineRunner | None = None
        self.assignment: list[list[int]] | None = None

    def plan(self, model: nn.Module) -> None:
        """Step 0 of ``parallelize``: every stage's blocks, cut on the whole model (``plan_stages``)
        before tensor parallelism replaces its layers, so the cut is the planner's at any tp."""
        parallel = self.parallel
        if parallel.pp > 1 and self.mesh.in_mesh:
            self.assignment = plan_stages(model, parallel.pp * parallel.stages_per_rank, parallel.pp_split)

    @property
    def active(self) -> bool:
        return self.runner is not None

    def apply(self, model: nn.Module) -> None:
        """Step 4 of ``parallelize``: keep this rank's pipeline stages over pp (``pipeline.split``,
        parameter names preserved) and make the runtime that runs them, the engine's step runner once
        joined. Nothing at pp 1."""
        parallel = self.parallel
        if parallel.pp == 1 or not self.mesh.in_mesh:
            return
        comm = self.mesh.comm("pp")
        name, pp, virtual = parallel.schedule, parallel.pp, parallel.stages_per_rank
        placement = stage_placement(name, pp, virtual)
        split = split_model(model, placement, comm.rank, parallel.pp_split, self.assignment)
        spec = SCHEDULES[name]
        runner = PipelineRunner(
            split, comm, placement, lambda m: build_schedule(name, pp, virtual, m), spec.splits_backward,
            parallel.fit_schedule,
        )
        self.runner = self.step_runner = runner
        self.comm, self.split = comm, split
        self.holds_last = runner.last_stage in split.stages

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


def check_pipeline(config: TrainConfig, config_model: bool = True) -> None:
    """The schedule fits pp, virtual stages and micro-batches (the arithmetic in the message); the
    strategies that cannot run on a pipeline stage are refused; ``config_model``: the blocks (the
    names of ``parallel.pp_split``, or enough blocks for the stages) checked against the model the
    config describes, built on meta. ``PipelineAxis`` skips that: the ranks' split checks the model
    it is given, which may be the user's own rather than the config's."""
    parallel = config.parallel
    if parallel.pp == 1:
        if parallel.schedule != DEFAULT_SCHEDULE:
            raise ConfigError(
                f"parallel.schedule = {parallel.schedule!r} orders a pipeline's micro-batches, but there is "
                "no pipeline: set parallel.pp > 1 (--pp) or leave the schedule unset"
            )
        if parallel.virtual_stages not in (0, 1):
            raise ConfigError(
                f"parallel.virtual_stages = {parallel.virtual_stages} needs a pipeline: set parallel.pp > 1 "
                "(--pp) or leave virtual_stages unset"
            )
        if parallel.pp_split:
            raise ConfigError(
                "parallel.pp_split names where pipeline stages start, but there is no pipeline: set "
                "parallel.pp > 1 (--pp) or leave pp_split empty"
            )
        if not parallel.fit_schedule:
            raise ConfigError(
                "parallel.fit_schedule = false keeps a zero-bubble schedule as built, but there is no "
                "pipeline: set parallel.pp > 1 (--pp) or leave fit_schedule unset"
            )
        return
    if not parallel.fit_schedule and not SCHEDULES[parallel.schedule].splits_backward:
        raise ConfigError(
            f"parallel.fit_schedule = false keeps a zero-bubble schedule's split backwards as built, but "
            f"{parallel.schedule!r} splits none: use zb, interleaved-zb, zbv or dualpipev, or leave "
            "fit_schedule unset"
        )
    check_combination(config)
    try:
        check_schedule(parallel.schedule, parallel.pp, parallel.stages_per_rank, config.data.micro_batches)
    except ScheduleConfigError as exc:
        raise ConfigError(str(exc)) from None
    if not config_model:
        return
    if parallel.pp_split:  # the names against the model's own blocks (built on meta: no values drawn)
        model = build_model(config.model, meta=True)
        plan_stages(model, parallel.pp * parallel.stages_per_rank, parallel.pp_split)
    elif (blocks := config_blocks(config.model)) is not None:
        stages = parallel.pp * parallel.stages_per_rank
        if blocks < stages:
            raise ConfigError(
                f"the {config.model.kind} preset {config.model.preset!r} has {blocks} blocks, fewer than "
                f"pp({parallel.pp}) x virtual_stages({parallel.stages_per_rank}) = {stages} stages; pick a "
                f"larger preset, or {FEWER_STAGES}"
            )


def check_combination(config: TrainConfig) -> None:
    """What cannot run on a pipeline at all (a strategy, fp16, a codec, unused-parameter search), at
    pp > 1. ``preflight`` asks it before the world's arithmetic, so such a job hears it first, not
    after fixing a rank count it could never use."""
    parallel = config.parallel
    if parallel.pp == 1:
        return
    if config.strategy in PIPELINE_REFUSED:
        raise NotBuiltError(
            f"--strategy {config.strategy} does not run with pipeline parallelism "
            f"(parallel.pp = {parallel.pp}); use {' or '.join(PIPELINE_STRATEGIES)} on the dp axis, "
            "or set parallel.pp = 1"
        )
    unsupported = {
        "precision = fp16 (each stage would decide an overflow alone)": (config.compute_precision == "fp16"),
        "comm.compress (codec state is kept per dp rank, not per stage)": (
            config.comm.compress not in ("", "none")
        ),
        "ddp.find_unused_parameters": config.ddp.find_unused_parameters,
    }
    for what, asked in unsupported.items():
        if asked:
            raise NotBuiltError(
                f"{what} with pipeline parallelism (parallel.pp = {parallel.pp}) is not built yet; "
                "drop it or set parallel.pp = 1"
            )
