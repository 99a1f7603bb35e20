"""ZeRO stages 1-3 as Engines, the shard arithmetic they share, offload and memory accounting."""

from __future__ import annotations

from torch import nn

from shardwise.checkpoint.source import HeldWeights
from shardwise.collectives.api import Comm
from shardwise.compression import CompressedComm
from shardwise.config import ZeroConfig
from shardwise.engine.base import Role
from shardwise.zero.base import ZeroBase
from shardwise.zero.flat_param import FlatLayout, Overlap, build_layout, layout_of, unique_parameters
from shardwise.zero.optimizer import ZeroEngine
from shardwise.zero.sharded_module import ShardedModule

__all__ = [
    "FlatLayout",
    "Overlap",
    "ShardedModule",
    "ZeroBase",
    "ZeroEngine",
    "build_layout",
    "build_zero_engine",
    "layout_of",
    "unique_parameters",
]


def build_zero_engine(
    model: nn.Module,
    comm: Comm,
    stage: int,
    config: ZeroConfig,
    role: Role | None = None,
    weights: HeldWeights | None = None,
    compressor: CompressedComm | None = None,
) -> ZeroBase:
    """The ZeRO engine of ``stage`` (1, 2 or 3) over the data-parallel group ``comm`` (no optimizers
    yet: ``engine.optim.attach_optimizers`` builds them over its shards). ``weights``: the initial
    values, read bucket by bucket into stages 1-2's flat buffers (every rank holds the full model)
    and shard by shard by stage 3;
    with ``compressor``, gradients are reduced through the codec layer."""
    engine: ZeroBase
    if stage == 3:
        engine = ShardedModule(model, comm, config, role, weights)
    else:
        engine = ZeroEngine(model, comm, stage, config, role, weights)
    if compressor is not None:
        engine.use_compression(compressor)
    return engine
