"""shardwise: distributed training on torch.distributed, every strategy checked against one process.

A script of your own::

    import shardwise as sw

    def main():
        config = sw.load_config(overrides={"strategy": "zero2", "steps": 100})
        trainer = sw.Trainer.build(config, model=MyModel(), dataset=my_data, loss=my_loss)
        return trainer.fit()  # the summary on the reporting rank

    if __name__ == "__main__":
        sw.launch(main, nproc=2)  # or: torchrun --nproc-per-node 2 script.py

Underneath, the composable core: ``ParallelDims`` (the table of axes and their degrees),
``build_mesh`` (every group of the table, one ``Comm`` each) and ``parallelize`` (tensor, pipeline,
activation checkpointing, then data parallelism, in that order), returning the ``Engine`` whose
``train_step`` a hand-written loop calls.
Names are imported on first use, so ``import shardwise`` stays cheap. No submodule shares a name with
an export: importing a submodule sets it as an attribute of the package, which would hide the export
(``shardwise.launch`` the function once lived beside ``shardwise/launch.py``; the module is ``launcher``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "launch": "shardwise.api",
    "init": "shardwise.api",
    "TrainConfig": "shardwise.config",
    "ParallelDims": "shardwise.dims",
    "load_config": "shardwise.config",
    "ConfigError": "shardwise.config",
    "Mesh": "shardwise.mesh",
    "build_mesh": "shardwise.mesh",
    "parallelize": "shardwise.parallelism",
    "Engine": "shardwise.engine.base",
    "Role": "shardwise.engine.base",
    "Loss": "shardwise.engine.loss",
    "LossError": "shardwise.engine.loss",
    "NonFiniteStop": "shardwise.engine.nonfinite",
    "CausalLMLoss": "shardwise.engine.loss",
    "TokenLoss": "shardwise.engine.loss",
    "summed": "shardwise.engine.loss",
    "Trainer": "shardwise.train.loop",
    "load_checkpoint": "shardwise.engine.full_state",
    "LaunchError": "shardwise.launcher",
}

__all__ = [
    "CausalLMLoss",
    "ConfigError",
    "Engine",
    "LaunchError",
    "Loss",
    "LossError",
    "Mesh",
    "NonFiniteStop",
    "ParallelDims",
    "Role",
    "TokenLoss",
    "TrainConfig",
    "Trainer",
    "build_mesh",
    "init",
    "launch",
    "load_checkpoint",
    "load_config",
    "parallelize",
    "summed",
]

if TYPE_CHECKING:
    from shardwise.api import init, launch
    from shardwise.config import ConfigError, TrainConfig, load_config
    from shardwise.dims import ParallelDims
    from shardwise.engine.base import Engine, Role
    from shardwise.engine.full_state import load_checkpoint
    from shardwise.engine.loss import CausalLMLoss, Loss, LossError, TokenLoss, summed
    from shardwise.engine.nonfinite import NonFiniteStop
    from shardwise.launcher import LaunchError
    from shardwise.mesh import Mesh, build_mesh
    from shardwise.parallelism import parallelize
    from shardwise.train.loop import Trainer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The public API (imported lazily, so absent from the module's dict until first used)."""
    return sorted(set(globals()) | set(__all__))
