"""Activation checkpointing: each block keeps only its inputs in forward and recomputes its
activations in backward (``torch.utils.checkpoint``, non-reentrant), the step of ``parallelize``
between the pipeline split and data parallelism. The blocks are the model's block list (its
adapter's, or ``zero.unit``'s); dropout masks repeat in the recomputation, tensor parallelism's private
streams too. No communication of its own (ZeRO-3's gathers run again around a recomputed block).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.config import ConfigError, TrainConfig
from shardwise.models.adapters import adapter_for
from shardwise.tensor_parallel.random import RNGStatesTracker


@contextmanager
def _replayed(tracker: RNGStatesTracker, states: dict[str, torch.Tensor]) -> Iterator[None]:
    """The tracker's states as they were at the forward, for the recomputation; then as they are."""
    now = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(now)


def apply_activation_checkpointing(
    model: nn.Module, config: TrainConfig, tracker: RNGStatesTracker | None = None
) -> None:
    """Step 5 of ``parallelize``: each block of the model's block list (``zero.unit``'s, else its
    adapter's) keeps only its inputs in forward and recomputes its activations in backward.

    The block's own ``forward`` is wrapped (``torch.utils.checkpoint``, non-reentrant, the RNG state
    restored for the recomputation so dropout masks repeat), not the module: parameter names stay the
    model's, and hooks on the block (ZeRO-3's gather and release) run once per forward, around it. A
    model without a block list is refused in one line.
    """
    if not config.parallel.activation_checkpointing:
        return
    found = adapter_for(model).block_list(config.zero.unit)
    if found is None:
        raise ConfigError(
            f"activation checkpointing recomputes each block, but {type(model).__name__} has no "
            "ModuleList/Sequential of blocks; turn parallel.activation_checkpointing off"
        )
    for block in found.blocks:
        checkpoint_forward(block, tracker)


def checkpoint_forward(block: nn.Module, tracker: RNGStatesTracker | None = None) -> None:
    """Make ``block``'s forward recompute its activations in backward instead of keeping them.

    ``tracker``: tensor parallelism's private dropout states, set back for the recomputation to what
    they were at the forward (torch restores its own generator's), so every mask repeats."""
    inner = block.forward

    def contexts() -> tuple[Any, Any]:
        return nullcontext(), _replayed(tracker, tracker.get_states()) if tracker else nullcontext()

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to keep, nothing to recompute
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(
            inner, *args, use_reentrant=False, context_fn=contexts, **kwargs
        )

    block.forward = forward
