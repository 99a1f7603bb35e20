"""Optimizers, built in one place over what each rank holds, after the strategy is applied.

The data-parallel layer says what a rank's optimizers update (``Engine.optimizer_units``: whole
parameters for DDP, flat master shards for ZeRO, the served parameters on a parameter server); one
factory builds an optimizer per unit, and ``attach_optimizers`` hands them to the engine. Strategies
never build optimizers themselves, so anything that wraps or schedules an optimizer composes with
every strategy. No communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config import ConfigError, OptimizerConfig

if TYPE_CHECKING:
    from shardwise.engine.base import Engine

NamedParams = Sequence[tuple[str, torch.Tensor]]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
E = TypeVar("E", bound="Engine")
OptimizerFactory = Callable[[NamedParams], torch.optim.Optimizer]


def build_optimizer(named: NamedParams, config: OptimizerConfig) -> torch.optim.Optimizer:
    """An optimizer over the tensors of ``named`` (names are for factories that group by name)."""
    params = [p for _, p in named]
    fast = _on_gpu(params)
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay, foreach=fast
        )
    cls = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
    return cls(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        weight_decay=config.weight_decay,
        **({"fused": True} if fast else {"foreach": False}),
    )


def _on_gpu(params: Sequence[torch.Tensor]) -> bool:
    """Whether the update takes torch's GPU paths (fused Adam/AdamW, foreach SGD: a few kernels for
    every tensor instead of several per tensor): tensors on CUDA, in a dtype other than float64.

    Elsewhere (the CPU, float64 on any device) ``foreach=False``: the per-tensor loop gives
    bit-identical updates whether parameters are whole or flattened shards, which the parity tests
    rely on; a CPU-offloaded ZeRO shard is stepped there too."""
    return bool(params) and all(p.is_cuda and p.dtype != torch.float64 for p in params)


def optimizer_factory(config: OptimizerConfig) -> OptimizerFactory:
    return lambda named: build_optimizer(named, config)


def named(params: Sequence[torch.nn.Parameter] | torch.nn.Module) -> NamedParams:
    """Trainable tensors with positional names, for building a plain reference optimizer."""
    items = params.parameters() if isinstance(params, torch.nn.Module) else params
    return [(str(i), p) for i, p in enumerate(p for p in items if p.requires_grad)]


def attach_optimizers(engine: E, factory: OptimizerFactory, scheduler: SchedulerFactory | None = None) -> E:
    """Build one optimizer per unit the engine declares (and a learning-rate scheduler over each, when
    ``scheduler`` is given) and hand them over; returns the engine."""
    if not engine.units_are_parameters:
        _refuse_param_groups(engine, factory)
    engine.attach_optimizers([_optimizer(factory, unit) for unit in engine.optimizer_units()])
    engine.schedulers = [_scheduler(scheduler, opt) for opt in engine.optimizers] if scheduler else []
    return engine


def _optimizer(factory: OptimizerFactory, named: NamedParams) -> torch.optim.Optimizer:
    """``factory(named)``, which must be an optimizer (a factory that forgot its ``return`` is common)."""
    optimizer = factory(named)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer: "
            "make it return the optimizer it builds over the (name, parameter) pairs it is given"
        )
    return optimizer


def _scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """``factory(optimizer)``, which must be a learning-rate scheduler (something with ``step()``)."""
    scheduler = factory(optimizer)
    if not callable(getattr(scheduler, "step", None)):
        raise ConfigError(
            f"the scheduler factory returned {type(scheduler).__name__}, not a learning-rate scheduler: "
            "make it return the torch.optim.lr_scheduler it builds over the optimizer it is given"
        )
    return scheduler


def _refuse_param_groups(engine: Engine, factory: OptimizerFactory) -> None:
    """Flat shards mix parameters: a factory that groups parameters by name cannot be honoured there.

    The factory is tried on the model's own named parameters (building an optimizer allocates no
    state); more than one param group is refused in one line rather than silently merged.
    """
    probe = _optimizer(factory, [(n, p) for n, p in engine.model.named_parameters() if p.requires_grad])
    if len(probe.param_groups) > 1:
        raise ConfigError(
            f"{engine.name} steps flat shards that mix parameters, so the optimizer factory's "
            f"{len(probe.param_groups)} param groups cannot be kept apart; use one group (or ddp / ps)"
        )


def fast_forward(schedulers: Sequence[LRScheduler], steps: int) -> None:
    """Advance schedulers over ``steps`` completed steps (a resumed run): exact for schedules that
    depend only on the step count, which is what torch's built-in schedulers are."""
    for scheduler in schedulers:
        for _ in range(steps):
            scheduler.step()
