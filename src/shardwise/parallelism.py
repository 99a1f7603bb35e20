"""``parallelize(model, mesh, config)``: every axis applied to the model from outside, in one order.

The mesh's axes (``shardwise.dims``) cut the model in torchtitan's fixed order, after it is moved to
this rank's device (``config.device`` in the joined group: its GPU or the CPU). Each step is a call on
one axis object, and each axis that then holds part of the model is joined to the engine, which asks
it for its part of every global answer (``engine/axis.py``):

0. ``pp`` plans its stages' blocks on the whole model (``pipeline.split.plan_stages``), as the
   planner does, before tp changes the layers it weighs;
1. ``tp`` (``tensor_parallel.axis``): each layer cut by the model's plan, parameters local shards;
2. ``cp``: the sequence cut over ranks (not built yet: refused above 1);
3. ``ep``: experts spread over ranks (not built yet: refused above 1);
4. ``pp`` (``pipeline.axis``): this rank keeps its stage(s), parameter names preserved;
5. activation checkpointing, per block (``activation_checkpointing``);
6. data parallelism (``strategies.DataParallel``): ddp | zero1-3 | ps | diloco over what the rank
   holds, the returned ``Engine``;
7. the optimizers, built by one factory over what the rank holds after all of it (so they compose).

A model built on the meta device (``build_model(meta=True)``, as the Trainer builds it) goes through
steps 1-5 there, and step 6 gives it its initial values from one source (:mod:`shardwise.materialize`:
``model.init_from``'s files, or the model's recorded initialisation), each rank reading only what it
holds: its stage, its tp shards, ZeRO-1/2's flat buckets, its ZeRO-3 shard; so no rank ever holds the
whole model. A model passed in built keeps its values.

A step that is not built yet refuses in one line (``NotBuiltError``) when the config asks for it,
rather than being silently skipped; each axis checks the config when it is made, and ``check`` runs
the same refusals on the config alone, so commands can fail before any rank starts. Communication:
only the data-parallel engine's start-up (initial weights from rank 0, or from the servers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.activation_checkpointing import apply_activation_checkpointing
from shardwise.checkpoint.source import NoValues, WeightSource
from shardwise.config import ConfigError, TrainConfig
from shardwise.device import joined_device, place_model
from shardwise.engine.axis import NOT_BUILT, NotBuiltAxis
from shardwise.engine.base import Engine
from shardwise.engine.loss import Loss, as_loss
from shardwise.engine.optim import OptimizerFactory, SchedulerFactory, attach_optimizers, optimizer_factory
from shardwise.engine.schedule import is_constant, schedule_factory
from shardwise.errors import NotBuiltError
from shardwise.materialize import held_weights, weight_source
from shardwise.mesh import Mesh
from shardwise.models.meta import meta_parameters
from shardwise.pipeline.axis import PipelineAxis, check_pipeline
from shardwise.strategies import DataParallel, check_hybrid
from shardwise.tensor_parallel.axis import TensorParallelAxis, check_tensor_parallel
from shardwise.zero.base import broadcast_initial_state

__all__ = ["NotBuiltError", "check", "parallelize"]


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
    """Apply every axis to ``model`` in place, in the fixed order, and return the engine with its
    optimizers. ``factory`` builds each optimizer from named tensors (default: ``config.optim``'s);
    ``loss`` is what the engine minimises (a SUM per micro-batch and a count, ``engine.loss``; default:
    token or causal-LM cross-entropy); ``scheduler`` builds a ``torch.optim.lr_scheduler`` over each
    optimizer; ``share_gradients`` makes global gradients visible on every rank that steps (verify);
    ``weights``: where the tensors on the meta device get their values (default: ``model.init_from``,
    else the model's recorded initialisation; ``NoValues``: none, the rank runs on meta)."""
    _require_trainable(model)
    device = joined_device(config.device)
    place_model(model, device)  # a model built with values (yours) moved first; tensors on meta stay
    _share_rank0_values(model, mesh, config)
    tp, pp = TensorParallelAxis(mesh, config), PipelineAxis(mesh, config)
    cp, ep = NotBuiltAxis("cp", config.parallel.cp), NotBuiltAxis("ep", config.parallel.ep)
    dp = DataParallel(mesh, config, share_gradients)
    with weight_source(model, mesh, config, weights) as source:  # matched to the whole model
        pp.plan(model)  # 0. the stages' blocks, on the whole model (the planner's cut at any tp)
        tp.apply(model, device)  # 1. each layer cut by the model's plan (on meta, if built there)
        cp.apply(model)  # 2. the sequence (not built)
        ep.apply(model)  # 3. the experts (not built)
        pp.apply(model)  # 4. this rank's stages
        apply_activation_checkpointing(model, config, tp.tracker)  # 5. per block
        held = None
        if source is not None:  # each rank materialises only what it holds, from the one source
            held = held_weights(source, model, tp.layout, pp.runner, device, bool(config.model.init_from))
        engine = dp.apply(model, held)  # 6. the data-parallel engine over what the rank holds
    if (left := meta_parameters(model)) and not isinstance(weights, NoValues):  # never train on no data
        raise RuntimeError(f"{config.strategy} left parameters on the meta device: {', '.join(left[:3])}")
    engine.join([tp, cp, ep, pp])  # each global answer widened over the axes that cut the model
    engine.loss = tp.loss(as_loss(loss) if loss is not None else engine.loss)
    default = None if is_constant(config.optim) else schedule_factory(config.optim, config.steps)
    return attach_optimizers(engine, factory or optimizer_factory(config.optim), scheduler or default)  # 7.


def check(config: TrainConfig) -> None:
    """Refuse, in one line, what the config asks for and no step can do yet (each axis's refusals,
    on the config alone, the config's own model included)."""
    for name in NOT_BUILT:
        NotBuiltAxis(name, getattr(config.parallel, name))
    check_hybrid(config)
    check_tensor_parallel(config)
    check_pipeline(config)


def _share_rank0_values(model: nn.Module, mesh: Mesh, config: TrainConfig) -> None:
    """A model passed in built, about to be cut by tp or pp: rank 0's values reach every rank that
    trains first (one broadcast per tensor, in place), so each rank's part is cut from the same whole
    model whatever each rank's seed; the data-parallel engines alone broadcast over dp only. Nothing
    for a model on meta (its values come from one source) or one ``model.init_from`` overwrites."""
    parallel = config.parallel
    if (parallel.tp == 1 and parallel.pp == 1) or config.model.init_from or mesh.trainers is None:
        return
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    broadcast_initial_state(model, mesh.trainers)


def _require_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            "the model has no trainable parameters (none with requires_grad=True), so there is nothing "
            "to train; leave some unfrozen"
        )
