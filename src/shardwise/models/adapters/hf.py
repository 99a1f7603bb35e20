"""What the Hugging Face families share: the causal mask as their body makes it, the config reader for
the planner, and transformers' own registries as the seams for the next axes.

Attention: transformers looks each layer's attention function up by name in ``AttentionInterface``
(``config._attn_implementation``: ``sdpa``, ``eager``, ...), and the mask function by the same name in
``AttentionMaskInterface``. ``wrap_attention`` registers ``wrap(current)`` under a name of its own (with
the current mask function beside it) and points the model at it: context parallelism will register
its ring attention there. Experts: a mixture-of-experts layer's experts module is dispatched by name
through ``ExpertsInterface`` (``config._experts_implementation``); ``wrap_experts`` does the same there,
for expert parallelism's token dispatch, and ``experts_modules`` finds those modules. Tested against
transformers 5. transformers is imported only when one of these runs (a model of it was built); the
config reader is plain JSON. No communication here.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.models.adapters.base import ModelAdapter, Wrap, get_module

_names = itertools.count()  # registered implementations are global in transformers: each its own name


def config_int(config: dict[str, Any], path: Path, *keys: str) -> int:
    """The first of ``keys`` holding an integer in a config.json; a one-line ``ConfigError`` otherwise."""
    for key in keys:
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ConfigError(
        f"{path}: no integer {' or '.join(keys)}; the planner reads GPT-2 and Llama-style configs"
    )


def config_name(path: Path) -> str:
    """A config's name for people: its folder for a config.json, else the file's stem."""
    return path.parent.name if path.name == "config.json" else path.stem


def wrap_attention(model: nn.Module, wrap: Wrap) -> str:
    """Route ``model``'s attention through ``wrap(current)``, registered in transformers'
    ``AttentionInterface`` (called as its functions are: ``(module, query, key, value, attention_mask,
    *, dropout, scaling, **kwargs) -> (output, weights)``, query of (batch, heads, seq, head_dim));
    returns the name it is registered under."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = getattr(model, "config", None)
    current = config._attn_implementation
    # for "eager", transformers calls the modeling module's own function
    eager: Any = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
    if current == "eager" and eager is None:
        raise ConfigError(f"{type(model).__name__} runs eager attention of its own, which cannot be wrapped")
    name = f"shardwise-attention-{next(_names)}"
    AttentionInterface.register(name, wrap(ALL_ATTENTION_FUNCTIONS.get_interface(current, eager)))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)  # type: ignore[operator]
    return name


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module transformers dispatches through ``ExpertsInterface``
    (classes decorated with ``use_experts_implementation``: their forward looks the function up)."""
    marks = ("has_gate", "is_transposed", "_is_expert_parallel")  # what the decorator's __init__ sets
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(type(module).forward, "__wrapped__") and all(hasattr(module, a) for a in marks)
    ]


def wrap_experts(model: nn.Module, wrap: Wrap) -> str:
    """Route ``model``'s experts through ``wrap(current)``, registered in transformers'
    ``ExpertsInterface`` (called as its functions are: ``(experts_module, hidden_states, top_k_index,
    top_k_weights) -> hidden_states``); returns the name it is registered under."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    found = experts_modules(model)
    if not found:
        raise ConfigError(
            f"{type(model).__name__} has no experts module that transformers dispatches "
            "(ExpertsInterface), so there are no experts to route"
        )
    config: Any = getattr(model, "config", None)
    forward: Any = type(found[0][1]).forward
    original = forward.__wrapped__  # the class's own forward: transformers' "eager"
    name = f"shardwise-experts-{next(_names)}"
    current = ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation, original)
    ExpertsInterface.register(name, wrap(current))
    model.set_experts_implementation(name)  # type: ignore[operator]
    return name


def position_ids(hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's ``position_ids``, else 0 .. seq - 1 (Hugging Face's default without a cache)."""
    given = extras.get("position_ids")
    if given is not None:
        return given
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, seq)


class HFAdapter(ModelAdapter):
    """What Hugging Face families share: the causal mask as their body's forward makes it, and the
    registries for the seams."""

    body_path = ""  # the module whose forward the family's forward calls (``transformer``, ``model``)
    module_name = ""  # transformers' module of the family (looked up only once it is imported)
    class_names = ("", "")  # (the family's class, its body's class) in that module

    @classmethod
    def root(cls) -> type[nn.Module] | None:
        module = sys.modules.get(cls.module_name)
        return None if module is None else getattr(module, cls.class_names[0])

    @classmethod
    def body(cls) -> tuple[str, type[nn.Module]] | None:
        module = sys.modules.get(cls.module_name)
        return None if module is None else (cls.body_path, getattr(module, cls.class_names[1]))

    def _like(self, hidden: torch.Tensor) -> torch.Tensor:
        """A stand-in for the body's ``inputs_embeds`` where only its batch, length, dtype and device are
        read (the mask, the rotary tables): the embedding's dtype, whatever dtype arrived."""
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), hidden.dtype)
        return hidden.new_empty((hidden.shape[0], hidden.shape[1], 0), dtype=dtype)

    def _cache(self) -> Any:
        """An empty cache where the body's forward makes one (``config.use_cache``, off under Hugging
        Face's own gradient checkpointing in training): with a cache, transformers does not look for
        packed rows in the position ids. The blocks are not given it (it would only keep keys)."""
        body, config = get_module(self.model, self.body_path), self.model.config
        use = bool(getattr(config, "use_cache", False))
        if getattr(body, "gradient_checkpointing", False) and body.training and torch.is_grad_enabled():
            use = False
        if not use:
            return None
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=config)

    def causal_mask(self, like: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> Any:
        from transformers.masking_utils import create_causal_mask

        return create_causal_mask(
            config=self.model.config, inputs_embeds=like, attention_mask=mask, cache=self._cache(),
            position_ids=positions,
        )  # fmt: skip

    def block_kwargs(self) -> dict[str, Any]:
        """What the body passes every block beyond the mask and positions: ``is_causal`` where the config
        has one (transformers' ``merge_with_config_defaults``)."""
        config = self.model.config
        return {"is_causal": config.is_causal} if hasattr(config, "is_causal") else {}

    # -- seams ----------------------------------------------------------------------------------

    def wrap_attention(self, wrap: Wrap) -> None:
        """Through transformers' ``AttentionInterface`` (see :func:`wrap_attention`)."""
        wrap_attention(self.model, wrap)

    def moe_layers(self) -> list[tuple[str, nn.Module]]:
        """The experts modules transformers dispatches (none in a dense family)."""
        return experts_modules(self.model)

    def wrap_experts(self, wrap: Wrap) -> None:
        """Through transformers' ``ExpertsInterface`` (see :func:`wrap_experts`)."""
        wrap_experts(self.model, wrap)
