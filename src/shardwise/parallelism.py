"""``parallelize(model, mesh, config)``: every configured kind of parallelism, applied from outside.

The steps run in one fixed order (torchtitan's ``parallelize``), each on its own mesh axis, after the
model is moved to this rank's device (``config.device`` in the joined group: its GPU or the CPU;
parameters still on meta are materialised there by whoever reads them):

1. tensor parallelism over ``tp``: parameters become local shards;
2. the pipeline split over ``pp``: this rank keeps its stage(s), parameter names preserved;
3. activation checkpointing, per block;
4. data parallelism over ``dp`` (ddp | zero1-3 | ps): the returned ``Engine``; with ``sync_batchnorm``
   BatchNorm layers first become synchronous over ``dp`` (else a one-line notice: per-rank statistics);

then the optimizers, built by one factory over what the rank holds after all four (so they compose),
and handed to the engine. A model built on the meta device (``build_model(meta=True)``, as the Trainer
builds it) goes through steps 1-3 there, and step 4 gives it its initial values from one source
(:mod:`shardwise.materialize`: ``model.init_from``'s files, or the model's recorded initialisation),
each rank reading only what it holds: its stage, its tp shards, its ZeRO-3 shard; so no rank ever
holds the whole model. A model passed in built keeps its values.
A step that is not built yet refuses in one line (``NotBuiltError``) when the config asks for it,
rather than being silently skipped. ``check`` runs the same refusals on the config alone, so commands
can fail before any rank starts. Communication: only the data-parallel engine's start-up (initial
weights from rank 0, or from the servers).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.checkpoint.source import NoValues, WeightSource
from shardwise.collectives.api import Comm
from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.data_parallel.sync_batchnorm import convert_sync_batchnorm, has_batchnorm
from shardwise.device import joined_device, place_model
from shardwise.engine.base import Engine
from shardwise.engine.loss import AutoLoss, CausalLMLoss, Loss, TokenLoss, as_loss
from shardwise.engine.optim import OptimizerFactory, SchedulerFactory, attach_optimizers, optimizer_factory
from shardwise.engine.schedule import is_constant, schedule_factory
from shardwise.materialize import held_weights, weight_source
from shardwise.mesh import Mesh
from shardwise.models import build_model
from shardwise.models.adapters import adapter_for, config_blocks
from shardwise.models.meta import meta_parameters
from shardwise.pipeline.engine import attach_pipeline
from shardwise.pipeline.runtime import PipelineRunner
from shardwise.pipeline.schedules import SCHEDULES, ScheduleConfigError, stage_placement
from shardwise.pipeline.schedules import build as build_schedule
from shardwise.pipeline.schedules import check as check_schedule
from shardwise.pipeline.split import plan_stages, split_model
from shardwise.strategies import build_data_parallel
from shardwise.tensor_parallel import TensorParallelLayout
from shardwise.tensor_parallel import apply_tensor_parallel as apply_tp_plan
from shardwise.tensor_parallel.engine import attach_rng_states, attach_tensor_parallel
from shardwise.tensor_parallel.layers import VocabParallelCausalLMLoss, VocabParallelTokenLoss
from shardwise.tensor_parallel.random import RNGStatesTracker


class NotBuiltError(ConfigError):
    """The config asks for a kind of parallelism this version does not have yet."""


# the data-parallel engines a pipeline stage runs under
PIPELINE_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PIPELINE_REFUSED = ("ps", "diloco")
DEFAULT_SCHEDULE = ParallelConfig().schedule  # what a config without a pipeline holds


def check(config: TrainConfig) -> None:
    """Refuse, in one line, what the config asks for and no step can do yet."""
    _check_hybrid(config)
    _check_tensor_parallel(config)
    _check_pipeline(config)


def _check_hybrid(config: TrainConfig) -> None:
    """Hybrid sharding: ZeRO only, no codec (its error feedback is per shard group), replicas that
    divide the dp degree (checked again with the world's size when the mesh is built)."""
    replicate = config.parallel.dp_replicate
    if replicate == 1:
        return
    if config.strategy not in ("zero1", "zero2", "zero3"):
        raise ConfigError(
            f"parallel.dp_replicate = {replicate} is hybrid sharding: ZeRO shards within groups and the "
            f"groups replicate; --strategy {config.strategy} does not shard: use zero1, zero2 or zero3"
        )
    if config.comm.compress:
        raise NotBuiltError("gradient compression with hybrid sharding (--dp-replicate) is not built yet")
    dp = config.parallel.dp
    if dp != -1 and dp % replicate:
        raise ConfigError(f"parallel.dp_replicate = {replicate} does not divide dp = {dp}")


TENSOR_PARALLEL_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")  # data-parallel engines over tp shards


def _check_tensor_parallel(config: TrainConfig) -> None:
    parallel = config.parallel
    if parallel.tp == 1:
        if parallel.sequence_parallel:
            raise ConfigError(
                "parallel.sequence_parallel needs tensor parallelism: set parallel.tp > 1 (--tp)"
            )
        return
    if config.strategy not in TENSOR_PARALLEL_STRATEGIES:
        raise NotBuiltError(
            f"--strategy {config.strategy} with tensor parallelism (parallel.tp = {parallel.tp}) is not "
            f"built yet; use {' or '.join(TENSOR_PARALLEL_STRATEGIES)} on the dp axis, or set parallel.tp = 1"
        )
    if parallel.pp != 1 and parallel.sequence_parallel:
        raise NotBuiltError(
            f"sequence parallelism with a pipeline (pp {parallel.pp}) is not built yet (stages would pass "
            "a tp-th of the sequence); drop --sequence-parallel or set parallel.pp = 1"
        )
    if config.comm.compress:
        raise NotBuiltError(
            f"gradient compression (--compress {config.comm.compress}) with tensor parallelism is not "
            "built yet (each tp rank's error feedback would need its own checkpoint slot); drop one"
        )
    if parallel.sequence_parallel and config.model.seq_len % parallel.tp:
        raise ConfigError(
            f"sequence parallelism cuts the sequence over tp: seq_len {config.model.seq_len} is not "
            f"divisible by tp {parallel.tp}"
        )


def _check_pipeline(config: TrainConfig, config_model: bool = True) -> None:
    """The schedule fits pp, virtual stages and micro-batches (the arithmetic in the message); the
    strategies that cannot run on a pipeline stage are refused; ``config_model``: the blocks (the
    names of ``parallel.pp_split``, or enough blocks for the stages) checked against the model the
    config describes, built on meta. ``apply_pipeline`` skips that: the ranks' split checks the model
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
                "larger preset"
            )


def apply_tensor_parallel(
    model: nn.Module, mesh: Mesh, config: TrainConfig
) -> TensorParallelLayout | None:
    """Step 1: cut the model's layers over the ``tp`` axis by its plan (its adapter's: a model with
    none, or a subclass overriding the family's forward, is refused by name); returns the layout
    (every parameter's box), or None without tensor parallelism."""
    _check_tensor_parallel(config)
    if config.parallel.tp == 1 or not mesh.in_mesh:
        return None
    plan = adapter_for(model).tp_plan()
    try:
        sp, device = config.parallel.sequence_parallel, joined_device(config.device)
        return apply_tp_plan(model, mesh.comm("tp"), plan, sp, config.seed, device)
    except ValueError as exc:  # a width tp does not divide: the arithmetic, in one line
        raise ConfigError(f"tensor parallelism: {exc}") from None


def tensor_parallel_loss(loss: Loss, comm: Comm) -> Loss:
    """The built-in losses over vocab-cut logits (no rank gathers the full logits), the default one
    (``AutoLoss``) included; a user's own loss would see a tp-th of the vocabulary, so it is refused."""
    if type(loss) is TokenLoss:
        return VocabParallelTokenLoss(comm, loss.positions)
    if type(loss) is CausalLMLoss:
        return VocabParallelCausalLMLoss(comm, loss.ignore_index)
    if type(loss) is AutoLoss:
        causal = VocabParallelCausalLMLoss(comm, loss.ignore_index)
        return loss.over(causal=causal, tokens=VocabParallelTokenLoss(comm))
    raise ConfigError(
        f"with tensor parallelism the logits are cut by vocabulary, so a loss of your own "
        f"({type(loss).__name__}) would see a tp-th of them; leave loss unset (the default), pass "
        "sw.CausalLMLoss() or sw.TokenLoss(), or set parallel.tp = 1"
    )


def apply_pipeline(model: nn.Module, mesh: Mesh, config: TrainConfig) -> PipelineRunner | None:
    """Step 2: keep this rank's pipeline stages over the ``pp`` axis (``pipeline.split``); returns the
    runtime that runs them (the engine's step runner), or None without a pipeline."""
    _check_pipeline(config, config_model=False)
    parallel = config.parallel
    if parallel.pp == 1 or not mesh.in_mesh:
        return None
    comm = mesh.comm("pp")
    name, pp, virtual = parallel.schedule, parallel.pp, parallel.stages_per_rank
    placement = stage_placement(name, pp, virtual)
    split = split_model(model, placement, comm.rank, parallel.pp_split)
    spec = SCHEDULES[name]
    return PipelineRunner(
        split, comm, placement, lambda m: build_schedule(name, pp, virtual, m), spec.splits_backward
    )


@contextmanager
def _replayed(tracker: RNGStatesTracker, states: dict[str, torch.Tensor]) -> Iterator[None]:
    """The tracker's states as they were at the forward, for the recomputation; then as they are."""
    now = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(now)


def apply_activation_checkpointing(
    model: nn.Module, config: TrainConfig, tracker: RNGStatesTracker | None = None
) -> None:
    """Step 3: each block of the model's block list (``zero.unit``'s, else its adapter's) keeps
    only its inputs in forward and recomputes its activations in backward.

    The block's own ``forward`` is wrapped (``torch.utils.checkpoint``, non-reentrant, the RNG state
    restored for the recomputation so dropout masks repeat), not the module: parameter names stay the
    model's, and hooks on the block (ZeRO-3's gather and release) run once per forward, around it. A
    model without a block list is refused in one line.
    """
    if not config.parallel.activation_checkpointing:
        return
    found = adapter_for(model).block_list(config.zero.unit)
    if found is None:
        raise ConfigError(
            f"activation checkpointing recomputes each block, but {type(model).__name__} has no "
            "ModuleList/Sequential of blocks; turn parallel.activation_checkpointing off"
        )
    for block in found.blocks:
        checkpoint_forward(block, tracker)


def checkpoint_forward(block: nn.Module, tracker: RNGStatesTracker | None = None) -> None:
    """Make ``block``'s forward recompute its activations in backward instead of keeping them.

    ``tracker``: tensor parallelism's private dropout states, set back for the recomputation to what
    they were at the forward (torch restores its own generator's), so every mask repeats."""
    inner = block.forward

    def contexts() -> tuple[Any, Any]:
        return nullcontext(), _replayed(tracker, tracker.get_states()) if tracker else nullcontext()

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to keep, nothing to recompute
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(
            inner, *args, use_reentrant=False, context_fn=contexts, **kwargs
        )

    block.forward = forward


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


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    config: TrainConfig,
    factory: OptimizerFactory | None = None,
    share_gradients: bool = False,
    loss: Loss | Callable[[Any, Any], torch.Tensor] | None = None,
    scheduler: SchedulerFactory | None = None,
    weights: WeightSource | None = None,
) -> Engine:
    """Apply steps 1-4 to ``model`` in place and return the engine, its optimizers attached.

    ``factory`` builds each optimizer from named tensors (default: ``config.optim``'s); ``loss`` is
    what ``engine.train_step`` minimises (a SUM per micro-batch and a count: see
    ``shardwise.engine.loss``; default: token or causal-LM cross-entropy); ``scheduler`` builds a
    ``torch.optim.lr_scheduler`` over each optimizer, stepped after every update; ``share_gradients``
    makes global gradients visible on every rank that steps (``verify``); ``weights``: where the
    tensors on the meta device get their values (default: ``model.init_from``, else the model's
    recorded initialisation; ``NoValues``: none, the rank runs on meta).
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            "the model has no trainable parameters (none with requires_grad=True), so there is nothing "
            "to train; leave some unfrozen"
        )
    device = joined_device(config.device)
    place_model(model, device)  # a model built with values (yours) moved first; tensors on meta stay
    with weight_source(model, mesh, config, weights) as source:
        layout = apply_tensor_parallel(model, mesh, config)  # on meta, where the model was built there
        runner = apply_pipeline(model, mesh, config)
        apply_activation_checkpointing(model, config, layout.tracker if layout is not None else None)
        apply_batchnorm(model, mesh, config)
        held = None
        if source is not None:  # each rank materialises only what it holds, from the one source
            held = held_weights(source, model, layout, runner, device, bool(config.model.init_from))
        engine = build_data_parallel(config, model, mesh, share_gradients, held)
    if (left := meta_parameters(model)) and not isinstance(weights, NoValues):  # never train on no data
        raise RuntimeError(f"{config.strategy} left parameters on the meta device: {', '.join(left[:3])}")
    engine.count_comm = mesh.comm("dp") if mesh.in_mesh else None  # the ranks that split each batch
    engine.clip_grad_norm = config.optim.clip_grad_norm
    if engine.units_are_parameters:  # ZeRO took the precision at construction (compute copies)
        engine.use_precision(config.compute_precision)
    if loss is not None:
        engine.loss = as_loss(loss)
    # what is global (the norm, full tensors, checkpoint pieces) widened over tp, then over pp
    if layout is not None:  # every tp rank holds the whole loss: the first reports it
        engine.loss = tensor_parallel_loss(engine.loss, layout.comm)
        engine.loss_comm = mesh.trainers
        attach_tensor_parallel(engine, layout)
    if runner is not None:
        engine.loss_comm = mesh.trainers  # only the last stage holds a loss share: sum over every stage
        attach_pipeline(engine, runner)
    if layout is not None:  # per rank, so last: the pipeline keeps only its stage's model pieces
        attach_rng_states(engine, layout.tracker, mesh.rank)
    if scheduler is None and not is_constant(config.optim):
        scheduler = schedule_factory(config.optim, config.steps)
    return attach_optimizers(engine, factory or optimizer_factory(config.optim), scheduler)
