"""Hugging Face ``LlamaForCausalLM``: ``model.{embed_tokens, layers, norm, rotary_emb}`` and ``lm_head``.

Everything shardwise knows of it: the block list (``model.layers``), the tensor-parallel plan (separate
q/k/v projections sharing one f; grouped-query attention), the pipeline pieces (``attention_mask`` and
``position_ids``, and the rotary tables every stage makes from the positions), its sizes from a
config.json (read as JSON; any config not GPT-2's is read as Llama-style), and the seams through
transformers' registries (``hf.py``). No communication here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from shardwise.config import ConfigError
from shardwise.models.adapters.hf import HFAdapter, config_int, config_name, position_ids
from shardwise.models.adapters.plan import (
    AttentionCore,
    Colwise,
    ParallelInput,
    Rowwise,
    SequenceParallelNorm,
    SequenceSplit,
    TensorParallelPlan,
    VocabEmbedding,
)
from shardwise.planner.model import ModelShape


def hf_llama_plan(n_head: int, n_kv_head: int) -> TensorParallelPlan:
    """Separate q/k/v projections share one f (``ParallelInput`` on the attention), as gate/up do on the
    MLP; grouped-query attention needs tp to divide the key/value head count. Under sequence parallelism
    the first decoder layer's input is cut (Llama computes positions and masks from the embedding's
    length)."""
    return TensorParallelPlan(
        "hf-llama",
        {
            "model.embed_tokens": VocabEmbedding(sequence_output=False),
            "model.layers.0": SequenceSplit(dim=1, on="input"),
            "model.layers.*.input_layernorm": SequenceParallelNorm(),
            "model.layers.*.self_attn": (ParallelInput(), AttentionCore(opens=("q_proj",), closes="o_proj")),
            "model.layers.*.self_attn.q_proj": Colwise(copy_input=False, heads=n_head),
            "model.layers.*.self_attn.k_proj": Colwise(
                copy_input=False, heads=n_kv_head, heads_name="n_kv_head"
            ),
            "model.layers.*.self_attn.v_proj": Colwise(
                copy_input=False, heads=n_kv_head, heads_name="n_kv_head"
            ),
            "model.layers.*.self_attn.o_proj": Rowwise(),
            "model.layers.*.post_attention_layernorm": SequenceParallelNorm(),
            "model.layers.*.mlp": ParallelInput(),
            "model.layers.*.mlp.gate_proj": Colwise(copy_input=False),
            "model.layers.*.mlp.up_proj": Colwise(copy_input=False),
            "model.layers.*.mlp.down_proj": Rowwise(),
            "model.norm": SequenceParallelNorm(),
            "lm_head": Colwise(),
        },
    )


class HFLlamaAdapter(HFAdapter):
    """Hugging Face Llama."""

    name: ClassVar[str] = "hf-llama"
    module_name = "transformers.models.llama.modeling_llama"
    class_names = ("LlamaForCausalLM", "LlamaModel")
    first_modules: ClassVar[tuple[str, ...]] = ("model.embed_tokens",)
    last_modules: ClassVar[tuple[str, ...]] = ("model.norm", "lm_head")
    shared_modules: ClassVar[tuple[str, ...]] = ("model.rotary_emb",)
    blocks_path: ClassVar[str] = "model.layers"
    attention_path: ClassVar[str] = "self_attn"
    body_path = "model"
    batch_keys: ClassVar[tuple[str, ...] | None] = ("attention_mask", "position_ids")

    def _tp_plan(self) -> TensorParallelPlan:
        config = self.model.config
        return hf_llama_plan(config.num_attention_heads, config.num_key_value_heads)

    # -- the pipeline ---------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def embed(self, ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def context(self, hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        positions, like = position_ids(hidden, extras), self._like(hidden)
        mask = self.causal_mask(like, extras.get("attention_mask"), positions)
        rotary = self.model.model.rotary_emb(like, position_ids=positions)  # (cos, sin)
        return {"mask": mask, "positions": positions, "rotary": rotary}

    def block(self, index: int, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        out = self.model.model.layers[str(index)](
            hidden,
            attention_mask=context["mask"],
            position_ids=context["positions"],
            position_embeddings=context["rotary"],
            **self.block_kwargs(),
        )
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    def tied_pair(self) -> tuple[str, str] | None:
        tied = self.model.lm_head.weight is self.model.model.embed_tokens.weight
        return ("model.embed_tokens.weight", "lm_head.weight") if tied else None

    # -- the planner ----------------------------------------------------------------------------

    @classmethod
    def reads(cls, config: dict[str, Any]) -> bool:
        """Every config not claimed before it is read as Llama-style (Mistral, Qwen2 and the like)."""
        return True

    @classmethod
    def config_shape(cls, config: dict[str, Any], path: Path) -> ModelShape:
        """A Llama-style config's sizes (as JSON)."""
        heads = "num_attention_heads"
        if "head_dim" in config and config["head_dim"] * config_int(config, path, heads) != config.get(
            "hidden_size"
        ):
            raise ConfigError(
                f"{path}: head_dim x num_attention_heads != hidden_size; the planner cannot size it"
            )
        if bool(config.get("mlp_bias", False)) != bool(config.get("attention_bias", False)):
            raise ConfigError(f"{path}: attention_bias and mlp_bias differ; the planner sizes them alike")
        return ModelShape(
            n_layer=config_int(config, path, "num_hidden_layers"),
            d_model=config_int(config, path, "hidden_size"),
            n_head=config_int(config, path, heads),
            vocab=config_int(config, path, "vocab_size"),
            d_ff=config_int(config, path, "intermediate_size"),
            n_kv_head=config.get("num_key_value_heads") or 0,
            tie_weights=bool(config.get("tie_word_embeddings", False)),
            gated_mlp=True,
            bias=bool(config.get("attention_bias", False)),
            layer_norm=False,
            name=config_name(path),
            context=int(config.get("max_position_embeddings") or 0),
        )
