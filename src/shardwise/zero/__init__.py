"""ZeRO stages 1-3 as Engines, the shard arithmetic they share, offload and memory accounting."""

from __future__ import annotations

from torch import nn

from shardwise.collectives.api import Comm
from shardwise.config import ZeroConfig
from shardwise.zero.base import OptimizerFactory, ZeroBase
from shardwise.zero.flat_param import FlatLayout, Piece, build_layout, layout_of, unique_parameters
from shardwise.zero.optimizer import ZeroEngine

__all__ = [
    "FlatLayout",
    "Piece",
    "ZeroBase",
    "ZeroEngine",
    "build_layout",
    "build_zero_engine",
    "layout_of",
    "unique_parameters",
]


def build_zero_engine(
    model: nn.Module, comm: Comm, optimizer_factory: OptimizerFactory, stage: int, config: ZeroConfig
) -> ZeroBase:
    """The ZeRO engine of ``stage`` (1, 2 or 3) over the data-parallel group ``comm``."""
    if stage == 3:
        from shardwise.zero.sharded_module import ShardedModule

        return ShardedModule(model, comm, optimizer_factory, config)
    return ZeroEngine(model, comm, optimizer_factory, stage, config)
