"""Strategy registry: turn a config and a plain model into an ``Engine`` (one place for all)."""

from __future__ import annotations

from torch import nn

from shardwise.collectives.api import Comm
from shardwise.config import TrainConfig
from shardwise.train.engine import Engine
from shardwise.train.optim import optimizer_factory


def build_engine(
    config: TrainConfig, model: nn.Module, dp_comm: Comm, world_comm: Comm, share_gradients: bool = False
) -> Engine:
    """Apply ``config.strategy`` to ``model`` in place and return the engine that trains it."""
    factory = optimizer_factory(config.optim)
    if config.strategy == "ddp":
        from shardwise.data_parallel.ddp import DDPEngine

        return DDPEngine(model, dp_comm, factory, config.ddp)
    if config.strategy in ("zero1", "zero2", "zero3"):
        from shardwise.zero import build_zero_engine

        return build_zero_engine(model, dp_comm, factory, int(config.strategy[-1]), config.zero)
    if config.strategy == "ps":
        from shardwise.data_parallel.param_server import ParamServerEngine

        return ParamServerEngine(model, world_comm, factory, config.ps, config.steps, share_gradients)
    raise ValueError(f"strategy {config.strategy!r} cannot run under the distributed train loop")
