"""shardwise: distributed training on torch.distributed, every strategy checked against one process.

The composable core: ``ParallelDims`` (validated degrees), ``build_mesh`` (named axes, one ``Comm``
each) and ``parallelize`` (tensor, pipeline, activation checkpointing, then data parallelism, in that
order, returning the ``Engine`` that trains). Names are imported on first use, so ``import shardwise``
stays cheap (the command line starts fast and answers signals at once).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ParallelDims": "shardwise.config",
    "TrainConfig": "shardwise.config",
    "Mesh": "shardwise.mesh",
    "build_mesh": "shardwise.mesh",
    "Engine": "shardwise.engine.base",
    "Role": "shardwise.engine.base",
    "parallelize": "shardwise.parallelism",
}

__all__ = ["Engine", "Mesh", "ParallelDims", "Role", "TrainConfig", "build_mesh", "parallelize"]

if TYPE_CHECKING:
    from shardwise.config import ParallelDims, TrainConfig
    from shardwise.engine.base import Engine, Role
    from shardwise.mesh import Mesh, build_mesh
    from shardwise.parallelism import parallelize


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
