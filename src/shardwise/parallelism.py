"""``parallelize(model, mesh, config)``: every configured kind of parallelism, applied from outside.

The steps run in one fixed order (torchtitan's ``parallelize``), each on its own mesh axis:

1. tensor parallelism over ``tp``: parameters become local shards;
2. the pipeline split over ``pp``: this rank keeps its stage(s), parameter names preserved;
3. activation checkpointing, per block;
4. data parallelism over ``dp`` (ddp | zero1-3 | ps): the returned ``Engine``; with ``sync_batchnorm``
   BatchNorm layers first become synchronous over ``dp`` (else a one-line notice: per-rank statistics);

then the optimizers, built by one factory over what the rank holds after all four (so they compose),
and handed to the engine. With ``model.init_from``, step 4 also gives the model its initial values from
that file, each rank reading what it holds (ZeRO-3: its shards only; every other strategy: whole
tensors), so a model built with its parameters on the meta device never exists whole on a ZeRO-3 rank.
A step that is not built yet refuses in one line (``NotBuiltError``) when the config asks for it,
rather than being silently skipped. ``check`` runs the same refusals on the config alone, so commands
can fail before any rank starts. Communication: only the data-parallel engine's start-up (initial
weights from rank 0, or from the servers).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.pretrained import PretrainedWeights
from shardwise.config import ConfigError, TrainConfig
from shardwise.data_parallel.sync_batchnorm import convert_sync_batchnorm, has_batchnorm
from shardwise.engine.base import Engine
from shardwise.engine.loss import Loss, as_loss
from shardwise.engine.optim import OptimizerFactory, SchedulerFactory, attach_optimizers, optimizer_factory
from shardwise.engine.schedule import is_constant, schedule_factory
from shardwise.mesh import Mesh
from shardwise.models import PRESETS
from shardwise.models.meta import meta_parameters
from shardwise.pipeline.engine import attach_pipeline
from shardwise.pipeline.runtime import PipelineRunner
from shardwise.pipeline.schedules import ScheduleConfigError, stage_placement
from shardwise.pipeline.schedules import build as build_schedule
from shardwise.pipeline.schedules import check as check_schedule
from shardwise.pipeline.split import split_model
from shardwise.strategies import build_data_parallel


class NotBuiltError(ConfigError):
    """The config asks for a kind of parallelism this version does not have yet."""


PIPELINE_STRATEGIES = ("ddp", "zero1", "zero2")  # the data-parallel engines a pipeline stage runs under
PIPELINE_REFUSED = ("ps", "zero3", "diloco")


def check(config: TrainConfig) -> None:
    """Refuse, in one line, what the config asks for and no step can do yet."""
    _check_tensor_parallel(config)
    _check_pipeline(config)
    _check_activation_checkpointing(config)


def _check_tensor_parallel(config: TrainConfig) -> None:
    if config.parallel.tp != 1:
        raise NotBuiltError(
            f"tensor parallelism (parallel.tp = {config.parallel.tp}) is not built yet; set parallel.tp = 1"
        )


def _check_pipeline(config: TrainConfig) -> None:
    """The schedule fits pp, virtual stages and micro-batches (the arithmetic in the message); the
    strategies that cannot run on a pipeline stage are refused."""
    parallel = config.parallel
    if parallel.pp == 1:
        if parallel.virtual_stages != 1:
            raise ConfigError(
                f"parallel.virtual_stages = {parallel.virtual_stages} needs a pipeline: set parallel.pp > 1 "
                "(--pp) or virtual_stages = 1"
            )
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
    try:
        check_schedule(parallel.schedule, parallel.pp, parallel.virtual_stages, config.data.micro_batches)
    except ScheduleConfigError as exc:
        raise ConfigError(str(exc)) from None
    if config.model.kind == "gpt":
        blocks = PRESETS["gpt"].get(config.model.preset, {}).get("n_layer", 0)
        stages = parallel.pp * parallel.virtual_stages
        if blocks < stages:
            raise ConfigError(
                f"the gpt preset {config.model.preset!r} has {blocks} blocks, fewer than pp({parallel.pp}) x "
                f"virtual_stages({parallel.virtual_stages}) = {stages} stages; pick a larger preset"
            )


def _check_activation_checkpointing(config: TrainConfig) -> None:
    if config.parallel.activation_checkpointing:
        raise NotBuiltError(
            "activation checkpointing (parallel.activation_checkpointing = true) is not built yet; "
            "set it to false"
        )


def apply_tensor_parallel(model: nn.Module, mesh: Mesh, config: TrainConfig) -> None:
    """Step 1: shard layers over the ``tp`` axis (refuses until tensor parallelism is built)."""
    _check_tensor_parallel(config)


def apply_pipeline(model: nn.Module, mesh: Mesh, config: TrainConfig) -> PipelineRunner | None:
    """Step 2: keep this rank's pipeline stages over the ``pp`` axis (``pipeline.split``); returns the
    runtime that runs them (the engine's step runner), or None without a pipeline."""
    _check_pipeline(config)
    parallel = config.parallel
    if parallel.pp == 1 or not mesh.in_mesh:
        return None
    comm = mesh.comm("pp")
    name, pp, virtual = parallel.schedule, parallel.pp, parallel.virtual_stages
    placement = stage_placement(name, pp, virtual)
    split = split_model(model, placement, comm.rank)
    return PipelineRunner(split, comm, placement, lambda m: build_schedule(name, pp, virtual, m)[comm.rank])


def apply_activation_checkpointing(model: nn.Module, config: TrainConfig) -> None:
    """Step 3: recompute each block's activations in backward (refuses until it is built)."""
    _check_activation_checkpointing(config)


def apply_batchnorm(model: nn.Module, mesh: Mesh, config: TrainConfig) -> None:
    """BatchNorm under data parallelism: synchronous over ``dp`` when asked, else said once."""
    if not has_batchnorm(model) or not mesh.in_mesh or mesh.dims.dp == 1:
        return
    if config.sync_batchnorm:
        convert_sync_batchnorm(model, mesh.comm("dp"))
    elif mesh.comm("dp").rank == 0 and mesh.dims.pp * mesh.dims.tp == 1:
        print(
            "shardwise: the model has BatchNorm layers: each rank normalises with its own share's "
            "statistics (--sync-batchnorm uses the global batch's)",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def _initial_weights(model: nn.Module, mesh: Mesh, config: TrainConfig) -> Iterator[PretrainedWeights | None]:
    """``model.init_from``'s files matched to the model, open while the engine reads them (None: the
    model keeps its own values, which must then exist)."""
    path = config.model.init_from
    if not path:
        if empty := meta_parameters(model):
            raise ConfigError(
                f"the model's parameters are on the meta device, with no values ({', '.join(empty[:3])}); "
                "set model.init_from to the weights to load, or build the model on a real device"
            )
        yield None
        return
    with PretrainedWeights.open(path, model) as weights:
        note = weights.cast_note()
        if note and mesh.rank == 0:
            print(f"shardwise: {note}", file=sys.stderr, flush=True)
        yield weights


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    config: TrainConfig,
    factory: OptimizerFactory | None = None,
    share_gradients: bool = False,
    loss: Loss | Callable[[Any, Any], torch.Tensor] | None = None,
    scheduler: SchedulerFactory | None = None,
) -> Engine:
    """Apply steps 1-4 to ``model`` in place and return the engine, its optimizers attached.

    ``factory`` builds each optimizer from named tensors (default: ``config.optim``'s); ``loss`` is
    what ``engine.train_step`` minimises (a SUM per micro-batch and a count: see
    ``shardwise.engine.loss``; default: token or causal-LM cross-entropy); ``scheduler`` builds a
    ``torch.optim.lr_scheduler`` over each optimizer, stepped after every update; ``share_gradients``
    makes global gradients visible on every rank that steps (``verify``).
    """
    apply_tensor_parallel(model, mesh, config)
    runner = apply_pipeline(model, mesh, config)
    apply_activation_checkpointing(model, config)
    apply_batchnorm(model, mesh, config)
    with _initial_weights(model, mesh, config) as weights:
        engine = build_data_parallel(config, model, mesh, share_gradients, weights)
    if left := meta_parameters(model):  # a strategy that did not read them: never train on no data
        raise RuntimeError(f"{config.strategy} left parameters on the meta device: {', '.join(left[:3])}")
    engine.count_comm = mesh.comm("dp") if mesh.in_mesh else None  # the ranks that split each batch
    if runner is not None:
        engine.loss_comm = mesh.trainers  # only the last stage holds a loss share: sum over every stage
        attach_pipeline(engine, runner)
    engine.clip_grad_norm = config.optim.clip_grad_norm
    if engine.units_are_parameters:  # ZeRO took the precision at construction (compute copies)
        engine.use_precision(config.compute_precision)
    if loss is not None:
        engine.loss = as_loss(loss)
    if scheduler is None and not is_constant(config.optim):
        scheduler = schedule_factory(config.optim, config.steps)
    return attach_optimizers(engine, factory or optimizer_factory(config.optim), scheduler)
