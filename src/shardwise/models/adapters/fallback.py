"""A model of no family we know (an MLP, a user's own, a Hugging Face class with no adapter): its blocks
are found (``blocks.py``) for ZeRO-3's units and activation checkpointing, and that is all. Tensor and
pipeline parallelism, and the attention and experts seams, are refused in one line naming the class:
such a model is never run by calling its blocks in sequence, nor cut by a plan written for another.
No communication here.
"""

from __future__ import annotations

from torch import nn

from shardwise.config import ConfigError
from shardwise.models.adapters.base import ModelAdapter, SplitError, Wrap
from shardwise.models.adapters.plan import TensorParallelPlan

WITH_ADAPTERS = "the built-in GPT, Hugging Face GPT-2 and Llama"


class FallbackAdapter(ModelAdapter):
    """Blocks only."""

    def tp_plan(self) -> TensorParallelPlan:
        name = type(self.model).__name__
        raise ConfigError(
            f"tensor parallelism needs a plan for the model, and there is none for {name}: "
            f"{WITH_ADAPTERS} have one; set parallel.tp = 1"
        )

    def check_pipeline(self) -> None:
        name = type(self.model).__name__
        raise SplitError(
            f"a {name} cannot be split into pipeline stages: pp > 1 runs the built-in GPT "
            "and Hugging Face GPT2LMHeadModel and LlamaForCausalLM (or subclasses that keep their "
            "forward); set parallel.pp = 1"
        )

    def _no_adapter(self, what: str) -> ConfigError:
        return ConfigError(
            f"{type(self.model).__name__} has no adapter ({WITH_ADAPTERS} have one), so {what}; "
            "use one of those models"
        )

    def attention_modules(self) -> list[tuple[str, nn.Module]]:
        raise self._no_adapter("its attention modules are not known")

    def wrap_attention(self, wrap: Wrap) -> None:
        raise self._no_adapter("its attention cannot be replaced")

    def moe_layers(self) -> list[tuple[str, nn.Module]]:
        raise self._no_adapter("its MoE layers are not known")

    def wrap_experts(self, wrap: Wrap) -> None:
        raise self._no_adapter("its experts cannot be replaced")
