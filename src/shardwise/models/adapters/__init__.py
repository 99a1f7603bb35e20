"""One place per model family: everything the parallel code knows of a model, asked of its adapter.

``adapter_for(model)`` gives the model's :class:`ModelAdapter`: the family's (the built-in GPT,
Hugging Face GPT-2, Llama: a model of that class or of a subclass) or the fallback (blocks only). What
an adapter answers (``base.py``):

- ``block_list(unit="")``: the blocks, for ZeRO-3's units and activation checkpointing (``blocks.py``);
- ``tp_plan()``: the tensor-parallel plan (data, ``plan.py``; applied by ``tensor_parallel``);
- ``check_pipeline()`` and the pieces a stage replays (``inputs``, ``embed``, ``context``, ``block``,
  ``head``, ``tied_pair``, ``first_modules`` ...; ``pipeline_adapter(model)`` checks and returns it);
- ``attention_modules()``, ``wrap_attention(wrap)``: the seam context parallelism will use;
- ``moe_layers()``, ``wrap_experts(wrap)``: the seam expert parallelism will use.

The family rule (a subclass whose forward differs is refused by name under pp and tp) is in
``base.py``; the planner's readers are ``preset_shape`` and ``hf_shape`` (no model built, no
transformers needed). Nothing outside ``shardwise.models`` names a model class or a model type: it asks
here. No communication.
"""

from __future__ import annotations

import json

from torch import nn

from shardwise.config import ConfigError, ModelConfig
from shardwise.models.adapters.base import ModelAdapter, SplitError, StageInputs, Wrap, get_module
from shardwise.models.adapters.blocks import BlockList, block_lists, resolve_units
from shardwise.models.adapters.fallback import FallbackAdapter
from shardwise.models.adapters.gpt import GPTAdapter
from shardwise.models.adapters.hf_gpt2 import HFGPT2Adapter
from shardwise.models.adapters.hf_llama import HFLlamaAdapter
from shardwise.models.adapters.plan import TensorParallelPlan
from shardwise.models.hf import config_path
from shardwise.planner.model import ModelShape

__all__ = [
    "FAMILIES",
    "BlockList",
    "FallbackAdapter",
    "ModelAdapter",
    "SplitError",
    "StageInputs",
    "TensorParallelPlan",
    "Wrap",
    "adapter_for",
    "block_lists",
    "config_blocks",
    "get_module",
    "hf_shape",
    "model_of_shape",
    "pipeline_adapter",
    "preset_shape",
    "resolve_units",
]

FAMILIES: tuple[type[ModelAdapter], ...] = (GPTAdapter, HFGPT2Adapter, HFLlamaAdapter)
HF_READERS = (HFGPT2Adapter, HFLlamaAdapter)  # in order: the first that reads a config.json sizes it


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of ``model``'s family (its class or a subclass of the family's), else the fallback."""
    for family in FAMILIES:
        root = family.root()
        if root is not None and isinstance(model, root):
            return family(model)
    return FallbackAdapter(model)


def pipeline_adapter(model: nn.Module) -> ModelAdapter:
    """``model``'s adapter, checked for a pipeline split: a ``SplitError`` naming the families that
    split, or naming the class whose forward is its own."""
    adapter = adapter_for(model)
    adapter.check_pipeline()
    return adapter


def config_blocks(cfg: ModelConfig) -> int | None:
    """The blocks of the model ``cfg`` describes when known without building it (a built-in preset's),
    else None."""
    return GPTAdapter.config_blocks(cfg)


def preset_shape(preset: str, seq_len: int, tie_weights: bool = True) -> ModelShape:
    """The built-in GPT ``preset`` (``shardwise.models.PRESETS``) at ``seq_len`` learned positions."""
    return GPTAdapter.preset_shape(preset, seq_len, tie_weights)


def model_of_shape(shape: ModelShape) -> nn.Module:
    """A model of ``shape``'s sizes when given by hand (the built-in GPT's structure)."""
    return GPTAdapter.from_shape(shape)


def hf_shape(kind: str) -> ModelShape:
    """The shape of ``hf:PATH`` (a config.json, a folder holding one, or a shipped name), read as JSON:
    GPT-2's when it is one, else Llama-style."""
    path = config_path(kind if kind.startswith("hf:") else f"hf:{kind}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a config must be a JSON object")
    reader = next(family for family in HF_READERS if family.reads(config))
    return reader.config_shape(config, path)
