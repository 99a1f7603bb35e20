"""Optimizer construction from ``OptimizerConfig``: one place, so every strategy builds the same one."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from shardwise.config import OptimizerConfig

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """An optimizer over ``params``; strategies that shard state call this on their shard only."""
    params = list(params)
    # foreach=False: the per-tensor loop gives bit-identical updates whether parameters are whole or
    # flattened shards, which the parity tests rely on.
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay, foreach=False
        )
    cls = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
    return cls(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        weight_decay=config.weight_decay,
        foreach=False,
    )


def optimizer_factory(config: OptimizerConfig) -> OptimizerFactory:
    return lambda params: build_optimizer(params, config)
