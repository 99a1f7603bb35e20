"""One check of a whole job's config before any rank starts: values, degrees, model, parallelism.

Commands call ``preflight`` before launching, so a config that cannot run fails in one line at once
instead of inside N ranks. The ranks run the same checks again (``Trainer.build``), which is cheap.
No communication.
"""

from __future__ import annotations

from shardwise.compression import check_compress
from shardwise.config import TrainConfig
from shardwise.models import check_model_config
from shardwise.parallelism import check as check_parallelism


def preflight(config: TrainConfig, world_size: int) -> TrainConfig:
    """The config validated for ``world_size`` ranks (dp resolved), or a one-line ``ConfigError``."""
    config = config.validate(world_size)
    check_model_config(config.model)
    check_parallelism(config)
    check_compress(config.comm, config.strategy)
    return config
