"""Route a stage's linear layers through ``engine.linear`` so a zero-bubble I pass can defer their ``dW``.

``defer_weight_grads(model, store)`` walks what this rank holds after the split and makes every
linear layer compute through ``engine.linear.linear`` with ``store``: a plain ``nn.Linear`` and
Hugging Face's ``Conv1D`` get their ``forward`` wrapped (as activation checkpointing wraps a block's:
parameter names and hooks unchanged; subclasses with a forward of their own are left alone), and a
layer that declares a ``weight_grads`` attribute (the tensor-parallel layers, which call
``engine.linear`` themselves) is handed the store. Every other parameter (norms, embeddings, a
custom layer's) gets its gradient in I as in a full backward, so what is not recognised here is
still trained exactly, only not deferred. Layers given as ``plain`` keep the plain op: the pipeline
gives the head that reads a tied weight's copy (``split.Tied``), so the copy's gradient is whole once
the last stage's last I ran and leaves then for the first stage (``pipeline/tied.py``), not after the
last W. No communication here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from shardwise.engine.linear import WeightGradStore, linear
from shardwise.pipeline.split import Split


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (a linear with its weight stored (in, out)), by name: transformers is
    not a dependency of this module."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def defer_stage_weight_grads(split: Split, store: WeightGradStore) -> int:
    """What a pipeline rank defers: the linear layers of what it holds after ``split``, but the head
    that reads a tied weight's copy (``Split.tied``), whose dW then comes in I."""
    head = [split.tied.user] if split.tied is not None and split.tied.user is not None else []
    return defer_weight_grads(next(iter(split.stages.values())).adapter.model, store, head)


def defer_weight_grads(model: nn.Module, store: WeightGradStore, plain: Collection[nn.Module] = ()) -> int:
    """Make ``model``'s linear layers but ``plain`` defer their weight gradients to ``store``; returns
    how many."""
    count = 0
    for module in model.modules():
        if any(module is kept for kept in plain):
            continue
        if hasattr(module, "weight_grads"):
            setattr(module, "weight_grads", store)  # noqa: B010 (a layer's own attribute, by protocol)
        elif type(module) is nn.Linear:
            module.forward = _deferring(module, False, store)  # type: ignore[method-assign]
        elif is_conv1d(module):
            module.forward = _deferring(module, True, store)
        else:
            continue
        count += 1
    return count


def _deferring(module: nn.Module, transposed: bool, store: WeightGradStore) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias  # read at each call: a tied copy, a ZeRO-3 view
        assert isinstance(weight, torch.Tensor)
        return linear(x, weight, bias if isinstance(bias, torch.Tensor) else None, transposed, store)

    return forward
