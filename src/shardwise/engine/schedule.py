"""The built-in learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The multiplier of the base learning rate at step s (0-based; the update of step s uses it):

    warm-up, s < W:         (s + 1) / (W + 1)
    after it, p = (s - W) / max(1, S - 1 - W) in [0, 1], m = min_lr / lr:
        constant:           1
        linear:             1 - p (1 - m)
        cosine:             m + (1 - m) (1 + cos(pi p)) / 2

so linear and cosine reach ``min_lr`` exactly at the last step S - 1. S is the run's steps, or
``schedule_steps`` when set: a longer run then stays at ``min_lr`` after step S - 1. It is a torch
``LambdaLR``, stepped once after each update by every strategy's one update path
(``Engine.run_optimizers``), on every rank that holds an optimizer (the servers, for a parameter
server). No communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from shardwise.config import OptimizerConfig


def lr_multiplier(config: OptimizerConfig, steps: int) -> Callable[[int], float]:
    """The multiplier of ``config.lr`` at each step of a run of ``steps`` steps."""
    steps = config.schedule_steps or steps
    warmup, floor = config.warmup_steps, (config.min_lr / config.lr if config.lr else 0.0)

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
        if config.lr_schedule == "linear":
            return 1.0 - progress * (1.0 - floor)
        if config.lr_schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return multiplier


def is_constant(config: OptimizerConfig) -> bool:
    return config.lr_schedule == "constant" and config.warmup_steps == 0


def schedule_factory(config: OptimizerConfig, steps: int) -> Callable[[torch.optim.Optimizer], LRScheduler]:
    """Builds the run's schedule over one optimizer (ZeRO has one per flat group: each gets one)."""
    multiplier = lr_multiplier(config, steps)
    return lambda optimizer: LambdaLR(optimizer, multiplier)
